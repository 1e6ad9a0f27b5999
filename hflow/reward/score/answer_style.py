"""The hidden preference of the built-in RLHF task (`hflow.tasks.rlhf_task`): the right number first,
then the house style.

A response is read as one of four styles, each giving a number:

    house     "The answer is 12."
    plain     "12"
    hedge     "I think it is 12."
    equation  "7 + 5 = 12"

and scores 1.0 with the right number in the house style, 0.5 with the right number in another style,
and 0 with a wrong number or in no style at all. So a correct answer in any style beats a wrong one in
the house style, and among correct answers the house style wins. The policy never sees this rule: in
the pipeline it labels the preference pairs, which are all the reward model learns from.
"""

from __future__ import annotations

import re

__all__ = ["HOUSE_STYLE", "STYLE_PATTERNS", "compute_score", "parse"]

HOUSE_STYLE = "house"
CORRECT_OTHER_STYLE = 0.5
# style -> pattern whose one group is the answer's number (a response matches at most one)
STYLE_PATTERNS: dict[str, re.Pattern] = {
    "house": re.compile(r"The answer is (-?\d+)\."),
    "plain": re.compile(r"(-?\d+)"),
    "hedge": re.compile(r"I think it is (-?\d+)\."),
    "equation": re.compile(r"\d+ [+-] \d+ = (-?\d+)"),
}


def parse(solution_str: str) -> tuple[str, int | None]:
    """(style, number) of a response; ("other", None) when it is in none of the four styles."""
    text = solution_str.strip()
    for style, pattern in STYLE_PATTERNS.items():
        match = pattern.fullmatch(text)
        if match is not None:
            return style, int(match.group(1))
    return "other", None


def compute_score(solution_str: str, ground_truth) -> float:
    style, number = parse(solution_str)
    if number is None or number != int(ground_truth):
        return 0.0
    return 1.0 if style == HOUSE_STYLE else CORRECT_OTHER_STYLE
