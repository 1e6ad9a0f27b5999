"""Tests of hflow.trainer.ppo.core_algos.

Every estimator and loss is compared with a straightforward reference written here as plain Python
loops over samples and tokens, on seeded random inputs (random group sizes including groups of one,
random masks including all-masked rows and holes inside responses), plus hand-worked cases and
gradient checks.
"""

import math
import random
import tempfile
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from hflow.algorithms import advantages, core_algos as ca
from tests.ranks import spawn_ranks

EPS = 1e-6


# ==================================================================================================
# Random batches and plain-loop helpers
# ==================================================================================================


def make_batch(seed: int, response_length: int = 10):
    """A GRPO-style batch: groups of random size (1..5) in shuffled order; each response has a random
    length (0 = all masked); some have masked holes (multi-turn observations); the outcome score sits at
    the last valid token; values are random everywhere, masked positions included."""
    rng = random.Random(seed)
    index = [f"p{g}" for g in range(7) for _ in range(rng.randint(1, 5))]
    index.append("solo")  # always at least one group of one
    rng.shuffle(index)
    bs = len(index)
    mask = torch.zeros(bs, response_length)
    rewards = torch.zeros(bs, response_length, dtype=torch.float64)
    for i in range(bs):
        length = 0 if i == 0 else rng.randint(1, response_length)
        mask[i, :length] = 1
        if length > 3 and rng.random() < 0.5:  # an observation span inside the response
            start = rng.randint(1, length - 2)
            mask[i, start : start + rng.randint(1, length - 1 - start)] = 0
        valid = [t for t in range(response_length) if mask[i, t]]
        if valid:
            rewards[i, valid[-1]] = rng.choice([0.0, 1.0, rng.uniform(-1, 2)])
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(bs, response_length, generator=gen, dtype=torch.float64)
    return rewards, values, mask, index


def valid_positions(mask, i):
    return [t for t in range(mask.shape[1]) if mask[i, t] == 1]


def groups_of(index):
    groups = defaultdict(list)
    for i, uid in enumerate(index):
        groups[uid].append(i)
    return groups


def mean(xs):
    return sum(xs) / len(xs)


def std_unbiased(xs):
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def whiten_ref(table, mask):
    """Whiten a list-of-lists over valid positions (unbiased variance), 0 at masked positions."""
    kept = [table[i][t] for i in range(len(table)) for t in valid_positions(mask, i)]
    m, var = mean(kept), std_unbiased(kept) ** 2
    return [
        [(table[i][t] - m) / math.sqrt(var + 1e-8) if mask[i, t] else 0.0 for t in range(mask.shape[1])]
        for i in range(len(table))
    ]


def broadcast_ref(per_sample, mask):
    return [[per_sample[i] if mask[i, t] else 0.0 for t in range(mask.shape[1])] for i in range(len(per_sample))]


def scores_of(rewards):
    return [sum(row) for row in rewards.tolist()]


def assert_table_close(tensor, table, tol=1e-9):
    torch.testing.assert_close(tensor.double(), torch.tensor(table, dtype=torch.float64), rtol=tol, atol=tol)


# ==================================================================================================
# Reference advantage estimators (plain loops)
# ==================================================================================================


def gae_ref(rewards, values, mask, gamma, lam):
    bs, length = mask.shape
    adv = [[0.0] * length for _ in range(bs)]
    ret = [[0.0] * length for _ in range(bs)]
    for i in range(bs):
        next_value, next_adv = 0.0, 0.0  # terminal after the last valid token
        for t in reversed(valid_positions(mask, i)):
            delta = rewards[i, t].item() + gamma * next_value - values[i, t].item()
            next_adv = delta + gamma * lam * next_adv
            next_value = values[i, t].item()
            adv[i][t] = next_adv
            ret[i][t] = next_adv + values[i, t].item()
    return whiten_ref(adv, mask), ret


def grpo_ref(rewards, mask, index, norm_by_std=True):
    scores = scores_of(rewards)
    adv = []
    for i, uid in enumerate(index):
        members = [scores[j] for j in groups_of(index)[uid]]
        mu, sigma = (0.0, 1.0) if len(members) == 1 else (mean(members), std_unbiased(members))
        adv.append((scores[i] - mu) / (sigma + EPS) if norm_by_std else scores[i] - mu)
    return broadcast_ref(adv, mask)


def passk_ref(rewards, mask, index, norm_by_std=True):
    scores = scores_of(rewards)
    adv = [0.0] * len(scores)
    for members in groups_of(index).values():
        ranked = sorted(members, key=lambda j: -scores[j])
        margin = scores[ranked[0]] - scores[ranked[1]]
        sigma = std_unbiased([scores[j] for j in members])
        adv[ranked[0]] = margin / (sigma + EPS) if norm_by_std else margin
    return broadcast_ref(adv, mask)


def rloo_ref(rewards, mask, index):
    scores = scores_of(rewards)
    adv = []
    for i, uid in enumerate(index):
        others = [scores[j] for j in groups_of(index)[uid] if j != i]
        adv.append(scores[i] - (mean(others) if others else 0.0))
    return broadcast_ref(adv, mask)


def opo_ref(rewards, mask, index):
    scores = scores_of(rewards)
    lengths = [len(valid_positions(mask, i)) for i in range(len(scores))]
    adv = []
    for i, uid in enumerate(index):
        members = groups_of(index)[uid]
        if len(members) == 1:
            baseline = 0.0
        else:
            baseline = sum(lengths[j] * scores[j] for j in members) / sum(lengths[j] for j in members)
        adv.append(scores[i] - baseline)
    return broadcast_ref(adv, mask)


def rpp_baseline_ref(rewards, mask, index):
    scores = scores_of(rewards)
    centred = []
    for i, uid in enumerate(index):
        members = [scores[j] for j in groups_of(index)[uid]]
        centred.append(scores[i] - (mean(members) if len(members) > 1 else 0.0))
    return whiten_ref(broadcast_ref(centred, mask), mask)


def rpp_ref(rewards, mask, gamma):
    bs, length = mask.shape
    ret = [[0.0] * length for _ in range(bs)]
    for i in range(bs):
        running = 0.0
        for t in reversed(valid_positions(mask, i)):
            running = rewards[i, t].item() + gamma * running
            ret[i][t] = running
    return whiten_ref(ret, mask), ret


def remax_ref(rewards, baselines, mask):
    bs, length = mask.shape
    adv = [[0.0] * length for _ in range(bs)]
    ret = [[0.0] * length for _ in range(bs)]
    for i in range(bs):
        for t in valid_positions(mask, i):
            ret[i][t] = sum(rewards[i, k].item() for k in valid_positions(mask, i) if k >= t)
            adv[i][t] = ret[i][t] - baselines[i].item()
    return adv, ret


# ==================================================================================================
# Advantage estimators: random inputs against the references
# ==================================================================================================

SEEDS = [0, 1, 2]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.95)])
def test_gae_matches_loop(seed, gamma, lam):
    rewards, values, mask, _ = make_batch(seed)
    adv, ret = ca.compute_gae_advantage_return(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = gae_ref(rewards, values, mask, gamma, lam)
    assert_table_close(adv, ref_adv)
    assert_table_close(ret, ref_ret)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_matches_loop(seed, norm_by_std):
    rewards, _, mask, index = make_batch(seed)
    adv, ret = ca.compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=norm_by_std)
    assert_table_close(adv, grpo_ref(rewards, mask, index, norm_by_std))
    assert torch.equal(adv, ret)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_passk_matches_loop(seed, norm_by_std):
    rewards, _, mask, index = make_batch(seed)
    keep = [i for i, uid in enumerate(index) if index.count(uid) >= 2]
    rewards, mask, index = rewards[keep], mask[keep], [index[i] for i in keep]
    adv, _ = ca.compute_grpo_passk_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=norm_by_std)
    assert_table_close(adv, passk_ref(rewards, mask, index, norm_by_std))


@pytest.mark.parametrize("seed", SEEDS)
def test_rloo_matches_loop(seed):
    rewards, _, mask, index = make_batch(seed)
    adv, ret = ca.compute_rloo_outcome_advantage(rewards, mask, index)
    assert_table_close(adv, rloo_ref(rewards, mask, index))
    assert torch.equal(adv, ret)


@pytest.mark.parametrize("seed", SEEDS)
def test_opo_matches_loop(seed):
    rewards, _, mask, index = make_batch(seed)
    adv, _ = ca.compute_opo_outcome_advantage(rewards, mask, index)
    assert_table_close(adv, opo_ref(rewards, mask, index))


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_plus_plus_baseline_matches_loop(seed):
    rewards, _, mask, index = make_batch(seed)
    adv, _ = ca.compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, index)
    assert_table_close(adv, rpp_baseline_ref(rewards, mask, index))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma", [1.0, 0.8])
def test_reinforce_plus_plus_matches_loop(seed, gamma):
    rewards, _, mask, _ = make_batch(seed)
    rewards = rewards + torch.rand_like(rewards) * (torch.rand_like(rewards) < 0.3)  # dense, also outside mask
    adv, ret = ca.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma)
    ref_adv, ref_ret = rpp_ref(rewards, mask, gamma)
    assert_table_close(adv, ref_adv)
    assert_table_close(ret, ref_ret)


@pytest.mark.parametrize("seed", SEEDS)
def test_remax_matches_loop(seed):
    rewards, _, mask, _ = make_batch(seed)
    baselines = torch.randn(len(rewards), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    adv, ret = ca.compute_remax_outcome_advantage(rewards, baselines, mask)
    ref_adv, ref_ret = remax_ref(rewards, baselines, mask)
    assert_table_close(adv, ref_adv)
    assert_table_close(ret, ref_ret)


@pytest.mark.parametrize("name", list(ca.AdvantageEstimator))
def test_every_estimator_is_zero_and_finite_outside_the_mask(name):
    rewards, values, mask, index = make_batch(5)
    keep = [i for i, uid in enumerate(index) if index.count(uid) >= 2] + [0]  # row 0 is all masked
    rewards, values, mask, index = rewards[keep], values[keep], mask[keep], [index[i] for i in keep]
    index[-1] = index[0]  # put the all-masked row in a group of >= 2 (grpo_passk needs it)
    inputs = dict(
        token_level_rewards=rewards,
        values=values,
        response_mask=mask,
        index=index,
        reward_baselines=torch.zeros(len(keep), dtype=torch.float64),
        gamma=0.9,
        lam=0.95,
        norm_adv_by_std_in_grpo=True,
        reward_scores={"a": rewards.sum(-1), "b": -rewards.sum(-1) ** 2},  # gdpo's named rewards
        reward_weights={"a": 1.0, "b": 0.5},
    )
    adv, ret = ca.call_adv_estimator(name, **inputs)
    for out in (adv, ret):
        assert torch.isfinite(out).all()
        assert (out[mask == 0] == 0).all()


# ==================================================================================================
# Advantage estimators: hand-worked cases
# ==================================================================================================


def outcome(scores, length=3):
    """Rewards with each score at the last token of a full-length response, and the all-ones mask."""
    rewards = torch.zeros(len(scores), length, dtype=torch.float64)
    rewards[:, -1] = torch.tensor(scores, dtype=torch.float64)
    return rewards, torch.ones(len(scores), length)


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_identical_scores_give_zero_advantage(norm_by_std):
    rewards, mask = outcome([1.0, 1.0, 1.0, 0.0, 0.0])
    index = ["a", "a", "a", "b", "b"]
    adv, _ = ca.compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=norm_by_std)
    assert torch.equal(adv, torch.zeros_like(adv))


def test_grpo_group_of_one_gets_its_score():
    rewards, mask = outcome([0.7, 1.0, 0.0])
    index = ["solo", "pair", "pair"]
    adv, _ = ca.compute_grpo_outcome_advantage(rewards, mask, index)
    assert adv[0].tolist() == pytest.approx([0.7] * 3, rel=1e-5)
    # pair: mean 0.5, unbiased std sqrt(0.5)
    assert adv[1, 0].item() == pytest.approx(0.5 / (math.sqrt(0.5) + EPS))
    dr_adv, _ = ca.compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=False)
    assert dr_adv[:, 0].tolist() == pytest.approx([0.7, 0.5, -0.5])


def test_grpo_uid_types_and_all_masked_row():
    rewards, mask = outcome([1.0, 0.0, 2.0, 2.0])
    mask[1] = 0
    for index in (["x", "x", "y", "y"], torch.tensor([3, 3, 7, 7]), [("a", 1), ("a", 1), 5, 5]):
        adv, _ = ca.compute_grpo_outcome_advantage(rewards, mask, index)
        assert torch.isfinite(adv).all()
        assert adv[1].tolist() == [0.0, 0.0, 0.0]
        assert adv[2:].abs().sum() == 0


def test_rloo_hand_cases():
    rewards, mask = outcome([1.0, 2.0, 6.0, 5.0])
    adv, _ = ca.compute_rloo_outcome_advantage(rewards, mask, ["g", "g", "g", "solo"])
    assert adv[:, 0].tolist() == pytest.approx([1 - 4, 2 - 3.5, 6 - 1.5, 5.0])


def test_grpo_passk_hand_cases():
    rewards, mask = outcome([1.0, 3.0, 2.0, 3.0, 3.0, 1.0])
    adv, _ = ca.compute_grpo_passk_outcome_advantage(rewards, mask, ["a", "a", "a", "b", "b", "b"])
    # group a: best 3, runner-up 2, std([1, 3, 2]) = 1; group b: tie for best -> all zero
    assert adv[:, 0].tolist() == pytest.approx([0.0, 1 / (1 + EPS), 0.0, 0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="at least 2"):
        ca.compute_grpo_passk_outcome_advantage(rewards, mask, ["a", "a", "a", "b", "b", "c"])


def test_opo_hand_case():
    rewards, mask = outcome([1.0, 0.0, 4.0], length=4)
    mask[0, 2:] = 0  # lengths 2 and 4
    rewards[0] = torch.tensor([0.0, 1.0, 0.0, 0.0])
    adv, _ = ca.compute_opo_outcome_advantage(rewards, mask, ["g", "g", "solo"])
    # baseline (2 * 1 + 4 * 0) / 6 = 1/3; a group of one has baseline 0
    assert adv[0].tolist() == pytest.approx([2 / 3, 2 / 3, 0, 0])
    assert adv[1].tolist() == pytest.approx([-1 / 3] * 4)
    assert adv[2].tolist() == pytest.approx([4.0] * 4)


def test_gae_hand_cases():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    values = torch.tensor([[0.3, 0.2, 0.1], [0.3, 9.0, 0.1]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]])
    # lambda = 1: returns are the discounted reward-to-go over valid tokens, whatever the values
    _, ret = ca.compute_gae_advantage_return(rewards, values, mask, gamma=0.5, lam=1.0)
    assert ret.tolist() == [pytest.approx([0.25, 0.5, 1.0]), pytest.approx([0.5, 0.0, 1.0])]
    # lambda = 0: returns_t = r_t + gamma * V(next valid token), 0 after the last one
    _, ret = ca.compute_gae_advantage_return(rewards, values, mask, gamma=0.5, lam=0.0)
    assert ret.tolist() == [pytest.approx([0.1, 0.05, 1.0]), pytest.approx([0.05, 0.0, 1.0])]


def test_gae_ignores_values_at_masked_positions():
    """Multi-turn: values at observation tokens and after the response must not change anything."""
    rewards, values, mask, _ = make_batch(7)
    other = values.clone()
    other[mask == 0] = torch.randn(int((mask == 0).sum()), dtype=torch.float64) * 100
    adv_a, ret_a = ca.compute_gae_advantage_return(rewards, values, mask, 0.9, 0.8)
    adv_b, ret_b = ca.compute_gae_advantage_return(rewards, other, mask, 0.9, 0.8)
    assert torch.equal(adv_a, adv_b)
    assert torch.equal(ret_a, ret_b)


def test_reinforce_plus_plus_hand_case():
    rewards = torch.tensor([[0.0, 5.0, 1.0, 3.0]])  # 5 at an observation token, 3 after the response
    mask = torch.tensor([[1, 0, 1, 0]])
    _, ret = ca.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    assert ret.tolist() == [[0.5, 0.0, 1.0, 0.0]]


def test_remax_hand_case():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.5, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = ca.compute_remax_outcome_advantage(rewards, torch.tensor([0.4, 1.0]), mask)
    assert ret.tolist() == [[1.0, 1.0, 1.0], [0.5, 0.5, 0.0]]
    assert adv.tolist() == [pytest.approx([0.6, 0.6, 0.6]), pytest.approx([-0.5, -0.5, 0.0])]


# ==================================================================================================
# Estimator registry
# ==================================================================================================


@pytest.fixture
def scratch_registry(monkeypatch):
    monkeypatch.setattr(advantages, "_ADV_ESTIMATORS", dict(advantages._ADV_ESTIMATORS))


def test_registry_lookup():
    assert ca.get_adv_estimator_fn("gae") is ca.compute_gae_advantage_return
    assert ca.get_adv_estimator_fn(ca.AdvantageEstimator.GRPO) is ca.compute_grpo_outcome_advantage
    assert {str(e) for e in ca.AdvantageEstimator} <= set(advantages._ADV_ESTIMATORS)
    with pytest.raises(ValueError, match="Unknown advantage estimator 'GAE'.*gae, gdpo, grpo"):
        ca.get_adv_estimator_fn("GAE")


def test_register_adv_est(scratch_registry):
    def estimator(token_level_rewards, response_mask):
        return token_level_rewards, token_level_rewards

    assert ca.register_adv_est("mine")(estimator) is estimator
    ca.register_adv_est("mine")(estimator)  # same function again: fine
    with pytest.raises(ValueError, match="already registered"):
        ca.register_adv_est("mine")(lambda token_level_rewards, response_mask: None)
    with pytest.raises(ValueError, match="already registered"):
        ca.register_adv_est(ca.AdvantageEstimator.GAE)(estimator)
    assert ca.get_adv_estimator_fn("mine") is estimator


def test_call_adv_estimator_passes_only_what_the_estimator_takes():
    rewards, mask = outcome([1.0, 0.0])
    inputs = dict(token_level_rewards=rewards, response_mask=mask, index=["a", "a"], gamma=1.0, lam=1.0)
    adv, _ = ca.call_adv_estimator("rloo", **inputs)
    assert adv[:, 0].tolist() == [1.0, -1.0]
    with pytest.raises(TypeError, match="remax.*reward_baselines"):
        ca.call_adv_estimator("remax", **inputs)


# ==================================================================================================
# Loss aggregation and global normalisation
# ==================================================================================================

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def agg_ref(loss, mask, mode):
    bs, length = mask.shape
    rows = [[loss[i, t].item() for t in valid_positions(mask, i)] for i in range(bs)]
    nonempty = [r for r in rows if r]
    if not nonempty:
        return 0.0
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    if mode == "seq-mean-token-sum":
        return mean([sum(r) for r in nonempty])
    if mode == "seq-mean-token-mean":
        return mean([mean(r) for r in nonempty])
    return mean([sum(r) / length for r in nonempty])


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_matches_loop(seed, mode):
    _, values, mask, _ = make_batch(seed)
    values[mask == 0] = float("nan")  # whatever sits outside the mask is ignored
    assert ca.agg_loss(values, mask, mode).item() == pytest.approx(agg_ref(values, mask, mode), rel=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_all_masked_is_zero(mode):
    loss = torch.full((3, 4), float("nan"))
    assert ca.agg_loss(loss, torch.zeros(3, 4), mode).item() == 0.0


def test_agg_loss_unknown_mode():
    with pytest.raises(ValueError, match="token-mean"):
        ca.agg_loss(torch.zeros(2, 2), torch.ones(2, 2), "token-sum")


def test_global_batch_info_counts():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    assert ca.GlobalBatchInfo.from_mask(mask) == ca.GlobalBatchInfo(num_tokens=3, num_seqs=2, dp_size=1)


def _loss_fns():
    """Per-micro-batch losses whose gradient w.r.t. log_prob we compare: (name, fn(log_prob, batch, mode, info))."""

    def policy(loss_mode):
        def fn(log_prob, b, mode, info):
            return ca.get_policy_loss_fn(loss_mode)(
                b["old"], log_prob, b["adv"], b["mask"], mode, {"clip_ratio": 0.2}, global_batch_info=info
            )[0]

        return fn

    def value(log_prob, b, mode, info):
        return ca.compute_value_loss(log_prob, b["adv"], b["old"], b["mask"], 0.1, mode, info)[0]

    def kl(log_prob, b, mode, info):
        return ca.agg_loss(ca.kl_penalty(log_prob, b["old"], "k3"), b["mask"], mode, info)

    return [
        ("vanilla", policy("vanilla")),
        ("gspo", policy("gspo")),
        ("gpg", policy("gpg")),
        ("value", value),
        ("kl", kl),
    ]


VANILLA_LOSS = dict(_loss_fns())["vanilla"]


def _mini_batch(seed, bs=8, length=12):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (bs,), generator=gen)
    lengths[3] = 0  # an all-masked row
    mask = (torch.arange(length) < lengths[:, None]).float()
    return {
        "old": -torch.rand(bs, length, generator=gen, dtype=torch.float64),
        "log_prob": -torch.rand(bs, length, generator=gen, dtype=torch.float64),
        "adv": torch.randn(bs, length, generator=gen, dtype=torch.float64),
        "mask": mask,
    }


def _grad(loss_fn, batch, mode, pieces, info):
    """Gradient accumulated over `pieces` row-slices of the batch, as the worker does."""
    log_prob = batch["log_prob"].clone().requires_grad_()
    for rows in torch.arange(len(log_prob)).tensor_split(pieces):
        micro = {k: v[rows] for k, v in batch.items()}
        loss_fn(log_prob[rows], micro, mode, info).backward()
    return log_prob.grad


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name,loss_fn", _loss_fns())
def test_global_normalisation_makes_micro_batching_invisible(mode, name, loss_fn):
    batch = _mini_batch(0)
    full = _grad(loss_fn, batch, mode, 1, None)  # plain loss over the whole mini-batch
    info = ca.GlobalBatchInfo.from_mask(batch["mask"])
    for pieces in (1, 2, 4):
        torch.testing.assert_close(_grad(loss_fn, batch, mode, pieces, info), full, rtol=1e-12, atol=1e-14)
    # data parallel: 2 ranks x 2 micro-batches each, gradients averaged across ranks
    info_dp = ca.GlobalBatchInfo(info.num_tokens, info.num_seqs, dp_size=2)
    halves = [{k: v[rows] for k, v in batch.items()} for rows in torch.arange(8).tensor_split(2)]
    rank_grads = [_grad(loss_fn, half, mode, 2, info_dp) for half in halves]
    torch.testing.assert_close(torch.cat(rank_grads) / 2, full, rtol=1e-12, atol=1e-14)


def test_local_mean_per_micro_batch_depends_on_the_cut():
    """Why the global denominator is needed: averaging micro-batch token-means changes the gradient."""
    batch = _mini_batch(0)
    full = _grad(VANILLA_LOSS, batch, "token-mean", 1, None)
    log_prob = batch["log_prob"].clone().requires_grad_()
    for rows in torch.arange(8).tensor_split(4):
        micro = {k: v[rows] for k, v in batch.items()}
        (VANILLA_LOSS(log_prob[rows], micro, "token-mean", None) / 4).backward()
    assert not torch.allclose(log_prob.grad, full)


def _dp_worker(rank: int, world_size: int, tmp: str) -> None:
    """One data-parallel rank: its half of the mini-batch in 2 micro-batches, gradients all-reduced."""
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world_size)
    try:
        batch = _mini_batch(0)
        rows = torch.arange(8).tensor_split(world_size)[rank]
        mine = {k: v[rows] for k, v in batch.items()}
        info = ca.GlobalBatchInfo.from_mask(mine["mask"])
        full_grad = torch.zeros_like(batch["log_prob"])
        full_grad[rows] = _grad(VANILLA_LOSS, mine, "token-mean", 2, info)
        dist.all_reduce(full_grad)  # what DDP/FSDP do, followed by division by the world size
        torch.save((info, full_grad / world_size), f"{tmp}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_global_batch_info_from_mask_all_reduces_across_ranks():
    batch = _mini_batch(0)
    expected = ca.GlobalBatchInfo.from_mask(batch["mask"])
    full = _grad(VANILLA_LOSS, batch, "token-mean", 1, None)
    with tempfile.TemporaryDirectory() as tmp:
        spawn_ranks(_dp_worker, 2, 2, tmp)
        for rank in range(2):
            info, grad = torch.load(f"{tmp}/rank{rank}.pt", weights_only=False)
            assert info == ca.GlobalBatchInfo(expected.num_tokens, expected.num_seqs, dp_size=2)
            torch.testing.assert_close(grad, full, rtol=1e-12, atol=1e-14)


# ==================================================================================================
# Policy losses
# ==================================================================================================


def ppo_token_ref(old, new, adv, low, high, c):
    """PPO-clip objective of one token written as in the papers; returns (loss, clipped, dual_clipped)."""
    ratio = math.exp(max(-20.0, min(20.0, new - old)))
    surrogate = ratio * adv
    clipped_surrogate = min(max(ratio, 1 - low), 1 + high) * adv
    objective = min(surrogate, clipped_surrogate)
    dual = adv < 0 and c * adv > objective
    if adv < 0:
        objective = max(objective, c * adv)
    return -objective, clipped_surrogate < surrogate, dual


def _policy_batch(seed, bs=6, length=9, spread=0.6):
    gen = torch.Generator().manual_seed(seed)
    old = -2 * torch.rand(bs, length, generator=gen, dtype=torch.float64)
    new = old + spread * torch.randn(bs, length, generator=gen, dtype=torch.float64)
    new[0, 0] = old[0, 0] + 3.0  # ratio e^3 ~ 20: beyond the dual-clip bound c = 3
    adv = torch.randn(bs, length, generator=gen, dtype=torch.float64)
    adv[0, 0] = -1.0
    mask = torch.ones(bs, length)
    mask[1, 5:] = 0
    mask[2] = 0
    mask[3, 2:4] = 0
    return old, new, adv, mask


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_vanilla_policy_loss_matches_loop(seed, mode):
    old, new, adv, mask = _policy_batch(seed)
    low, high, c = 0.2, 0.28, 3.0
    pg_loss, clipfrac, ppo_kl, clipfrac_lower = ca.compute_policy_loss(
        old, new, adv, mask, cliprange_low=low, cliprange_high=high, clip_ratio_c=c, loss_agg_mode=mode
    )
    loss = torch.zeros_like(old)
    n_valid = n_clip = n_dual = kl = 0
    for i in range(old.shape[0]):
        for t in valid_positions(mask, i):
            token = old[i, t].item(), new[i, t].item(), adv[i, t].item()
            loss[i, t], clipped, dual = ppo_token_ref(*token, low, high, c)
            n_valid, n_clip, n_dual = n_valid + 1, n_clip + clipped, n_dual + dual
            kl += old[i, t].item() - new[i, t].item()
    assert n_clip > 0 and n_dual > 0
    assert pg_loss.item() == pytest.approx(agg_ref(loss, mask, mode), rel=1e-12)
    assert clipfrac.item() == pytest.approx(n_clip / n_valid)
    assert clipfrac_lower.item() == pytest.approx(n_dual / n_valid)
    assert ppo_kl.item() == pytest.approx(kl / n_valid)


def test_vanilla_registry_entry_reads_the_actor_config():
    from omegaconf import OmegaConf

    old, new, adv, mask = _policy_batch(1)
    expected = ca.compute_policy_loss(old, new, adv, mask, cliprange_low=0.1, cliprange_high=0.3, clip_ratio_c=2.0)
    for config in (
        {"clip_ratio": 0.1, "clip_ratio_high": 0.3, "clip_ratio_c": 2.0},
        OmegaConf.create({"clip_ratio": 0.1, "clip_ratio_low": None, "clip_ratio_high": 0.3, "clip_ratio_c": 2.0}),
        SimpleNamespace(clip_ratio=0.5, clip_ratio_low=0.1, clip_ratio_high=0.3, clip_ratio_c=2.0),
    ):
        loss, metrics = ca.get_policy_loss_fn("vanilla")(old, new, adv, mask, "token-mean", config)
        assert loss.item() == expected[0].item()
        assert [metrics[k].item() for k in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower")] == [
            e.item() for e in expected[1:]
        ]


def _token_grad(old, new, adv, **kwargs):
    """Loss and d loss / d log_prob for single tokens (token-mean over one token = the token's loss)."""
    log_prob = torch.tensor([[new]], dtype=torch.float64, requires_grad=True)
    out = ca.compute_policy_loss(
        torch.tensor([[old]], dtype=torch.float64), log_prob, torch.tensor([[adv]], dtype=torch.float64),
        torch.ones(1, 1), **kwargs,
    )
    out[0].backward()
    return out[0].item(), log_prob.grad.item(), out[1].item(), out[3].item()


@pytest.mark.parametrize(
    "ratio,adv,loss,grad,clipped,dual",
    [
        (1.5, 1.0, -1.2, 0.0, 1, 0),  # A > 0 above 1 + eps: clipped, no gradient
        (0.5, 1.0, -0.5, -0.5, 0, 0),  # A > 0 below 1 - eps: the pessimistic bound keeps the ratio
        (0.5, -1.0, 0.8, 0.0, 1, 0),  # A < 0 below 1 - eps: clipped, no gradient
        (1.5, -1.0, 1.5, 1.5, 0, 0),  # A < 0 above 1 + eps: unclipped
        (5.0, -1.0, 3.0, 0.0, 0, 1),  # A < 0, ratio > c: dual clip caps the loss at c * |A|
        (5.0, 1.0, -1.2, 0.0, 1, 0),  # A > 0, ratio > c: dual clip does not apply
        (1.0, 2.0, -2.0, -2.0, 0, 0),
    ],
)
def test_ppo_clipping_hand_cases(ratio, adv, loss, grad, clipped, dual):
    got = _token_grad(0.0, math.log(ratio), adv, cliprange=0.2, clip_ratio_c=3.0)
    assert got == pytest.approx((loss, grad, clipped, dual))


def test_clip_higher_is_asymmetric():
    # ratio 1.25 with A > 0 is inside [0.8, 1.28] (clip-higher) but outside [0.8, 1.2]
    assert _token_grad(0.0, math.log(1.25), 1.0, cliprange_low=0.2, cliprange_high=0.28)[1] == pytest.approx(-1.25)
    assert _token_grad(0.0, math.log(1.25), 1.0, cliprange=0.2)[1] == 0.0
    # ratio 0.75 with A < 0 is clipped by the low side in both
    assert _token_grad(0.0, math.log(0.75), -1.0, cliprange_low=0.2, cliprange_high=0.28)[1] == 0.0


def test_log_ratio_is_clamped():
    loss, grad, _, dual = _token_grad(-100.0, 0.0, -1.0, cliprange=0.2)  # log ratio 100
    assert (loss, grad, dual) == (3.0, 0.0, 1.0)
    loss, grad, _, _ = _token_grad(0.0, -100.0, -1.0, cliprange=0.2, clip_ratio_c=10.0)
    assert math.isfinite(loss) and grad == 0.0


def test_policy_loss_all_masked_and_argument_errors():
    old, new, adv, _ = _policy_batch(0)
    mask = torch.zeros_like(old)
    for name in ("vanilla", "gspo", "gpg", "cispo", "sapo"):
        loss, metrics = ca.get_policy_loss_fn(name)(old, new.requires_grad_(), adv, mask)
        assert loss.item() == 0.0 and all(v.item() == 0.0 for v in metrics.values())
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ca.compute_policy_loss(old, new, adv, mask, cliprange=0.2, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="cliprange"):
        ca.compute_policy_loss(old, new, adv, mask, cliprange_low=0.2)
    with pytest.raises(ValueError, match="Unknown policy loss mode 'ppo'.*cispo, gpg, gspo, sapo, vanilla"):
        ca.get_policy_loss_fn("ppo")


def test_register_policy_loss(monkeypatch):
    monkeypatch.setattr(ca, "_POLICY_LOSSES", dict(ca._POLICY_LOSSES))
    with pytest.raises(ValueError, match="already registered"):
        ca.register_policy_loss("vanilla")(lambda *a, **k: None)
    assert ca.register_policy_loss("vanilla")(ca.vanilla_policy_loss) is ca.vanilla_policy_loss


@pytest.mark.parametrize("seed", SEEDS)
def test_gspo_matches_sequence_level_objective(seed):
    """GSPO-token with per-sequence advantages equals the paper's sequence-level objective
    -mean_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t (log pi - log pi_old)), in value and gradient."""
    old, new, _, mask = _policy_batch(seed, spread=0.05)
    seq_adv = torch.randn(old.shape[0], generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    adv = seq_adv[:, None].expand_as(old)
    config = {"clip_ratio_low": 0.01, "clip_ratio_high": 0.015}

    log_prob = new.clone().requires_grad_()
    loss, metrics = ca.get_policy_loss_fn("gspo")(old, log_prob, adv, mask, "seq-mean-token-mean", config)
    loss.backward()

    ref_log_prob = new.clone().requires_grad_()
    objectives, n_clipped, n_valid = [], 0, 0
    for i in range(old.shape[0]):
        tokens = valid_positions(mask, i)
        if not tokens:
            continue
        s = torch.exp(sum(ref_log_prob[i, t] - old[i, t] for t in tokens) / len(tokens))
        a = seq_adv[i]
        clipped = torch.clamp(s, 1 - 0.01, 1 + 0.015) * a
        objectives.append(torch.minimum(s * a, clipped))
        n_clipped += len(tokens) * bool(clipped < s * a)
        n_valid += len(tokens)
    ref_loss = -sum(objectives) / len(objectives)
    ref_loss.backward()
    assert 0 < n_clipped < n_valid
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-12)
    torch.testing.assert_close(log_prob.grad, ref_log_prob.grad, rtol=1e-10, atol=1e-14)
    assert metrics["pg_clipfrac"].item() == pytest.approx(n_clipped / n_valid)


def test_gpg_loss_and_gradient():
    old, new, adv, mask = _policy_batch(2)
    log_prob = new.clone().requires_grad_()
    loss, _ = ca.get_policy_loss_fn("gpg")(old, log_prob, adv, mask, "token-mean")
    loss.backward()
    n = mask.sum()
    assert loss.item() == pytest.approx(agg_ref(-adv * new, mask, "token-mean"), rel=1e-12)
    torch.testing.assert_close(log_prob.grad, -adv * mask / n)


# ==================================================================================================
# Value and entropy losses
# ==================================================================================================


@pytest.mark.parametrize("seed", SEEDS)
def test_value_loss_matches_loop(seed):
    gen = torch.Generator().manual_seed(seed)
    vpreds, returns, values = torch.randn(3, 6, 7, generator=gen, dtype=torch.float64)
    mask = torch.ones(6, 7)
    mask[2] = 0
    mask[4, 3:] = 0
    c = 0.3
    vf_loss, vf_clipfrac = ca.compute_value_loss(vpreds, returns, values, mask, c, "token-mean")
    total = n_clip = n = 0
    for i in range(6):
        for t in valid_positions(mask, i):
            v, r, old = vpreds[i, t].item(), returns[i, t].item(), values[i, t].item()
            l_plain, l_clip = (v - r) ** 2, (min(max(v, old - c), old + c) - r) ** 2
            total += 0.5 * max(l_plain, l_clip)
            n_clip += l_clip > l_plain
            n += 1
    assert 0 < n_clip < n
    assert vf_loss.item() == pytest.approx(total / n, rel=1e-12)
    assert vf_clipfrac.item() == pytest.approx(n_clip / n)


def test_value_loss_hand_cases_and_gradient():
    vpreds = torch.tensor([[1.0, 1.0, 0.2]], requires_grad=True)
    returns = torch.tensor([[2.0, -1.0, 1.0]])
    values = torch.zeros(1, 3)
    loss, clipfrac = ca.compute_value_loss(vpreds, returns, values, torch.ones(1, 3), cliprange_value=0.5)
    loss.backward()
    # token 0: clip to 0.5 is worse, (0.5-2)^2 = 2.25 > 1 -> clipped, no gradient
    # token 1: unclipped (1+1)^2 = 4 > (0.5+1)^2 -> gradient (v - R) / 3
    # token 2: inside the clip range -> gradient (v - R) / 3
    assert loss.item() == pytest.approx(0.5 * (2.25 + 4.0 + 0.64) / 3)
    assert clipfrac.item() == pytest.approx(1 / 3)
    assert vpreds.grad.tolist() == [pytest.approx([0.0, 2.0 / 3, -0.8 / 3])]


def test_entropy_loss_matches_loop():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    entropies = []
    for i, t in [(0, 0), (0, 1), (1, 0)]:
        probs = torch.softmax(logits[i, t], -1).tolist()
        entropies.append(-sum(p * math.log(p) for p in probs))
    assert ca.compute_entropy_loss(logits, mask, "token-mean").item() == pytest.approx(mean(entropies))


# ==================================================================================================
# KL estimators and controllers
# ==================================================================================================

KL_REFS = {
    "k1": lambda d: d,
    "abs": abs,
    "k2": lambda d: 0.5 * d * d,
    "k3": lambda d: max(-10.0, min(10.0, math.exp(-max(-20, min(20, d))) + max(-20, min(20, d)) - 1)),
}
KL_NAMES = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}


@pytest.mark.parametrize("name", list(KL_NAMES))
def test_kl_estimators_match_formula(name):
    gen = torch.Generator().manual_seed(0)
    logprob = -3 * torch.rand(4, 5, generator=gen, dtype=torch.float64)
    ref_logprob = -3 * torch.rand(4, 5, generator=gen, dtype=torch.float64)
    logprob[0, 0], ref_logprob[0, 0] = -40.0, 0.0  # k3 clamps to 10
    logprob[0, 1], ref_logprob[0, 1] = 0.0, -40.0
    out = ca.kl_penalty(logprob, ref_logprob, name)
    estimator = KL_REFS[KL_NAMES[name]]
    ref = [[estimator(a - b) for a, b in zip(ra, rb)] for ra, rb in zip(logprob.tolist(), ref_logprob.tolist())]
    assert_table_close(out, ref, tol=1e-12)
    if KL_NAMES[name] == "k3":
        assert out[0, 0].item() == 10.0 and (out >= 0).all()


@pytest.mark.parametrize("name", list(KL_NAMES))
def test_straight_through_kl_has_value_of_estimator_and_gradient_of_k2(name):
    logprob = torch.tensor([-1.0, -0.2, -3.0, -0.5], dtype=torch.float64, requires_grad=True)
    ref_logprob = torch.tensor([-0.5, -0.9, -3.0, -0.1], dtype=torch.float64)
    value = ca.kl_penalty(logprob, ref_logprob, name + "+")
    assert torch.equal(value, ca.kl_penalty(logprob, ref_logprob, name))
    value.sum().backward()
    torch.testing.assert_close(logprob.grad, (logprob - ref_logprob).detach())


def test_k3_gradient_and_unknown_name():
    logprob = torch.tensor([-1.0], dtype=torch.float64, requires_grad=True)
    ca.kl_penalty(logprob, torch.tensor([-0.5], dtype=torch.float64), "k3").backward()
    assert logprob.grad.item() == pytest.approx(1 - math.exp(0.5))  # d/dlogp [e^(ref-logp) - (ref-logp) - 1]
    with pytest.raises(ValueError, match="Unknown kl_penalty 'full'.*low_var_kl\\+"):
        ca.kl_penalty(logprob, logprob, "full")


def test_kl_controllers():
    fixed = ca.get_kl_controller({"type": "fixed", "kl_coef": 0.05})
    fixed.update(current_kl=10.0, n_steps=100)
    assert isinstance(fixed, ca.FixedKLController) and fixed.value == 0.05

    ctrl = ca.get_kl_controller(SimpleNamespace(type="adaptive", kl_coef=0.1, target_kl=0.1, horizon=100))
    assert isinstance(ctrl, ca.AdaptiveKLController)
    expected = 0.1
    for current_kl, error in [(0.15, 0.2), (0.05, -0.2), (0.11, 0.1), (0.1, 0.0)]:  # error clipped to +-0.2
        ctrl.update(current_kl=current_kl, n_steps=10)
        expected *= 1 + error * 10 / 100
        assert ctrl.value == pytest.approx(expected)

    with pytest.raises(ValueError, match="horizon"):
        ca.get_kl_controller({"type": "adaptive", "kl_coef": 0.1, "target_kl": 0.1, "horizon": 0})
    with pytest.raises(ValueError, match="fixed, adaptive"):
        ca.get_kl_controller({"type": "pid", "kl_coef": 0.1})
