"""Rollout correction (algorithm.rollout_is): truncated importance weights pi_old / pi_rollout.

Checked against the definition on hand-built log-probs, in the policy losses, in preflight and in the actor;
end to end on the built-in task in tests/trainer/test_recipes_learn.py (fp32 on CPU: the weights stay at 1).
"""

import math

import pytest
import torch
from hydra import compose, initialize_config_dir

from hflow.algorithms import core_algos as ca
from hflow import CONFIG_DIR
from hflow.trainer.preflight import check_rollout_is
from hflow.workers.config import ConfigError

C = 1.5


def hand_built():
    """Three responses: ratios (2, 1, 0.25 | pad), (3, 1 | pad, pad), all padding. Padding holds a log-ratio of
    +30, which would be clipped (and overflow a product) if it were not ignored."""
    ratios = [[2.0, 1.0, 0.25, None], [3.0, 1.0, None, None], [None] * 4]
    old, rollout, mask = [], [], []
    for row in ratios:
        rollout_row = [math.log(0.1) if r is not None else -30.0 for r in row]
        old.append([lp + math.log(r) if r is not None else 0.0 for lp, r in zip(rollout_row, row)])
        rollout.append(rollout_row)
        mask.append([1.0 if r is not None else 0.0 for r in row])
    return torch.tensor(old), torch.tensor(rollout), torch.tensor(mask)


def test_token_level_weights_and_metrics():
    old, rollout, mask = hand_built()
    weights, metrics = ca.compute_rollout_is_weights(old, rollout, mask, level="token", threshold=C)
    expected = torch.tensor([[1.5, 1.0, 0.25, 0.0], [1.5, 1.0, 0.0, 0.0], [0.0] * 4])  # 2 and 3 cut at C
    torch.testing.assert_close(weights, expected)
    assert metrics["rollout_is/mean"] == pytest.approx((1.5 + 1.0 + 0.25 + 1.5 + 1.0) / 5)
    assert metrics["rollout_is/max"] == pytest.approx(1.5)
    assert metrics["rollout_is/clipped_frac"] == pytest.approx(2 / 5)  # of the 5 valid tokens


def test_sequence_level_weights_and_metrics():
    old, rollout, mask = hand_built()
    weights, metrics = ca.compute_rollout_is_weights(old, rollout, mask, level="sequence", threshold=C)
    # products 2 * 1 * 0.25 = 0.5 and 3 * 1 = 3 -> cut at C; on every valid token of the response
    expected = torch.tensor([[0.5, 0.5, 0.5, 0.0], [1.5, 1.5, 0.0, 0.0], [0.0] * 4])
    torch.testing.assert_close(weights, expected)
    assert metrics["rollout_is/mean"] == pytest.approx((3 * 0.5 + 2 * 1.5) / 5)  # over valid tokens
    assert metrics["rollout_is/max"] == pytest.approx(1.5)
    assert metrics["rollout_is/clipped_frac"] == pytest.approx(1 / 2)  # of the 2 responses with tokens


def test_sequence_product_does_not_overflow():
    old = torch.full((2, 200), 10.0)  # a log-ratio sum of 2000: exp would be inf in any dtype
    rollout = torch.zeros(2, 200)
    old[1] = -10.0  # and -2000: the weight underflows to 0, harmlessly
    weights, metrics = ca.compute_rollout_is_weights(old, rollout, torch.ones(2, 200), "sequence", threshold=C)
    assert torch.isfinite(weights).all()
    torch.testing.assert_close(weights[0], torch.full((200,), C))
    assert weights[1].max().item() == 0.0
    assert metrics["rollout_is/clipped_frac"] == pytest.approx(0.5)


def test_unknown_level_and_bad_threshold_raise():
    old, rollout, mask = hand_built()
    with pytest.raises(ValueError, match="rollout_is level"):
        ca.compute_rollout_is_weights(old, rollout, mask, level="tokens")
    with pytest.raises(ValueError, match="threshold"):
        ca.compute_rollout_is_weights(old, rollout, mask, threshold=0.0)


def random_batch(seed=0, bs=4, length=6):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(bs, length, generator=gen) * 2
    new = (old + 0.5 * torch.randn(bs, length, generator=gen)).requires_grad_()
    adv = torch.randn(bs, length, generator=gen)
    mask = torch.ones(bs, length)
    mask[0, 4:] = 0
    mask[2, 1:] = 0
    weights = torch.rand(bs, length, generator=gen) * 2
    return old, new, adv, mask, weights


def test_vanilla_loss_is_the_weighted_token_mean():
    old, new, adv, mask, weights = random_batch()
    config = {"clip_ratio": 0.2, "clip_ratio_c": 3.0}
    weights.requires_grad_()  # constants for the loss: no gradient may reach them
    loss, _ = ca.get_policy_loss_fn("vanilla")(old, new, adv, mask, "token-mean", config, rollout_is_weights=weights)

    ratio = torch.exp(new - old)
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    per_token = torch.where(adv < 0, torch.minimum(per_token, -adv * 3.0), per_token)
    expected = (per_token * weights * mask).sum() / mask.sum()
    torch.testing.assert_close(loss, expected)
    loss.backward()
    assert weights.grad is None and new.grad is not None


def test_gpg_loss_is_the_weighted_token_mean():
    old, new, adv, mask, weights = random_batch(seed=1)
    loss, _ = ca.get_policy_loss_fn("gpg")(old, new, adv, mask, "token-mean", rollout_is_weights=weights)
    torch.testing.assert_close(loss, (-adv * new * weights * mask).sum() / mask.sum())


@pytest.mark.parametrize("mode", ["vanilla", "gspo", "gpg"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_unit_weights_change_nothing(mode, agg):
    old, new, adv, mask, _ = random_batch(seed=2)
    fn = ca.get_policy_loss_fn(mode)
    plain, _ = fn(old, new, adv, mask, agg)
    weighted, _ = fn(old, new, adv, mask, agg, rollout_is_weights=torch.ones_like(old))
    torch.testing.assert_close(weighted, plain)


def default_config(*overrides):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name="ppo_trainer", overrides=list(overrides))


@pytest.mark.parametrize("overrides,match", [
    (["actor_rollout_ref.rollout.calculate_log_probs=false"], "calculate_log_probs"),
    (["algorithm.use_rollout_log_probs=true"], "use_rollout_log_probs"),
    (["algorithm.reuse_update_log_probs=true"], "reuse_update_log_probs"),
    (["algorithm.rollout_is_threshold=0"], "rollout_is_threshold"),
    (["algorithm.rollout_is=both"], "algorithm.rollout_is"),
])
def test_preflight_refuses(overrides, match):
    config = default_config("algorithm.rollout_is=token", *overrides)
    with pytest.raises(ConfigError, match=match):
        check_rollout_is(config.algorithm, config.actor_rollout_ref.rollout)


def test_preflight_accepts():
    for level in ("token", "sequence"):
        config = default_config(f"algorithm.rollout_is={level}", "algorithm.rollout_is_threshold=1.0")
        check_rollout_is(config.algorithm, config.actor_rollout_ref.rollout)
    config = default_config("algorithm.use_rollout_log_probs=true")  # off: nothing to check
    check_rollout_is(config.algorithm, config.actor_rollout_ref.rollout)


def test_actor_applies_the_weights_column(tmp_path):
    """The actor reads `rollout_is_weights` when present: weights of 2 double the loss and the gradient, and
    row-dependent weights follow their rows through any micro-batching (dynamic batching reorders rows)."""
    from hflow.workers.fsdp import load_causal_lm
    from hflow.workers.actor import DataParallelPPOActor
    from tests.workers.test_dp_actor import actor_config, add_old_log_probs, build_model_dir, make_batch

    model_dir = build_model_dir(tmp_path / "model")

    def update(data, **overrides):
        model = load_causal_lm(str(model_dir))
        actor = DataParallelPPOActor(actor_config(entropy_coeff=0.0, use_kl_loss=False, **overrides), model,
                                     torch.optim.SGD(model.parameters(), lr=0.0))
        return actor.update_policy(data)

    data = make_batch(8, seed=3)
    add_old_log_probs(DataParallelPPOActor(actor_config(), load_causal_lm(str(model_dir))), data, noise=0.3)
    plain = update(data)
    data.batch["rollout_is_weights"] = torch.full_like(data.batch["old_log_probs"], 2.0)
    doubled = update(data)
    assert doubled["actor/pg_loss"][0] == pytest.approx(2 * plain["actor/pg_loss"][0], rel=1e-5)
    assert doubled["actor/grad_norm"][0] == pytest.approx(2 * plain["actor/grad_norm"][0], rel=1e-4)

    data.batch["rollout_is_weights"] = torch.linspace(0.1, 1.9, 8)[:, None].expand_as(data.batch["old_log_probs"])
    fixed = update(data, ppo_micro_batch_size_per_gpu=2)
    dynamic = update(data, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=25)
    assert fixed["actor/pg_loss"][0] != pytest.approx(plain["actor/pg_loss"][0], rel=1e-3)
    assert dynamic["actor/pg_loss"][0] == pytest.approx(fixed["actor/pg_loss"][0], rel=1e-5)
    assert dynamic["actor/grad_norm"][0] == pytest.approx(fixed["actor/grad_norm"][0], rel=1e-4)
