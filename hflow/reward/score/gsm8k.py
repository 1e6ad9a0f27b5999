r"""GSM8K scorer: the model must end its answer with ``#### <number>``.

The preprocessing script (``examples/data_preprocess/gsm8k.py``) asks for exactly that format, so the
default ``strict`` method rewards only answers that follow it; ``flexible`` accepts the last number in
the response instead (useful to evaluate a base model that ignores the format).

``strict`` pays for one answer only (what ``python -m hflow.reward.audit`` found it paying for): a
marker followed by more numbers on its line (``#### 12 or 13``) or several markers with different numbers
(``#### 12`` ... ``#### 13``, a way to list candidates) earn ``format_score``, not ``score``. The number may
be written ``1,000``, ``$72``, ``72.``, ``72 dollars``, ``0.5``, ``1/2`` or ``\frac{1}{2}``; digits other
than ASCII 0-9 (fullwidth, Arabic-Indic) are not numbers here.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction

__all__ = ["compute_score", "extract_solution"]

# A number as GSM8K writes it: optional minus, digits with thousands commas, an optional decimal part.
_NUMBER = r"-?[0-9][0-9,]*(?:\.[0-9]+)?\.?"
_FRACTION = r"-?\\[dt]?frac\{-?[0-9]+\}\{[0-9]+\}|-?[0-9]+/[0-9]+"
# A marker's answer, then the rest of its line (up to the next marker).
_STRICT = re.compile(r"####[ \t]*\$?[ \t]*(" + _FRACTION + "|" + _NUMBER + r")?((?:(?!####)[^\n])*)")
_ANY_NUMBER = re.compile(_NUMBER)
_DIGIT = re.compile(r"[0-9]")
_FRACTION_PARTS = re.compile(r"(-?)\\[dt]?frac\{(-?[0-9]+)\}\{([0-9]+)\}|(-?[0-9]+)/([0-9]+)")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The final answer as a plain number string (commas and a trailing dot removed), or None.

    ``strict``: the number after the last ``####`` (None when more digits follow it on its line).
    ``flexible``: the last number anywhere.
    """
    if method == "strict":
        answers = _strict_answers(solution_str)
        return answers[-1] if answers else None
    if method == "flexible":
        matches = _ANY_NUMBER.findall(solution_str)
        return _clean(matches[-1]) if matches else None
    raise ValueError(f"gsm8k.extract_solution: method={method!r}; use 'strict' or 'flexible'")


def compute_score(
    solution_str: str,
    ground_truth: str | float,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """``score`` for the right answer, ``format_score`` for a well-formed wrong one (or several answers), 0 for
    no answer.

    Answers are compared as numbers, so ``72``, ``72.0`` and ``72.`` all match a ground truth of ``72``.
    """
    if method == "strict":
        answers = _strict_answers(solution_str)
        if not answers:
            return 0.0
        if None in answers or any(not _same_number(answer, answers[0]) for answer in answers[1:]):
            return format_score  # more than one answer
        answer = answers[-1]
    else:
        answer = extract_solution(solution_str, method=method)
        if answer is None:
            return 0.0
    return score if _same_number(answer, _clean(str(ground_truth))) else format_score


def _strict_answers(solution_str: str) -> list[str | None]:
    """Per ``####`` marker its number (cleaned); None for a marker with no number or more digits after it."""
    return [_clean(number) if number and not _DIGIT.search(rest) else None
            for number, rest in _STRICT.findall(solution_str)]


def _clean(number: str) -> str:
    return number.replace(",", "").replace("$", "").rstrip(".")


def _same_number(a: str | None, b: str | None) -> bool:
    x, y = _value(a), _value(b)
    return x == y if x is not None and y is not None else a == b


def _value(number: str | None) -> Fraction | None:
    if number is None:
        return None
    match = _FRACTION_PARTS.fullmatch(number.strip())
    try:
        if match is None:
            return Fraction(Decimal(number))
        sign = -1 if match.group(1) else 1
        numerator, denominator = match.group(2) or match.group(4), match.group(3) or match.group(5)
        return sign * Fraction(int(numerator), int(denominator))
    except (InvalidOperation, ValueError, ZeroDivisionError):
        return None
