"""Rule-based scoring functions, chosen by a sample's ``data_source``.

Every scorer follows the reward-function contract: ``compute_score(data_source, solution_str,
ground_truth, extra_info=None)`` returns a float (or a dict with a ``score`` key). To score a data set
not listed in `SCORERS`, write such a function in a file and point ``custom_reward_function.path``
at it.

This package imports nothing heavy (no torch): the reward manager's scoring processes import it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hflow.reward.score import answer_style, arithmetic, code_exec, gsm8k, math, vault, vision_digits

__all__ = ["EPISODE_SCORERS", "SCORERS", "default_compute_score"]

# data_source → scorer(solution_str, ground_truth) -> float (or a dict with a "score" key)
SCORERS: dict[str, Callable[[str, Any], float | dict[str, Any]]] = {
    "openai/gsm8k": gsm8k.compute_score,
    "lighteval/MATH": math.compute_score,
    "DigitalLearningGmbH/MATH-lighteval": math.compute_score,
    "HuggingFaceH4/MATH-500": math.compute_score,
    "hiyouga/geometry3k": math.compute_score,  # a diagram + a \boxed{} answer (examples/data_preprocess/geo3k.py)
    "hflow/arithmetic": arithmetic.compute_score,
    "hflow/multiply": arithmetic.compute_score,  # the built-in agent task: the final answer's number
    "hflow/arithmetic-style": answer_style.compute_score,
    "hflow/vision_digits": vision_digits.compute_score,  # the built-in vision task: the exact two digits
    # Code with test cases, run in hflow.sandbox; the dict adds passed/total/error to the reward's extra info.
    **dict.fromkeys(code_exec.DATA_SOURCES, code_exec.compute_score),
}

# data_source → scorer(solution_str, ground_truth, extra_info): tasks judged by their episode (extra_info's
# "episode", multi-turn), not by the answer's text alone
EPISODE_SCORERS: dict[str, Callable[[str, Any, dict | None], float]] = {
    "hflow/vault": vault.compute_score,  # the built-in stateful task: its environment's verdict
}


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float | dict[str, Any]:
    """Score one response with the built-in scorer for its ``data_source``: a float, or the scorer's dict."""
    if data_source in EPISODE_SCORERS:
        return float(EPISODE_SCORERS[data_source](solution_str, ground_truth, extra_info))
    scorer = SCORERS.get(data_source)
    if scorer is None:
        raise ValueError(
            f"no built-in reward function for data_source={data_source!r}; known data sources: "
            f"{sorted([*SCORERS, *EPISODE_SCORERS])}. For other data, write compute_score(data_source, solution_str, ground_truth, "
            "extra_info=None) in a Python file and set custom_reward_function.path (and .name)"
        )
    score = scorer(solution_str, ground_truth)
    return score if isinstance(score, dict) else float(score)
