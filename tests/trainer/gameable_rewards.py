"""Reward functions for tests/trainer/test_gameable_reward.py: one a reward audit flags, one it passes.

Training rows (extra_info.split == "train") get the reward under test; validation rows always get the true
score (`hflow.reward.score.arithmetic`: the last number is the answer), so validation measures what
the policy really learned, as in tests/trainer/reward_controls.py.
"""

import re

from hflow.reward.score import arithmetic


def any_number(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """Planted flaw: pays when ANY number in the response is the answer, so "12 or 13" earns 1 for 7 + 5."""
    if extra_info["split"] != "train":
        return arithmetic.compute_score(solution_str, ground_truth)
    return float(any(int(n) == int(ground_truth) for n in re.findall(r"-?[0-9]+", solution_str)))


def exact(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """The fix: pays only when the whole response, stripped, is the answer."""
    if extra_info["split"] != "train":
        return arithmetic.compute_score(solution_str, ground_truth)
    return float(solution_str.strip() == str(ground_truth).strip())
