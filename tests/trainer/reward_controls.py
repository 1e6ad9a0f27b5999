"""Reward functions for the control runs of test_reward_controls.py.

Training rows (extra_info.split == "train") get the control's reward; validation rows always get the
true score, so validation measures what the policy really learned.
"""

import random

from hflow.utils.reward_score import arithmetic

# The coin's own seeded generator, independent of whatever else draws from the global `random`.
_COIN = random.Random(0)


def _true(solution_str, ground_truth):
    return arithmetic.compute_score(solution_str, ground_truth)


def real(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return _true(solution_str, ground_truth)


def coin_flip(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if extra_info["split"] != "train":
        return _true(solution_str, ground_truth)
    return float(_COIN.random() < 0.5)  # says nothing about the answer


def inverted(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if extra_info["split"] != "train":
        return _true(solution_str, ground_truth)
    return 1.0 - _true(solution_str, ground_truth)
