"""Reward functions for the control runs (tests/trainer/test_reward_controls.py, bench/reward_controls.py).

Training rows (extra_info.split == "train") get the control's reward; validation rows always get the
true score, so validation measures what the policy really learned.

The coin must be reproducible: run it in the driver (`custom_reward_function.timeout_s=null`), where calls
come in sample order, with its own generator seeded by `coin_seed` (a reward_kwargs entry). In scoring
processes, each process would hold its own copy of the generator and scheduling would decide which sample
reads which draw.
"""

import random

from hflow.reward.score import arithmetic

_COINS: dict[int, random.Random] = {}  # one generator per seed, independent of the global `random`


def _true(solution_str, ground_truth):
    return arithmetic.compute_score(solution_str, ground_truth)


def real(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return _true(solution_str, ground_truth)


def coin_flip(data_source, solution_str, ground_truth, extra_info=None, coin_seed=0, **kwargs):
    if extra_info["split"] != "train":
        return _true(solution_str, ground_truth)
    if coin_seed not in _COINS:
        _COINS[coin_seed] = random.Random(coin_seed)
    coin = _COINS[coin_seed]
    return float(coin.random() < 0.5)  # says nothing about the answer


def inverted(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if extra_info["split"] != "train":
        return _true(solution_str, ground_truth)
    return 1.0 - _true(solution_str, ground_truth)
