"""The hidden rule of the built-in RLHF task (`hflow.tasks.rlhf_task`): answers in the house style.

A response scores 1.0 when it is exactly ``The answer is N.`` with the right N, 0.5 in that form with a
wrong N, 0 in any other form. The policy never sees this rule: in the pipeline it is what the preference
pairs are labelled with, and what the reward model has to learn from them.
"""

from __future__ import annotations

import re

_HOUSE_STYLE = re.compile(r"The answer is (-?\d+)\.")


def compute_score(solution_str: str, ground_truth) -> float:
    match = _HOUSE_STYLE.fullmatch(solution_str.strip())
    if match is None:
        return 0.0
    return 1.0 if int(match.group(1)) == int(ground_truth) else 0.5
