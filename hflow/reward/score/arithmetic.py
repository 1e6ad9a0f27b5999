"""Scorer for the built-in arithmetic task (``data_source="hflow/arithmetic"``).

Accepted answer formats, in order of precedence:

1. ``Answer: <integer>`` (case-insensitive, the last such marker wins), e.g. ``... so Answer: -12``;
2. otherwise the last integer anywhere in the response, e.g. ``3 + 4 = 7``.

Integers may carry a minus sign and thousands commas (``1,024``); a decimal whose fraction is zero
(``42.0``) counts as that integer, any other decimal (``3.5``) is a wrong answer. A minus directly
after a digit is an operator, not a sign: ``10-3`` contains the numbers 10 and 3.
"""

from __future__ import annotations

import re
from decimal import Decimal

__all__ = ["compute_score", "extract_answer"]

_NUMBER = r"(?:(?<![0-9])-)?[0-9]+(?:,[0-9]{3})*(?:\.[0-9]+)?"
_ANSWER = re.compile(r"answer\s*:\s*(" + _NUMBER + ")", re.IGNORECASE)
_ANY_NUMBER = re.compile(_NUMBER)


def extract_answer(solution_str: str) -> int | None:
    """The integer the response gives as its answer, or None (no number, or a non-integral one)."""
    matches = _ANSWER.findall(solution_str) or _ANY_NUMBER.findall(solution_str)
    if not matches:
        return None
    value = Decimal(matches[-1].replace(",", ""))
    return int(value) if value == value.to_integral_value() else None


def compute_score(solution_str: str, ground_truth: str | int) -> float:
    """1.0 if the extracted integer equals ``int(ground_truth)``, else 0.0."""
    try:
        expected = int(str(ground_truth).strip())
    except ValueError:
        raise ValueError(
            f"arithmetic.compute_score: ground_truth={ground_truth!r} is not an integer; the hflow/arithmetic "
            "task stores integer answers in reward_model.ground_truth"
        ) from None
    return 1.0 if extract_answer(solution_str) == expected else 0.0
