"""Mismatch masking (algorithm.rollout_mask): tokens (IcePop) and responses (geometric mean of the token ratios)
whose sampler/trainer ratio pi_old / pi_rollout leaves a band get weight 0 in the policy loss.

Checked on hand-built ratios, in the policy losses (a masked token passes exactly zero gradient), with the
truncated weights (algorithm.rollout_is) and in preflight; end to end under decoupled PPO with
trainer.async_steps=2 in tests/trainer/test_async.py.
"""

import math

import pytest
import torch
from hydra import compose, initialize_config_dir

from hflow import CONFIG_DIR
from hflow.algorithms import core_algos as ca
from hflow.trainer.preflight import check_rollout_is
from hflow.workers.config import ConfigError

ICEPOP = (0.5, 2.0)


def hand_built():
    """Three responses: ratios (2.5, 1, 0.25 | pad), (1.5, 0.6 | pad, pad), all padding. Padding holds a
    log-ratio of +30, far outside any band: it must be ignored, not masked or counted."""
    ratios = [[2.5, 1.0, 0.25, None], [1.5, 0.6, None, None], [None] * 4]
    old, rollout, mask = [], [], []
    for row in ratios:
        rollout_row = [math.log(0.1) if r is not None else -30.0 for r in row]
        old.append([lp + math.log(r) if r is not None else 0.0 for lp, r in zip(rollout_row, row)])
        rollout.append(rollout_row)
        mask.append([1.0 if r is not None else 0.0 for r in row])
    return torch.tensor(old), torch.tensor(rollout), torch.tensor(mask)


def test_token_band_masks_the_tokens_outside_it():
    keep, metrics = ca.compute_rollout_mismatch_mask(*hand_built(), token_band=ICEPOP)
    # 2.5 > 2 and 0.25 < 0.5 leave the band; 1, 1.5 and 0.6 stay
    torch.testing.assert_close(keep, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0] * 4]))
    assert metrics["rollout_mask/token_masked_frac"] == pytest.approx(2 / 5)  # of the 5 valid tokens
    assert metrics["rollout_mask/seq_masked_frac"] == 0.0
    assert metrics["rollout_mask/masked_frac"] == pytest.approx(2 / 5)


def test_sequence_band_tests_the_geometric_mean():
    # geometric means: (2.5 * 1 * 0.25) ** (1/3) = 0.855 and (1.5 * 0.6) ** (1/2) = 0.949; the products
    # (0.625 and 0.9) would order them the same way but drift with the length
    keep, metrics = ca.compute_rollout_mismatch_mask(*hand_built(), sequence_band=(0.9, 1.1))
    torch.testing.assert_close(keep, torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0] * 4]))
    assert metrics["rollout_mask/seq_masked_frac"] == pytest.approx(1 / 2)  # of the 2 responses with tokens
    assert metrics["rollout_mask/token_masked_frac"] == 0.0
    assert metrics["rollout_mask/masked_frac"] == pytest.approx(3 / 5)
    # between the two means: the first passes, the second (0.949 > 0.9) would not with a high of 0.9
    keep, _ = ca.compute_rollout_mismatch_mask(*hand_built(), sequence_band=(0.8, 0.9))
    torch.testing.assert_close(keep[:2].amax(dim=-1), torch.tensor([1.0, 0.0]))


def test_open_sides_and_both_levels_together():
    data = hand_built()
    keep, _ = ca.compute_rollout_mismatch_mask(*data, token_band=(None, 2.0))  # only the 2.5 goes
    torch.testing.assert_close(keep[0], torch.tensor([0.0, 1.0, 1.0, 0.0]))
    keep, _ = ca.compute_rollout_mismatch_mask(*data, token_band=(0.5, None))  # only the 0.25 goes
    torch.testing.assert_close(keep[0], torch.tensor([1.0, 1.0, 0.0, 0.0]))
    keep, metrics = ca.compute_rollout_mismatch_mask(*data, token_band=(0.7, None), sequence_band=(0.9, 1.1))
    # response 1 by its mean, and the 0.6 of response 2 by the token band: 4 of 5 tokens
    torch.testing.assert_close(keep[:2], torch.tensor([[0.0] * 4, [1.0, 0.0, 0.0, 0.0]]))
    assert metrics == pytest.approx({"rollout_mask/token_masked_frac": 2 / 5, "rollout_mask/seq_masked_frac": 1 / 2,
                                     "rollout_mask/masked_frac": 4 / 5})


def test_mask_times_truncated_weights():
    weights, metrics = ca.compute_rollout_correction(*hand_built(), is_level="token", is_threshold=1.6,
                                                     token_band=ICEPOP)
    # truncation: min(r, 1.6); mask: 2.5 and 0.25 out
    torch.testing.assert_close(weights, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.5, 0.6, 0.0, 0.0], [0.0] * 4]))
    assert metrics["rollout_is/clipped_frac"] == pytest.approx(1 / 5)  # the 2.5 only
    assert metrics["rollout_mask/masked_frac"] == pytest.approx(2 / 5)
    # the mask alone: 1 on every kept token, no rollout_is metrics
    weights, metrics = ca.compute_rollout_correction(*hand_built(), token_band=ICEPOP)
    torch.testing.assert_close(weights, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0] * 4]))
    assert set(metrics) == {"rollout_mask/token_masked_frac", "rollout_mask/seq_masked_frac", "rollout_mask/masked_frac"}
    # neither: the response mask itself
    weights, metrics = ca.compute_rollout_correction(*hand_built())
    torch.testing.assert_close(weights, hand_built()[2])
    assert metrics == {}


def random_batch(seed=0, bs=6, length=8):
    """Sampler/trainer log-ratios spread wide enough that some tokens and responses leave the bands."""
    gen = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(bs, length, generator=gen) * 2
    old = rollout + 0.6 * torch.randn(bs, length, generator=gen)
    new = (old + 0.05 * torch.randn(bs, length, generator=gen)).requires_grad_()  # inside the PPO clip
    adv = torch.randn(bs, length, generator=gen)
    mask = torch.ones(bs, length)
    mask[0, 5:] = 0
    mask[3, 2:] = 0
    return old, rollout, new, adv, mask


def test_masked_share_metrics_on_random_ratios():
    old, rollout, _, _, mask = random_batch()
    ratio = torch.exp(old - rollout)
    valid = mask.bool()
    keep, metrics = ca.compute_rollout_mismatch_mask(old, rollout, mask, token_band=ICEPOP, sequence_band=(0.8, 1.25))
    token_out = valid & ((ratio < 0.5) | (ratio > 2.0))
    geo = torch.exp((torch.log(ratio) * mask).sum(-1) / mask.sum(-1))
    seq_out = (geo < 0.8) | (geo > 1.25)
    assert 0 < token_out.sum() < valid.sum() and 0 < seq_out.sum() < len(seq_out), "bands too wide or narrow to test"
    assert metrics["rollout_mask/token_masked_frac"] == pytest.approx(token_out.sum().item() / valid.sum().item())
    assert metrics["rollout_mask/seq_masked_frac"] == pytest.approx(seq_out.float().mean().item())
    dropped = valid & (token_out | seq_out[:, None])
    assert torch.equal(keep.bool(), valid & ~dropped)
    assert metrics["rollout_mask/masked_frac"] == pytest.approx(dropped.sum().item() / valid.sum().item())


@pytest.mark.parametrize("mode", ["vanilla", "gspo", "gpg"])
def test_a_masked_token_passes_exactly_zero_gradient(mode):
    old, rollout, new, adv, mask = random_batch(seed=1)
    fn = ca.get_policy_loss_fn(mode)
    config = {"clip_ratio": 0.2, "clip_ratio_c": 3.0}
    weights, _ = ca.compute_rollout_correction(old, rollout, mask, token_band=ICEPOP, sequence_band=(0.8, 1.25))
    dropped = mask.bool() & (weights == 0)
    assert dropped.any() and (weights > 0).any()

    (plain_grad,) = torch.autograd.grad(fn(old, new, adv, mask, "token-mean", config)[0], new)
    (masked_grad,) = torch.autograd.grad(fn(old, new, adv, mask, "token-mean", config, rollout_is_weights=weights)[0], new)
    assert (plain_grad[dropped] != 0).all()  # these tokens did carry gradient ...
    assert (masked_grad[dropped] == 0).all()  # ... and carry exactly none once masked
    # the kept tokens' gradient is unchanged: masking does not re-normalise the others up
    kept = weights > 0
    torch.testing.assert_close(masked_grad[kept], plain_grad[kept])


def default_config(*overrides):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name="ppo_trainer", overrides=list(overrides))


@pytest.mark.parametrize("overrides,match", [
    (["algorithm.rollout_mask.token_low=2.0", "algorithm.rollout_mask.token_high=2.0"],
     r"algorithm.rollout_mask.token_low=2.0 must be < algorithm.rollout_mask.token_high=2.0"),
    (["algorithm.rollout_mask.sequence_low=0.9", "algorithm.rollout_mask.sequence_high=0.8"],
     r"algorithm.rollout_mask.sequence_low=0.9 must be <"),
    (["algorithm.rollout_mask.token_low=0"], "algorithm.rollout_mask.token_low"),
    (["algorithm.rollout_mask.sequence_high=-1"], "algorithm.rollout_mask.sequence_high"),
    (["algorithm.rollout_mask.token_low=1.2"], "token_low=1.2 is above 1"),
    (["algorithm.rollout_mask.sequence_high=0.9"], "sequence_high=0.9 is below 1"),
    (["algorithm.rollout_mask.token_high=2", "actor_rollout_ref.rollout.calculate_log_probs=false"],
     "algorithm.rollout_mask needs the sampler's log-probs"),
    (["algorithm.rollout_mask.token_high=2", "algorithm.reuse_update_log_probs=true"], "reuse_update_log_probs"),
    (["algorithm.rollout_mask.token_high=2", "algorithm.use_rollout_log_probs=true"], "use_rollout_log_probs"),
])
def test_preflight_refuses(overrides, match):
    config = default_config("actor_rollout_ref.rollout.calculate_log_probs=true", *overrides)
    with pytest.raises(ConfigError, match=match):
        check_rollout_is(config.algorithm, config.actor_rollout_ref.rollout)


def test_preflight_names_every_bad_band_at_once():
    config = default_config("algorithm.rollout_mask.token_low=3", "algorithm.rollout_mask.token_high=2",
                            "algorithm.rollout_mask.sequence_low=0")
    with pytest.raises(ConfigError) as err:
        check_rollout_is(config.algorithm, config.actor_rollout_ref.rollout)
    assert "token_low=3" in str(err.value) and "sequence_low" in str(err.value)


def test_preflight_accepts_the_mask_alone_and_with_truncation():
    bands = ["algorithm.rollout_mask.token_low=0.5", "algorithm.rollout_mask.token_high=2",
             "algorithm.rollout_mask.sequence_low=0.8", "algorithm.rollout_mask.sequence_high=1.25"]
    for extra in ([], ["algorithm.rollout_is=token"], ["algorithm.rollout_is=sequence"]):
        config = default_config("actor_rollout_ref.rollout.calculate_log_probs=true", *bands, *extra)
        check_rollout_is(config.algorithm, config.actor_rollout_ref.rollout)
