"""Scorer for the built-in vision task (``data_source="hflow/vision_digits"``): the exact answer.

The response must be the number's two digits and nothing else (surrounding white space aside): ``47`` for a
picture of 47; ``74``, ``47!`` (the pre-trained model's habit) or ``It is 47`` score 0.
"""

from __future__ import annotations

__all__ = ["compute_score"]


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 if the response, stripped, is `ground_truth`, else 0.0."""
    return 1.0 if solution_str.strip() == str(ground_truth).strip() else 0.0
