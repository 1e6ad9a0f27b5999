"""The newer objectives (issue 52): CISPO and SAPO policy losses against hand computations.

Each expected number is computed here with plain arithmetic (math / float), token by token, so the test
does not share a line of the loss it checks."""

from __future__ import annotations

import math

import pytest
import torch

from hflow.algorithms import core_algos as ca


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


# Two sequences of three tokens; the last token of row 1 is padding. Ratios exp(new - old):
# row 0: 1.5 (A=+1), 0.5 (A=-2), 1.0 (A=+0.5); row 1: 1.1 (A=-1), 0.7 (A=+3), pad.
RATIOS = [[1.5, 0.5, 1.0], [1.1, 0.7, 1.0]]
ADV = [[1.0, -2.0, 0.5], [-1.0, 3.0, 7.0]]
OLD = [[-1.0, -0.5, -2.0], [-0.3, -1.2, -0.7]]
MASK = [[1, 1, 1], [1, 1, 0]]


def small_batch():
    old = torch.tensor(OLD, dtype=torch.float64)
    new = old + torch.log(torch.tensor(RATIOS, dtype=torch.float64))
    return old, new.clone().requires_grad_(), torch.tensor(ADV, dtype=torch.float64), torch.tensor(MASK, dtype=torch.float64)


def valid_tokens():
    return [(i, t) for i in range(2) for t in range(3) if MASK[i][t]]


def aggregate(per_token: dict, mode: str) -> float:
    """token-mean: over the 5 valid tokens; seq-mean-token-mean: mean of the two rows' token means."""
    if mode == "token-mean":
        return sum(per_token.values()) / len(per_token)
    rows = [[v for (i, _), v in per_token.items() if i == row] for row in range(2)]
    return sum(sum(r) / len(r) for r in rows) / 2


def run_loss(name, config, mode="token-mean"):
    old, new, adv, mask = small_batch()
    loss, metrics = ca.get_policy_loss_fn(name)(old, new, adv, mask, mode, config)
    loss.backward()
    return loss.item(), new.grad, metrics


# ---- CISPO ---------------------------------------------------------------------------------------

CISPO = {"policy_loss": {"cispo_clip_ratio_low": 0.2, "cispo_clip_ratio_high": 0.28}}


def cispo_by_hand(low, high):
    """l = -w A log_prob with w = clip(rho, 1-low, 1+high) a constant: value and d l / d log_prob = -w A."""
    loss, grad, clipped = {}, {}, 0
    for i, t in valid_tokens():
        rho = RATIOS[i][t]
        w = min(rho, 1 + high) if low is None else min(max(rho, 1 - low), 1 + high)
        log_prob = OLD[i][t] + math.log(rho)
        loss[(i, t)] = -w * ADV[i][t] * log_prob
        grad[(i, t)] = -w * ADV[i][t]
        clipped += w != rho
    return loss, grad, clipped


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_cispo_loss_and_gradient_equal_the_hand_computation(mode):
    value, grad, metrics = run_loss("cispo", CISPO, mode)
    loss_ref, grad_ref, clipped = cispo_by_hand(0.2, 0.28)
    # 1.5 is clipped to 1.28 and 0.5 to 0.8; 1.0, 1.1 and 0.7 are not (0.7 < 0.8: clipped too)
    assert clipped == 3
    assert value == pytest.approx(aggregate(loss_ref, mode), rel=1e-12)
    # the gradient of the aggregate: each token's -w A times its weight in the aggregation
    for (i, t), g in grad_ref.items():
        share = 1 / 5 if mode == "token-mean" else 1 / (2 * sum(MASK[i]))
        assert grad[i, t].item() == pytest.approx(g * share, rel=1e-12), (i, t)
    assert grad[1, 2].item() == 0.0  # the padding token
    assert metrics["pg_clipfrac"].item() == pytest.approx(3 / 5)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(2 / 5)  # 0.5 and 0.7 below 0.8


def test_cispo_without_a_lower_bound_clips_only_from_above():
    value, _, metrics = run_loss("cispo", {"policy_loss": {"cispo_clip_ratio_high": 0.28}})
    loss_ref, _, clipped = cispo_by_hand(None, 0.28)
    assert clipped == 1
    assert value == pytest.approx(aggregate(loss_ref, "token-mean"), rel=1e-12)
    assert metrics["pg_clipfrac"].item() == pytest.approx(1 / 5) and metrics["pg_clipfrac_lower"].item() == 0.0


def test_cispo_gives_gradient_to_the_tokens_ppo_clips():
    """Token (0, 0): ratio 1.5 with A > 0 is outside PPO's trust region, so vanilla passes it no gradient;
    CISPO passes it -1.28 * A / 5 (its clipped weight times the advantage)."""
    _, vanilla_grad, _ = run_loss("vanilla", {"clip_ratio": 0.2})
    _, cispo_grad, _ = run_loss("cispo", CISPO)
    assert vanilla_grad[0, 0].item() == 0.0 and vanilla_grad[0, 1].item() == 0.0  # both clipped by PPO
    assert cispo_grad[0, 0].item() == pytest.approx(-1.28 * 1.0 / 5)
    assert cispo_grad[0, 1].item() == pytest.approx(-0.8 * -2.0 / 5)
    # where neither clips (ratio 1.0), both give the plain policy gradient -A / 5
    assert cispo_grad[0, 2].item() == pytest.approx(vanilla_grad[0, 2].item()) == pytest.approx(-0.5 / 5)


# ---- SAPO ----------------------------------------------------------------------------------------

SAPO = {"policy_loss": {"tau_pos": 1.0, "tau_neg": 3.0}}


def sapo_by_hand(tau_pos, tau_neg):
    """l = -f(rho) A with f = sigmoid(tau (rho - 1)) 4 / tau; d l / d log_prob = -4 s (1 - s) rho A."""
    loss, grad = {}, {}
    for i, t in valid_tokens():
        rho, a = RATIOS[i][t], ADV[i][t]
        tau = tau_pos if a > 0 else tau_neg
        s = sigmoid(tau * (rho - 1))
        loss[(i, t)] = -s * 4 / tau * a
        grad[(i, t)] = -4 * s * (1 - s) * rho * a
    return loss, grad


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_sapo_loss_and_gradient_equal_the_hand_computation(mode):
    value, grad, metrics = run_loss("sapo", SAPO, mode)
    loss_ref, grad_ref = sapo_by_hand(1.0, 3.0)
    assert value == pytest.approx(aggregate(loss_ref, mode), rel=1e-12)
    for (i, t), g in grad_ref.items():
        share = 1 / 5 if mode == "token-mean" else 1 / (2 * sum(MASK[i]))
        assert grad[i, t].item() == pytest.approx(g * share, rel=1e-12), (i, t)
    assert grad[1, 2].item() == 0.0
    assert metrics["pg_clipfrac"].item() == 0.0


def test_sapo_uses_tau_pos_on_positive_and_tau_neg_on_negative_advantages():
    """Swapping the temperatures changes the loss (the hand values differ), and at ratio 1 the gate's
    gradient is exactly the policy gradient -A whatever tau is."""
    value, grad, _ = run_loss("sapo", SAPO)
    swapped_ref, _ = sapo_by_hand(3.0, 1.0)
    assert value != pytest.approx(aggregate(swapped_ref, "token-mean"), rel=1e-6)
    assert grad[0, 2].item() == pytest.approx(-0.5 / 5, rel=1e-12)
    # the negative token (0, 1) at ratio 0.5 is damped by tau_neg = 3: 4 s (1 - s) with s = sigmoid(-1.5)
    s = sigmoid(3.0 * -0.5)
    assert grad[0, 1].item() == pytest.approx(-4 * s * (1 - s) * 0.5 * -2.0 / 5, rel=1e-12)


def test_sapo_gate_decays_smoothly_away_from_ratio_one():
    """The per-token gradient weight 4 s (1 - s) rho / rho (relative to the plain policy gradient) falls
    monotonically as the ratio leaves 1, and is never exactly 0 (no hard clip)."""
    weights = []
    for rho in (1.0, 1.5, 2.0, 3.0):
        old = torch.zeros(1, 1, dtype=torch.float64)
        new = torch.full((1, 1), math.log(rho), dtype=torch.float64, requires_grad=True)
        loss, _ = ca.get_policy_loss_fn("sapo")(old, new, torch.ones(1, 1, dtype=torch.float64), torch.ones(1, 1),
                                                config={"policy_loss": {"tau_pos": 2.0}})
        loss.backward()
        weights.append(-new.grad.item() / rho)
    assert weights[0] == pytest.approx(1.0)
    assert all(a > b > 0 for a, b in zip(weights, weights[1:]))


@pytest.mark.parametrize("name", ["cispo", "sapo"])
def test_masked_tokens_do_not_matter_and_rollout_weights_scale(name):
    """Changing the padding token's inputs changes nothing; unit rollout-IS weights change nothing."""
    config = CISPO if name == "cispo" else SAPO
    old, new, adv, mask = small_batch()
    fn = ca.get_policy_loss_fn(name)
    plain, _ = fn(old, new, adv, mask, "token-mean", config)
    old2, new2, adv2 = old.clone(), new.detach().clone(), adv.clone()
    old2[1, 2], new2[1, 2], adv2[1, 2] = 50.0, -50.0, -1e6
    moved, _ = fn(old2, new2, adv2, mask, "token-mean", config)
    weighted, _ = fn(old, new, adv, mask, "token-mean", config, rollout_is_weights=torch.ones_like(old))
    assert moved.item() == pytest.approx(plain.item(), rel=1e-12)
    assert weighted.item() == pytest.approx(plain.item(), rel=1e-12)
