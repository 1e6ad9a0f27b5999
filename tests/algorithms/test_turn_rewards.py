"""Turn rewards in the advantages (`algorithm.turn_rewards`): where they land and what each mode changes.

One episode row: turn 1 = tokens 0-2, a tool message at 3-4 (mask 0), turn 2 = tokens 5-6, a user
message at 7, turn 3 = token 8, padding at 9. A tool reward 0.5 on turn 1's last token (2), an
environment reward 2.0 on turn 2's (6), the outcome score 1.0 on the last sampled token (8).
"""

from __future__ import annotations

import torch
from omegaconf import OmegaConf

from hflow.algorithms import core_algos
from hflow.trainer.config import default_config
from hflow.trainer.ppo.ray_trainer import compute_advantage

MASK = torch.tensor([[1, 1, 1, 0, 0, 1, 1, 0, 1, 0]], dtype=torch.float32)
TURNS = torch.zeros(1, 10)
TURNS[0, 2], TURNS[0, 6] = 0.5, 2.0
OUTCOME = torch.zeros(1, 10)
OUTCOME[0, 8] = 1.0


def test_ignore_keeps_the_outcome_scores_themselves():
    assert core_algos.credit_turn_rewards(OUTCOME, TURNS, "ignore") is OUTCOME
    assert torch.equal(core_algos.credit_turn_rewards(OUTCOME, TURNS, "token"), OUTCOME + TURNS)


def test_turn_returns_discount_once_per_turn():
    rewards = OUTCOME + TURNS
    gamma = 0.5
    returns = core_algos.compute_turn_returns(rewards, MASK, turn_gamma=gamma)
    g3 = 1.0
    g2 = 2.0 + gamma * g3
    g1 = 0.5 + gamma * g2
    assert returns[0].tolist() == [g1, g1, g1, 0, 0, g2, g2, 0, g3, 0]


def test_gae_reads_per_token_rewards():
    """With values 0 and gamma = lam = 1, GAE's returns are each token's reward-to-go: a turn reward
    raises the returns of its turn and the turns before it, never those after it."""
    values = torch.zeros(1, 10)
    _, outcome_only = core_algos.compute_gae_advantage_return(OUTCOME, values, MASK, gamma=1.0, lam=1.0)
    _, with_turns = core_algos.compute_gae_advantage_return(OUTCOME + TURNS, values, MASK, gamma=1.0, lam=1.0)
    assert outcome_only[0].tolist() == [1, 1, 1, 0, 0, 1, 1, 0, 1, 0]
    assert with_turns[0].tolist() == [3.5, 3.5, 3.5, 0, 0, 3, 3, 0, 1, 0]


def grpo_config(turn_rewards: str, turn_gamma: float = 1.0):
    algo = default_config().algorithm
    OmegaConf.update(algo, "adv_estimator", "grpo")
    OmegaConf.update(algo, "turn_rewards", turn_rewards)
    OmegaConf.update(algo, "turn_gamma", turn_gamma)
    return algo


def group_batch(rewards: torch.Tensor):
    """Four samples of one prompt with the same mask: `rewards` for the first, others scaled."""
    from hflow.protocol import DataProto
    import numpy as np

    scale = torch.tensor([1.0, 0.0, 2.0, -1.0])[:, None]
    batch = DataProto.from_dict({"token_level_rewards": rewards.repeat(4, 1) * scale, "response_mask": MASK.repeat(4, 1)},
                                {"uid": np.array(["p"] * 4, dtype=object)})
    return batch


def test_turn_return_is_grpo_when_only_the_outcome_is_rewarded():
    plain, turn = group_batch(OUTCOME), group_batch(OUTCOME)
    compute_advantage(plain, grpo_config("ignore"))
    compute_advantage(turn, grpo_config("turn_return"))
    assert torch.allclose(plain.batch["advantages"], turn.batch["advantages"], atol=1e-6)


def test_turn_return_credits_each_turn_with_what_follows_it():
    """GRPO on turn returns: every token of turn k gets (G_k - mean G_0) / (std G_0 + eps); the group's
    statistics are those of the episodes' returns G_0."""
    batch = group_batch(OUTCOME + TURNS)
    compute_advantage(batch, grpo_config("turn_return", turn_gamma=0.5))
    g3, g2 = 1.0, 2.0 + 0.5 * 1.0
    g1 = 0.5 + 0.5 * g2
    first = torch.tensor([1.0, 0.0, 2.0, -1.0]) * g1
    mean, std = first.mean(), first.std()
    expected = (torch.tensor([g1, g1, g1, 0, 0, g2, g2, 0, g3, 0]) - mean) / (std + 1e-6) * MASK[0]
    assert torch.allclose(batch.batch["advantages"][0], expected, atol=1e-6)
    # the outcome-only GRPO gives every token of a sample the same advantage; turn returns do not
    assert batch.batch["advantages"][0, 0] != batch.batch["advantages"][0, 8]
