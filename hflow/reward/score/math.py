r"""MATH (Hendrycks et al.) scorer: the answer is the last ``\boxed{...}`` in the response.

Equivalence follows the rules of the MATH paper's evaluation (as lm-eval-harness's hendrycks_math
task applies them): both strings are normalised — LaTeX spacing and sizing commands, units, degree
and percent signs, dollar signs and spaces dropped; ``\dfrac``/``\tfrac`` → ``\frac``; shorthand
``\frac12`` / ``\sqrt3`` braced; ``a/b`` of integers → ``\frac{a}{b}``; a short ``x =`` prefix
dropped — and then compared as strings; answers that are then plain numbers (integers, decimals, ``a/b``,
``\frac{a}{b}``, thousands commas ``1,024`` or ``1{,}024``) are compared by value, so ``0.25`` equals
``\frac14`` and ``17.0`` equals ``17``.

A response with several different ``\boxed{}`` answers scores 0 (``\boxed{16} \boxed{17} \boxed{18}`` is a
list of candidates, not an answer; ``python -m hflow.reward.audit`` found the last-box rule paying for it).
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["compute_score", "is_equiv", "last_boxed_only_string", "normalize_answer", "remove_boxed"]

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def compute_score(solution_str: str, ground_truth: str) -> float:
    r"""1.0 if the last ``\boxed{}`` answer is equivalent to ``ground_truth``, else 0.0.

    A ground truth that is itself a full solution (it contains ``\boxed``) is reduced to its boxed
    answer first.
    """
    boxed = last_boxed_only_string(solution_str)
    if boxed is None:
        return 0.0
    answer = remove_boxed(boxed)
    if any(not is_equiv(remove_boxed(other), answer) for other in _all_boxed(solution_str)):
        return 0.0  # several different answers
    ground_truth = str(ground_truth)
    if any(command in ground_truth for command in _BOX_COMMANDS):
        ground_truth = remove_boxed(last_boxed_only_string(ground_truth) or ground_truth)
    return 1.0 if is_equiv(answer, ground_truth) else 0.0


def _all_boxed(text: str) -> list[str]:
    r"""Every closed ``\boxed{...}`` / ``\fbox{...}`` of `text`, in order."""
    found, end = [], len(text)
    while True:
        boxed = last_boxed_only_string(text[:end])
        if boxed is None:
            return found[::-1]
        found.append(boxed)
        end = max(text[:end].rfind(command) for command in _BOX_COMMANDS)


def last_boxed_only_string(text: str) -> str | None:
    r"""The last ``\boxed{...}`` (or ``\fbox{...}``, or ``\boxed x`` up to ``$``) including the command,
    with nested braces matched; None if there is none or its braces never close."""
    start = max(text.rfind(command) for command in _BOX_COMMANDS)
    if start < 0:
        return None
    if text.startswith("\\boxed ", start):
        return "\\boxed " + text[start + len("\\boxed ") :].split("$")[0]
    depth = 0
    for position in range(start, len(text)):
        if text[position] == "{":
            depth += 1
        elif text[position] == "}":
            depth -= 1
            if depth == 0:
                return text[start : position + 1]
    return None


def remove_boxed(boxed: str) -> str:
    r"""``\boxed{x}`` → ``x`` (also ``\fbox{x}`` and ``\boxed x``); anything else is returned as is."""
    if boxed.startswith("\\boxed "):
        return boxed[len("\\boxed ") :]
    for command in _BOX_COMMANDS:
        if boxed.startswith(command + "{") and boxed.endswith("}"):
            return boxed[len(command) + 1 : -1]
    return boxed


def is_equiv(answer: str | None, reference: str | None) -> bool:
    """Whether two final answers are the same after `normalize_answer` (two missing answers are equal)."""
    if answer is None or reference is None:
        return answer is None and reference is None
    answer, reference = normalize_answer(answer), normalize_answer(reference)
    if answer == reference:
        return True
    value = _as_number(answer)
    return value is not None and value == _as_number(reference)


def _as_number(normalized: str) -> Fraction | None:
    r"""The value of a normalised answer that is a plain number (``-3``, ``2.50``, ``1,024``, ``\frac{1}{4}``)."""
    text = normalized.replace("{,}", ",")
    match = re.fullmatch(r"(-?)\\frac\{(-?[0-9]+)\}\{([0-9]+)\}", text)
    if match:
        sign, numerator, denominator = match.groups()
        return None if int(denominator) == 0 else Fraction(int(numerator), int(denominator)) * (-1 if sign else 1)
    if re.fullmatch(r"-?[0-9]{1,3}(,[0-9]{3})+(\.[0-9]*)?", text):
        text = text.replace(",", "")
    if re.fullmatch(r"-?([0-9]+(\.[0-9]+)?|\.[0-9]+)\.?", text):  # a trailing "." ends a sentence
        return Fraction(text[:-1] if text.endswith(".") else text)
    return None


def normalize_answer(answer: str) -> str:
    """The canonical spelling used by `is_equiv`; see the module docstring for the rules."""
    text = answer.replace("\n", "").replace("\\!", "")
    text = text.replace("\\\\", "\\")
    text = text.replace("tfrac", "frac").replace("dfrac", "frac")
    text = text.replace("\\left", "").replace("\\right", "")
    text = text.replace("^{\\circ}", "").replace("^\\circ", "")
    text = text.replace("\\$", "")
    text = _drop_trailing_units(text)
    text = text.replace("\\%", "").replace("%", "")
    # Leading zeros for bare decimals: " .5" / "{.5" / ".5".
    text = text.replace(" .", " 0.").replace("{.", "{0.")
    if not text:
        return text
    if text[0] == ".":
        text = "0" + text
    # "k = 3" → "3", but keep genuine equations such as "x + y = 3".
    sides = text.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        text = sides[1]
    text = _brace_sqrt_arguments(text)
    text = text.replace(" ", "")
    text = _brace_frac_arguments(text)
    if text == "0.5":
        text = "\\frac{1}{2}"
    return _integer_ratio_as_frac(text)


def _drop_trailing_units(text: str) -> str:
    r"""``5 \text{ cm}`` → ``5 `` (units are written as ``\text{ unit}`` with a leading space)."""
    return text.split("\\text{ ")[0]


def _brace_sqrt_arguments(text: str) -> str:
    r"""``\sqrt3`` → ``\sqrt{3}``: a one-character argument gets braces."""
    return re.sub(r"\\sqrt([^{\\])", r"\\sqrt{\1}", text)


def _brace_frac_arguments(text: str) -> str:
    r"""``\frac12`` → ``\frac{1}{2}``, ``\frac1{72}`` → ``\frac{1}{72}``, ``\frac{1}2`` → ``\frac{1}{2}``.

    Arguments without braces are one character long in LaTeX, which is what makes this well defined.
    """
    pieces = text.split("\\frac")
    rebuilt = pieces[0]
    for piece in pieces[1:]:
        rebuilt += "\\frac"
        numerator, rest = _take_argument(piece)
        if numerator is None:
            rebuilt += piece
            continue
        denominator, rest = _take_argument(rest)
        if denominator is None:
            rebuilt += piece
            continue
        rebuilt += "{" + numerator + "}{" + denominator + "}" + rest
    return rebuilt


def _take_argument(text: str) -> tuple[str | None, str]:
    """Split one LaTeX argument (``{...}`` with nesting, or a single character) off the front; None for
    an unbraced command (``\\frac\\pi2``), whose extent this simple parser does not know."""
    if not text or text[0] == "\\":
        return None, text
    if text[0] != "{":
        return text[0], text[1:]
    depth = 0
    for position, char in enumerate(text):
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[1:position], text[position + 1 :]
    return None, text


def _integer_ratio_as_frac(text: str) -> str:
    r"""``3/4`` → ``\frac{3}{4}`` when both sides are plain integers; anything else unchanged."""
    match = re.fullmatch(r"(-?[0-9]+)/([0-9]+)", text)
    if match is None:
        return text
    return "\\frac{" + match.group(1) + "}{" + match.group(2) + "}"
