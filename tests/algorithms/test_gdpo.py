"""GDPO (issue 52): several named rewards, each normalized within its group, then the weighted sum, then a
batch normalization; against a hand computation, and against the plain sum it replaces."""

from __future__ import annotations

import statistics

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from hflow.algorithms import core_algos as ca
from hflow.algorithms.config import check_reward_weights
from hflow.config_schema import ConfigError
from hflow.protocol import DataProto
from hflow.reward import multi_reward
from hflow.trainer.ppo.ray_trainer import compute_advantage
from hflow.utils.errors import UserError

EPS = 1e-6
# 2 prompts x 3 samples; `length` is on a scale 100x larger than `correct`
INDEX = ["p", "p", "p", "q", "q", "q"]
LENGTH = [100.0, 300.0, 200.0, 0.0, 0.0, 600.0]
CORRECT = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
WEIGHTS = {"length": 1.0, "correct": 0.5}
MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0]], dtype=torch.float32)


def gdpo_by_hand(rewards: dict[str, list[float]], weights: dict[str, float], index, by_std=True) -> list[float]:
    """Per sample: sum_k w_k (r_k - mean_G r_k) / (stdev_G r_k + eps), then (S - mean S) / (stdev S + eps)."""
    summed = [0.0] * len(index)
    for name, weight in weights.items():
        for i, uid in enumerate(index):
            group = [rewards[name][j] for j, other in enumerate(index) if other == uid]
            centred = rewards[name][i] - statistics.mean(group)
            summed[i] += weight * (centred / (statistics.stdev(group) + EPS) if by_std else centred)
    mean, std = statistics.mean(summed), statistics.stdev(summed)
    return [(s - mean) / (std + EPS) for s in summed]


def run_gdpo(rewards, weights, index=INDEX, by_std=True, mask=MASK):
    scores = {name: torch.tensor(values, dtype=torch.float64) for name, values in rewards.items()}
    return ca.call_adv_estimator("gdpo", reward_scores=scores, reward_weights=weights, response_mask=mask,
                                 index=index, norm_adv_by_std_in_grpo=by_std, token_level_rewards=torch.zeros_like(mask))


@pytest.mark.parametrize("by_std", [True, False])
def test_gdpo_advantage_equals_the_hand_computation(by_std):
    adv, returns = run_gdpo({"length": LENGTH, "correct": CORRECT}, WEIGHTS, by_std=by_std)
    expected = gdpo_by_hand({"length": LENGTH, "correct": CORRECT}, WEIGHTS, INDEX, by_std)
    for i, value in enumerate(expected):
        assert adv[i, 0].item() == pytest.approx(value, rel=1e-5, abs=1e-6), i
        torch.testing.assert_close(adv[i], torch.full_like(adv[i], value) * MASK[i], rtol=1e-5, atol=1e-6)
    assert torch.equal(adv, returns)


def test_a_reward_100x_smaller_still_moves_the_advantage():
    """Samples 0 and 1 of a group tie on `length` (scale 100) and differ on `correct` (scale 1). The plain
    sum (GRPO on length + correct) barely tells them apart; GDPO does, by the weight of `correct`."""
    length, correct = [100.0, 100.0, 300.0], [1.0, 0.0, 0.0]
    index = ["p", "p", "p"]
    mask = torch.ones(3, 2)
    gdpo, _ = run_gdpo({"length": length, "correct": correct}, {"length": 1.0, "correct": 1.0}, index, mask=mask)
    summed = torch.tensor([a + b for a, b in zip(length, correct)])
    grpo, _ = ca.compute_grpo_outcome_advantage(torch.stack([torch.zeros(3), summed], dim=-1), mask, index)
    assert grpo[0, 0] - grpo[1, 0] < 0.01  # 1 / std of the sum (~115): drowned
    assert gdpo[0, 0] - gdpo[1, 0] > 0.5


def test_the_trainer_reads_the_reward_columns_and_reports_each_share():
    """The path of a training step: the reward function's extra keys become declared columns of the batch
    (`reward_score/<name>`, `score` from token_level_scores), survive select/concat, and compute_advantage
    writes GDPO's advantage and returns each reward's share of it."""
    scores = torch.zeros(6, 3)
    scores[:, 0] = torch.tensor(CORRECT) * 2  # the score column: 2 x correct
    batch = DataProto.from_dict({"token_level_scores": scores, "token_level_rewards": scores, "response_mask": MASK},
                                non_tensors={"uid": np.array(INDEX, dtype=object)})
    multi_reward.attach_reward_columns(batch, {"length": LENGTH, "unused": [0] * 6}, {"length": 1.0, "score": 0.5})
    assert set(batch.non_tensor_batch) == {"uid", "reward_score/length", "reward_score/score"}
    batch = DataProto.concat([batch.select_idxs(np.arange(3)), batch.select_idxs(np.arange(3, 6))])
    algorithm = OmegaConf.create({"adv_estimator": "gdpo", "reward_weights": {"length": 1.0, "score": 0.5},
                                  "norm_adv_by_std_in_grpo": True, "gamma": 1.0, "lam": 1.0, "turn_rewards": "ignore"})
    metrics = compute_advantage(batch, algorithm)
    # score = 2 x correct normalizes exactly as correct does
    expected = gdpo_by_hand({"length": LENGTH, "correct": CORRECT}, {"length": 1.0, "correct": 0.5}, INDEX)
    assert batch.batch["advantages"][:, 0].tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert set(metrics) == {"reward/length/adv_share", "reward/score/adv_share"}
    assert metrics["reward/length/adv_share"] + metrics["reward/score/adv_share"] == pytest.approx(1.0)
    assert 0 < metrics["reward/score/adv_share"] < metrics["reward/length/adv_share"]


def test_a_weighted_key_the_reward_did_not_return_stops_naming_it():
    batch = DataProto.from_dict({"token_level_scores": torch.zeros(2, 3)})
    with pytest.raises(UserError, match="'format'.*extra keys: \\['correct'\\]"):
        multi_reward.attach_reward_columns(batch, {"correct": [1, 0]}, {"format": 1.0})
    with pytest.raises(UserError, match="'correct'"):
        multi_reward.attach_reward_columns(batch, {"correct": [1, None]}, {"correct": 1.0})


def algo(**keys):
    base = {"adv_estimator": "gdpo", "reward_weights": {"correct": 1.0}, "use_kl_in_reward": False,
            "distill": {"coef": 0.0}, "turn_rewards": "ignore"}
    return OmegaConf.create({**base, **keys})


@pytest.mark.parametrize("keys,match", [
    ({"reward_weights": None}, "adv_estimator=gdpo .*reward_weights is null"),
    ({"adv_estimator": "grpo"}, "reward_weights is set but algorithm.adv_estimator=grpo"),
    ({"reward_weights": {}}, "must map reward names to weights"),
    ({"reward_weights": {"correct": "high"}}, "algorithm.reward_weights.correct='high' must be a finite number"),
    ({"reward_weights": {"correct": 0.0, "format": 0}}, "all 0"),
    ({"use_kl_in_reward": True}, "use_kl_in_reward"),
    ({"distill": {"coef": 0.5}}, "algorithm.distill.coef=0.5\\) would be ignored"),
    ({"turn_rewards": "token"}, "algorithm.turn_rewards=token would be ignored"),
])
def test_bad_reward_weights_are_refused_naming_the_key(keys, match):
    with pytest.raises(ConfigError, match=match):
        check_reward_weights(algo(**keys))


def test_good_reward_weights_pass():
    check_reward_weights(algo(reward_weights={"correct": 1.0, "format": -0.5}))
    check_reward_weights(OmegaConf.create({"adv_estimator": "grpo", "reward_weights": None, "use_kl_in_reward": True}))
