"""GSM8K scorer: the model must end its answer with ``#### <number>``.

The preprocessing script (``examples/data_preprocess/gsm8k.py``) asks for exactly that format, so the
default ``strict`` method rewards only answers that follow it; ``flexible`` accepts the last number in
the response instead (useful to evaluate a base model that ignores the format).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

__all__ = ["compute_score", "extract_solution"]

# A number as GSM8K writes it: optional minus, digits with thousands commas, an optional decimal part.
_NUMBER = r"-?[0-9][0-9,]*(?:\.[0-9]+)?\.?"
_STRICT = re.compile(r"####\s*\$?\s*(" + _NUMBER + r")")
_ANY_NUMBER = re.compile(_NUMBER)


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The final answer as a plain number string (commas and a trailing dot removed), or None.

    ``strict``: the number after the last ``####``. ``flexible``: the last number anywhere.
    """
    if method == "strict":
        matches = _STRICT.findall(solution_str)
    elif method == "flexible":
        matches = _ANY_NUMBER.findall(solution_str)
    else:
        raise ValueError(f"gsm8k.extract_solution: method={method!r}; use 'strict' or 'flexible'")
    if not matches:
        return None
    return _clean(matches[-1])


def compute_score(
    solution_str: str,
    ground_truth: str | float,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """``score`` for the right answer, ``format_score`` for a well-formed wrong one, 0 for no answer.

    Answers are compared as numbers, so ``72``, ``72.0`` and ``72.`` all match a ground truth of ``72``.
    """
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    return score if _same_number(answer, _clean(str(ground_truth))) else format_score


def _clean(number: str) -> str:
    return number.replace(",", "").replace("$", "").rstrip(".")


def _same_number(a: str, b: str) -> bool:
    try:
        return Decimal(a) == Decimal(b)
    except InvalidOperation:
        return a == b
