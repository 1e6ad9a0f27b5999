"""The math of RL post-training: advantage estimators, loss aggregation, policy / value / entropy
losses, KL estimators and KL controllers.

Pure torch, checkable line by line against the papers cited in each docstring. All per-token tensors
are response-aligned, shape `(batch, response_length)`; `response_mask` is 1 on tokens the policy
generated (0 on padding after EOS and, in multi-turn rollouts, on observation tokens inside the
response). Notation: `r_t` token reward, `m_t` mask, `V_t` value, `S_i = sum_t r_{i,t}` the sequence
score of sample `i` (outcome rewards sit at the last valid token), `G` the group of samples drawn from
the same prompt (same `uid`).

Advantage estimators are looked up by name (`algorithm.adv_estimator`) and policy losses by name
(`actor.policy_loss.loss_mode`). Every estimator runs without gradient and returns
`(advantages, returns)`, both zero outside `response_mask`.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hflow.utils.torch_functional import entropy_from_logits, masked_mean, masked_sum, masked_whiten

# ``log pi - log pi_old`` is clamped to this range before ``exp`` so that one stale token cannot
# overflow the importance ratio (exp(20) ~ 5e8 is still finite in fp32 and bf16).
LOG_RATIO_CLAMP = 20.0

# ==================================================================================================
# Advantage estimator registry
# ==================================================================================================


class AdvantageEstimator(enum.StrEnum):
    """Names accepted by `algorithm.adv_estimator`."""

    GAE = "gae"
    GRPO = "grpo"
    GRPO_PASSK = "grpo_passk"
    RLOO = "rloo"
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"
    REINFORCE_PLUS_PLUS_BASELINE = "reinforce_plus_plus_baseline"
    REMAX = "remax"
    OPO = "opo"


AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
# Prompt id of each sample (the `uid` column: a numpy object array of str, a list, or an int tensor).
GroupIndex = Sequence[Hashable] | np.ndarray | torch.Tensor
_ADV_ESTIMATORS: dict[str, AdvantageFn] = {}


def register_adv_est(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator registering an advantage estimator under `name` (a str or `AdvantageEstimator`).

    Registering the same function twice is a no-op; a different function under a taken name is an error.
    """
    key = str(name)

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        existing = _ADV_ESTIMATORS.get(key)
        if existing is not None and existing is not fn:
            raise ValueError(f"advantage estimator {key!r} is already registered to {existing.__qualname__}")
        _ADV_ESTIMATORS[key] = fn
        return fn

    return decorator


def get_adv_estimator_fn(name: str) -> AdvantageFn:
    """The estimator registered under `name` (case-sensitive); unknown names raise a ValueError
    listing the known ones."""
    try:
        return _ADV_ESTIMATORS[str(name)]
    except KeyError:
        raise ValueError(
            f"Unknown advantage estimator {name!r}; known estimators: {', '.join(sorted(_ADV_ESTIMATORS))}"
        ) from None


def call_adv_estimator(name: str, **inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Run estimator `name` on the subset of `inputs` its signature names.

    The trainer passes everything it has (`token_level_rewards`, `response_mask`, `values`, `index`,
    `reward_baselines`, `gamma`, `lam`, `norm_adv_by_std_in_grpo`, ...); each estimator takes what it
    needs. A required input that is missing raises a TypeError naming it.
    """
    fn = get_adv_estimator_fn(name)
    params = inspect.signature(fn).parameters
    missing = [p for p, spec in params.items() if spec.default is inspect.Parameter.empty and p not in inputs]
    if missing:
        raise TypeError(f"advantage estimator {str(name)!r} needs input(s) {missing}, which were not given")
    return fn(**{k: v for k, v in inputs.items() if k in params})


# --------------------------------------------------------------------------------------------------
# Group helpers (group = samples sharing a prompt uid)
# --------------------------------------------------------------------------------------------------


def _group_ids(index: GroupIndex, device: torch.device) -> torch.Tensor:
    """Map each sample's uid to a dense group id 0..n_groups-1 (order of first appearance)."""
    if isinstance(index, torch.Tensor):
        index = index.tolist()
    ids: dict[Hashable, int] = {}
    dense = [ids.setdefault(uid, len(ids)) for uid in index]
    return torch.tensor(dense, dtype=torch.long, device=device)


def _group_stats(scores: torch.Tensor, group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample (size, sum, unbiased std) of its group's scores; std is 0 for groups of one."""
    n_groups = int(group.max()) + 1 if group.numel() else 0
    size = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, group, torch.ones_like(scores))
    total = torch.zeros_like(size).index_add_(0, group, scores)
    mean = total / size
    sq_dev = torch.zeros_like(size).index_add_(0, group, (scores - mean[group]) ** 2)
    std = torch.sqrt(sq_dev / (size - 1).clamp(min=1))
    return size[group], total[group], std[group]


def _broadcast(per_sample: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Outcome advantage A_i placed on every valid token of sample i."""
    return per_sample.unsqueeze(-1) * response_mask


# --------------------------------------------------------------------------------------------------
# Estimators
# --------------------------------------------------------------------------------------------------


@register_adv_est(AdvantageEstimator.GAE)
@torch.no_grad()
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, eq. 16), right to left:

        delta_t = r_t + gamma * V_next - V_t,   A_t = delta_t + gamma * lam * A_next.

    `V_next` / `A_next` belong to the next *valid* token: masked positions inside a response
    (multi-turn observations) are skipped, and after the last valid token the episode is over
    (V = 0, A = 0). Values and rewards at masked positions therefore never enter the result.
    returns = A + V; the advantages are then whitened over the batch's valid tokens.
    """
    mask = response_mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        m = mask[:, t]
        next_value = m * values[:, t] + (1 - m) * next_value
        next_adv = m * adv_t + (1 - m) * next_adv
        advantages[:, t] = m * adv_t
    returns = (advantages + values) * mask
    advantages = masked_whiten(advantages, mask) * mask
    return advantages, returns


@register_adv_est(AdvantageEstimator.GRPO)
@torch.no_grad()
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (Shao et al. 2024, DeepSeekMath sec. 4.1.2): A_i = (S_i - mean_G S) / (std_G S + epsilon),
    std unbiased. With `norm_adv_by_std_in_grpo=False`, A_i = S_i - mean_G S (Dr.GRPO, Liu et al. 2025).

    A group of one has no peers to compare with: mean 0, std 1, so A_i = S_i / (1 + epsilon).
    returns = advantages.
    """
    scores = token_level_rewards.sum(dim=-1)
    size, total, std = _group_stats(scores, _group_ids(index, scores.device))
    single = size == 1
    mean = torch.where(single, 0.0, total / size)
    std = torch.where(single, 1.0, std)
    adv = scores - mean
    if norm_adv_by_std_in_grpo:
        adv = adv / (std + epsilon)
    advantages = _broadcast(adv, response_mask)
    return advantages, advantages


@register_adv_est(AdvantageEstimator.GRPO_PASSK)
@torch.no_grad()
def compute_grpo_passk_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k GRPO (Chen et al. 2025, "Pass@k Training"): only the best sample of each group is
    credited, with its margin over the runner-up, A_best = S_best - S_second (divided by
    std_G S + epsilon when normalising); every other sample gets 0, and so does a group whose best
    score is tied (margin 0). Every group needs at least two samples.
    """
    scores = token_level_rewards.sum(dim=-1)
    group = _group_ids(index, scores.device)
    size, _, std = _group_stats(scores, group)
    if bool((size < 2).any()):
        raise ValueError("grpo_passk needs at least 2 samples per group (rollout.n >= 2)")
    adv = torch.zeros_like(scores)
    for g in range(int(group.max()) + 1):
        members = torch.nonzero(group == g).squeeze(-1)
        top2 = torch.topk(scores[members], 2)
        best = members[top2.indices[0]]
        margin = top2.values[0] - top2.values[1]
        adv[best] = margin / (std[best] + epsilon) if norm_adv_by_std_in_grpo else margin
    advantages = _broadcast(adv, response_mask)
    return advantages, advantages


@register_adv_est(AdvantageEstimator.RLOO)
@torch.no_grad()
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024): the baseline of sample i is the
    mean score of the other samples of its group, A_i = S_i - (sum_G S - S_i) / (|G| - 1).
    A group of one has no other sample: baseline 0, A_i = S_i. returns = advantages.
    (`epsilon` is accepted for a uniform signature; the formula has no division by a statistic.)
    """
    scores = token_level_rewards.sum(dim=-1)
    size, total, _ = _group_stats(scores, _group_ids(index, scores.device))
    baseline = (total - scores) / (size - 1).clamp(min=1)  # a group of one: (S_i - S_i) / 1 = 0
    advantages = _broadcast(scores - baseline, response_mask)
    return advantages, advantages


@register_adv_est(AdvantageEstimator.OPO)
@torch.no_grad()
def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """On-policy RL with optimal baseline (OPO, Hao et al. 2025): the group baseline is the
    length-weighted mean score b_G = sum_j |y_j| S_j / sum_j |y_j| (|y_j| = valid tokens of sample j),
    A_i = S_i - b_G. A group of one gets baseline 0. returns = advantages.
    (`epsilon` is accepted for a uniform signature.)
    """
    scores = token_level_rewards.sum(dim=-1)
    lengths = response_mask.sum(dim=-1).to(scores.dtype)
    group = _group_ids(index, scores.device)
    size, weighted, _ = _group_stats(scores * lengths, group)
    _, total_len, _ = _group_stats(lengths, group)
    baseline = torch.where(size > 1, weighted / total_len.clamp(min=1e-8), 0.0)
    advantages = _broadcast(scores - baseline, response_mask)
    return advantages, advantages


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS_BASELINE)
@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with group baseline (Hu 2025): S_i - mean_G S (0 for a group of one) on every valid
    token, then whitened over all valid tokens of the batch. returns = advantages.
    (`epsilon` is accepted for a uniform signature; whitening uses its own 1e-8.)
    """
    scores = token_level_rewards.sum(dim=-1)
    size, total, _ = _group_stats(scores, _group_ids(index, scores.device))
    mean = torch.where(size > 1, total / size, 0.0)
    mask = response_mask.to(scores.dtype)
    advantages = masked_whiten(_broadcast(scores - mean, mask), mask) * mask
    return advantages, advantages


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS)
@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): discounted return-to-go G_t = r_t + gamma * G_next, whitened over the
    batch's valid tokens. As in GAE, masked positions are skipped (G_next is the return at the next
    valid token) and the return is 0 after the last valid token.
    """
    mask = response_mask.to(token_level_rewards.dtype)
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros_like(token_level_rewards[:, 0])
    for t in reversed(range(token_level_rewards.shape[1])):
        m = mask[:, t]
        running = m * (token_level_rewards[:, t] + gamma * running) + (1 - m) * running
        returns[:, t] = m * running
    advantages = masked_whiten(returns, mask) * mask
    return advantages, returns


@register_adv_est(AdvantageEstimator.REMAX)
@torch.no_grad()
def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor, reward_baselines: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023): REINFORCE with the reward of the greedy response as baseline,
    A_t = (sum_{k>=t} r_k m_k) - b_i on valid tokens; returns = the undiscounted return-to-go."""
    mask = response_mask.to(token_level_rewards.dtype)
    returns = torch.flip(torch.cumsum(torch.flip(token_level_rewards * mask, dims=[-1]), dim=-1), dims=[-1]) * mask
    advantages = returns - reward_baselines.reshape(-1, 1) * mask
    return advantages, returns


# ==================================================================================================
# Loss aggregation
# ==================================================================================================


class LossAggMode(enum.StrEnum):
    """Names accepted by `actor.loss_agg_mode`."""

    TOKEN_MEAN = "token-mean"
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"


@dataclass(frozen=True)
class GlobalBatchInfo:
    """Denominators of a loss taken over a whole mini-batch that is processed in pieces.

    A PPO mini-batch is cut into micro-batches (gradient accumulation) and across `dp_size` data-parallel
    ranks whose gradients are *averaged*. If each micro-batch loss is its own mean, the gradient depends
    on how the batch was cut (a short micro-batch weighs as much as a long one). Instead, each
    micro-batch returns its *sum* divided by the mini-batch-wide count, times `dp_size` to undo the
    rank averaging:

        loss_micro = sum_{micro} l * m / num_tokens * dp_size      (token-mean)

    so sum over micro-batches and mean over ranks of the gradients equals the gradient of the mean
    over the full mini-batch. Sequence modes use `num_seqs` (sequences with at least one valid token)
    the same way.

    Worker usage, once per mini-batch, before its micro-batch loop:
        info = GlobalBatchInfo.from_mask(mini_batch_response_mask)   # all-reduces when distributed
        for micro in micro_batches:
            loss = policy_loss_fn(..., loss_agg_mode=mode, config=cfg, global_batch_info=info)[0]
            loss.backward()                                            # no extra / grad_accum scaling
    """

    num_tokens: float  # valid tokens in the mini-batch, summed over all ranks
    num_seqs: float  # sequences with >= 1 valid token in the mini-batch, summed over all ranks
    dp_size: int = 1  # ranks whose gradients are averaged

    @classmethod
    def from_mask(cls, loss_mask: torch.Tensor, process_group: Any = None) -> GlobalBatchInfo:
        """Count tokens and sequences of this rank's mini-batch mask; when torch.distributed is
        initialised, sum the counts over `process_group` (default: the world), whose size is dp_size."""
        counts = torch.stack([loss_mask.sum(), (loss_mask.sum(dim=-1) > 0).sum()]).to(torch.float64)
        dp_size = 1
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(counts, group=process_group)
            dp_size = torch.distributed.get_world_size(process_group)
        num_tokens, num_seqs = counts.tolist()
        return cls(num_tokens=num_tokens, num_seqs=num_seqs, dp_size=dp_size)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    global_batch_info: GlobalBatchInfo | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss `(bs, L)` to a scalar.

    * `token-mean`: sum of l*m over all tokens / number of valid tokens.
    * `seq-mean-token-sum`: mean over sequences of sum_t l*m.
    * `seq-mean-token-mean`: mean over sequences of (sum_t l*m / sum_t m).
    * `seq-mean-token-sum-norm`: `seq-mean-token-sum` / L with L = `loss_mask.shape[-1]`, a constant
      (Dr.GRPO, Liu et al. 2025: no length normalisation, which biases towards long wrong answers).

    Sequence means count only sequences with at least one valid token. Without `global_batch_info` the
    denominators come from this batch; with it, from the whole mini-batch (see `GlobalBatchInfo`).
    An all-masked batch gives 0.
    """
    if global_batch_info is None:
        num_tokens, num_seqs, dp_size = loss_mask.sum(), (loss_mask.sum(dim=-1) > 0).sum(), 1
    else:
        info = global_batch_info
        num_tokens, num_seqs, dp_size = info.num_tokens, info.num_seqs, info.dp_size

    if loss_agg_mode == LossAggMode.TOKEN_MEAN:
        total, count = masked_sum(loss_mat, loss_mask), num_tokens
    elif loss_agg_mode == LossAggMode.SEQ_MEAN_TOKEN_SUM:
        total, count = masked_sum(loss_mat, loss_mask), num_seqs
    elif loss_agg_mode == LossAggMode.SEQ_MEAN_TOKEN_MEAN:
        total, count = masked_mean(loss_mat, loss_mask, axis=-1).sum(), num_seqs
    elif loss_agg_mode == LossAggMode.SEQ_MEAN_TOKEN_SUM_NORM:
        total, count = masked_sum(loss_mat, loss_mask) / loss_mask.shape[-1], num_seqs
    else:
        raise ValueError(f"Unknown loss_agg_mode {loss_agg_mode!r}; known modes: {', '.join(LossAggMode)}")
    count = torch.as_tensor(count, dtype=total.dtype, device=total.device).clamp(min=1e-8)
    return total / count * dp_size


# ==================================================================================================
# Policy losses
# ==================================================================================================

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
_POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy loss under `name` (`actor.policy_loss.loss_mode`).

    A policy loss is called as `fn(old_log_prob, log_prob, advantages, response_mask,
    loss_agg_mode="token-mean", config=None, global_batch_info=None)` (plus `rollout_is_weights=` when
    algorithm.rollout_is is on: detached (bs, L) factors of the per-token loss) and returns
    `(loss, metrics)` with detached scalar metrics `pg_clipfrac`, `ppo_kl`, `pg_clipfrac_lower`.
    `config` is the actor config (a mapping or an object with attributes) holding `clip_ratio`,
    `clip_ratio_low`, `clip_ratio_high`, `clip_ratio_c`.
    """

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        existing = _POLICY_LOSSES.get(name)
        if existing is not None and existing is not fn:
            raise ValueError(f"policy loss {name!r} is already registered to {existing.__qualname__}")
        _POLICY_LOSSES[name] = fn
        return fn

    return decorator


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    """The policy loss registered under `name`; unknown names raise a ValueError listing the known ones."""
    try:
        return _POLICY_LOSSES[name]
    except KeyError:
        known = ", ".join(sorted(_POLICY_LOSSES))
        raise ValueError(f"Unknown policy loss mode {name!r}; known modes: {known}") from None


def _config_value(config: Mapping[str, Any] | Any | None, key: str, default: Any) -> Any:
    """`config[key]` for mappings (dict, DictConfig), `config.key` for other objects, else `default`."""
    if config is None:
        return default
    value = config.get(key, None) if isinstance(config, Mapping) else getattr(config, key, None)
    return default if value is None else value


def _clip_ranges(config: Mapping[str, Any] | Any | None) -> tuple[float, float]:
    """(clip_ratio_low, clip_ratio_high), each falling back to `clip_ratio` (default 0.2)."""
    clip_ratio = _config_value(config, "clip_ratio", 0.2)
    return _config_value(config, "clip_ratio_low", clip_ratio), _config_value(config, "clip_ratio_high", clip_ratio)


def _apply_rollout_is(loss_mat: torch.Tensor, rollout_is_weights: torch.Tensor | None) -> torch.Tensor:
    """The per-token loss times the rollout-correction weights (constants: no gradient through them)."""
    return loss_mat if rollout_is_weights is None else loss_mat * rollout_is_weights.detach()


def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    global_batch_info: GlobalBatchInfo | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate (Schulman et al. 2017, eq. 7) with asymmetric clipping and dual clip.

        rho = exp(clamp(log_prob - old_log_prob, -20, 20))
        l   = max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high))      eps_high > eps_low: DAPO clip-higher
        l   = min(l, -A c)  where A < 0                                  dual clip (Ye et al. 2020), c > 1

    Dual clip bounds the loss of a negative-advantage token whose ratio has grown far past 1 + eps;
    for A >= 0 the lower bound would be a no-op in the wrong direction, so it applies only to A < 0.
    Returns `(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)`: the fraction of valid tokens where
    the ratio clip is active, the approximate KL mean(old - new), and the fraction where the dual clip
    is active. Clipped tokens pass zero gradient. `rollout_is_weights` (bs, L), when given, scale the
    per-token loss before aggregation (truncated importance sampling, see `compute_rollout_is_weights`).
    """
    cliprange_low = cliprange if cliprange_low is None else cliprange_low
    cliprange_high = cliprange if cliprange_high is None else cliprange_high
    if cliprange_low is None or cliprange_high is None:
        raise ValueError("compute_policy_loss needs cliprange, or both cliprange_low and cliprange_high")
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 (dual-clip lower bound), got {clip_ratio_c}")

    log_ratio = torch.clamp(log_prob - old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio, response_mask).detach()

    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clip_loss = torch.maximum(unclipped, clipped)
    pg_clipfrac = masked_mean((clipped > unclipped).float(), response_mask).detach()

    dual_bound = -advantages * clip_ratio_c
    negative = advantages < 0
    loss_mat = torch.where(negative, torch.minimum(clip_loss, dual_bound), clip_loss)
    pg_clipfrac_lower = masked_mean(((clip_loss > dual_bound) & negative).float(), response_mask).detach()

    loss_mat = _apply_rollout_is(loss_mat, rollout_is_weights)
    pg_loss = agg_loss(loss_mat, response_mask, loss_agg_mode, global_batch_info)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


@register_policy_loss("vanilla")
def vanilla_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Mapping[str, Any] | Any | None = None,
    global_batch_info: GlobalBatchInfo | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`compute_policy_loss` with the clip ratios read from the actor config."""
    low, high = _clip_ranges(config)
    pg_loss, clipfrac, ppo_kl, clipfrac_lower = compute_policy_loss(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        cliprange_low=low,
        cliprange_high=high,
        clip_ratio_c=_config_value(config, "clip_ratio_c", 3.0),
        loss_agg_mode=loss_agg_mode,
        global_batch_info=global_batch_info,
        rollout_is_weights=rollout_is_weights,
    )
    return pg_loss, {"pg_clipfrac": clipfrac, "ppo_kl": ppo_kl, "pg_clipfrac_lower": clipfrac_lower}


@register_policy_loss("gspo")
def gspo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Mapping[str, Any] | Any | None = None,
    global_batch_info: GlobalBatchInfo | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Group Sequence Policy Optimization (Zheng et al. 2025), token form (GSPO-token, eq. 13-14).

    The importance ratio is per sequence, s_i = exp(mean_t (log_prob - old_log_prob)), and is clipped
    to [1 - eps_low, 1 + eps_high] (the paper uses very small ranges such as 3e-4 / 4e-4). Each token
    carries s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)]: its value is s_i and its gradient is s_i times
    the token's score function. With `actor.loss_agg_mode=seq-mean-token-mean` (the paper's
    objective) this is exactly the sequence-level GSPO loss and gradient.
    """
    low, high = _clip_ranges(config)
    seq_log_ratio = masked_mean(log_prob - old_log_prob, response_mask, axis=-1)
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(token_log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))

    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    loss_mat = _apply_rollout_is(torch.maximum(unclipped, clipped), rollout_is_weights)
    pg_loss = agg_loss(loss_mat, response_mask, loss_agg_mode, global_batch_info)
    metrics = {
        "pg_clipfrac": masked_mean((clipped > unclipped).float(), response_mask).detach(),
        "ppo_kl": masked_mean(old_log_prob - log_prob, response_mask).detach(),
        "pg_clipfrac_lower": torch.zeros((), device=log_prob.device),
    }
    return pg_loss, metrics


@register_policy_loss("gpg")
def gpg_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Mapping[str, Any] | Any | None = None,
    global_batch_info: GlobalBatchInfo | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Group Policy Gradient (Chu et al. 2025): the plain policy-gradient loss -A * log_prob, no ratio
    and no clipping (`old_log_prob` only feeds the `ppo_kl` metric)."""
    loss_mat = _apply_rollout_is(-advantages * log_prob, rollout_is_weights)
    pg_loss = agg_loss(loss_mat, response_mask, loss_agg_mode, global_batch_info)
    zero = torch.zeros((), device=log_prob.device)
    metrics = {
        "pg_clipfrac": zero,
        "ppo_kl": masked_mean(old_log_prob - log_prob, response_mask).detach(),
        "pg_clipfrac_lower": zero,
    }
    return pg_loss, metrics


# ==================================================================================================
# Rollout correction
# ==================================================================================================


class RolloutISLevel(enum.StrEnum):
    """Names accepted by `algorithm.rollout_is` (null = off)."""

    TOKEN = "token"
    SEQUENCE = "sequence"


@torch.no_grad()
def compute_rollout_is_weights(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    level: str = "token",
    threshold: float = 2.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance-sampling weights for the gap between the sampler and the trainer.

    The sampler (vLLM: other kernels, bf16, or weights one update older with trainer.async_steps=1) draws
    y from pi_rollout, while the loss assumes pi_old. Reweighting each token's loss by pi_old / pi_rollout,
    truncated at C = `threshold` to bound the variance (IMPALA / TIS), corrects the expectation:

        token:    w_t = min(pi_old(y_t) / pi_rollout(y_t), C)
        sequence: w   = min(prod_t pi_old(y_t) / pi_rollout(y_t), C) over the valid tokens, on every token

    The product is a sum of log-ratios, truncated at log C before `exp` so it cannot overflow.
    Returns `(weights, metrics)`: weights (bs, L), 0 outside `response_mask`; metrics `rollout_is/mean`,
    `rollout_is/max` over valid tokens and `rollout_is/clipped_frac`, the share of valid tokens (token
    level) or of sequences with a valid token (sequence level) whose raw ratio exceeded C.
    """
    if threshold <= 0:
        raise ValueError(f"rollout_is threshold must be > 0, got {threshold}")
    valid = response_mask.bool()
    # Padding may hold anything (the sampler writes 0.0 there): keep it out of sums and of exp.
    log_ratio = torch.where(valid, old_log_prob.float() - rollout_log_prob.float(), 0.0)
    log_c = float(np.log(threshold))
    if level == RolloutISLevel.TOKEN:
        clipped = (log_ratio > log_c) & valid
        weights = torch.exp(log_ratio.clamp(max=log_c))
        clipped_frac = clipped.sum() / valid.sum().clamp(min=1)
    elif level == RolloutISLevel.SEQUENCE:
        seq_log_ratio = log_ratio.sum(dim=-1, keepdim=True)
        has_tokens = valid.any(dim=-1, keepdim=True)
        clipped = (seq_log_ratio > log_c) & has_tokens
        weights = torch.exp(seq_log_ratio.clamp(max=log_c)).expand_as(log_ratio)
        clipped_frac = clipped.sum() / has_tokens.sum().clamp(min=1)
    else:
        raise ValueError(f"Unknown rollout_is level {level!r}; known levels: {', '.join(RolloutISLevel)}")
    weights = torch.where(valid, weights, 0.0)
    if not valid.any():
        return weights, {"rollout_is/mean": 1.0, "rollout_is/max": 1.0, "rollout_is/clipped_frac": 0.0}
    metrics = {
        "rollout_is/mean": weights[valid].mean().item(),
        "rollout_is/max": weights[valid].max().item(),
        "rollout_is/clipped_frac": clipped_frac.item(),
    }
    return weights, metrics


# ==================================================================================================
# Entropy and value losses
# ==================================================================================================


def compute_entropy_loss(
    logits: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    global_batch_info: GlobalBatchInfo | None = None,
) -> torch.Tensor:
    """Aggregated entropy of softmax(logits) over valid tokens (the actor subtracts
    `entropy_coeff` times this from the policy loss)."""
    return agg_loss(entropy_from_logits(logits), response_mask, loss_agg_mode, global_batch_info)


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    global_batch_info: GlobalBatchInfo | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss (PPO2 baselines; Andrychowicz et al. 2021, sec. 3.3):

        v_clip = clamp(vpreds, values - c, values + c)
        loss   = 0.5 * max((vpreds - R)^2, (v_clip - R)^2)

    The 0.5 makes the gradient (v - R), as in the PPO paper's squared-error term and CleanRL;
    `critic.optim.lr` is tuned with it. Returns `(vf_loss, vf_clipfrac)`, the fraction of valid tokens
    where the clipped term is the larger one (those pass zero gradient).
    """
    vpreds_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    loss_unclipped = (vpreds - returns) ** 2
    loss_clipped = (vpreds_clipped - returns) ** 2
    loss_mat = 0.5 * torch.maximum(loss_unclipped, loss_clipped)
    vf_loss = agg_loss(loss_mat, response_mask, loss_agg_mode, global_batch_info)
    vf_clipfrac = masked_mean((loss_clipped > loss_unclipped).float(), response_mask).detach()
    return vf_loss, vf_clipfrac


# ==================================================================================================
# KL estimators and controllers
# ==================================================================================================

_KL_ALIASES = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}
# Names `kl_penalty` accepts (`algorithm.kl_penalty`, `actor.kl_loss_type`), each also with a trailing '+'.
KL_PENALTY_NAMES = tuple(_KL_ALIASES)


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman 2020, "Approximating KL
    divergence"), with delta = logprob - ref_logprob:

    * `kl` / `k1`: delta (unbiased, high variance, can be negative);
    * `abs`: |delta|;
    * `mse` / `k2`: delta^2 / 2 (biased, low variance);
    * `low_var_kl` / `k3`: exp(-delta) + delta - 1 >= 0 (unbiased, low variance); -delta is clamped
      to [-20, 20] before exp and the result to [-10, 10] for stability.

    A trailing `+` (e.g. `k3+`) gives the straight-through variant: the value of the named
    estimator with the gradient of k2, delta * grad(logprob), whose expectation is the gradient of the
    KL when it is used as a loss (k1's and k3's own gradients are not).
    """
    straight_through = kl_penalty.endswith("+")
    name = _KL_ALIASES.get(kl_penalty.removesuffix("+"))
    if name is None:
        known = ", ".join(sorted(_KL_ALIASES) + [k + "+" for k in sorted(_KL_ALIASES)])
        raise ValueError(f"Unknown kl_penalty {kl_penalty!r}; known estimators: {known}")

    delta = logprob - ref_logprob
    if name == "k1":
        kl = delta
    elif name == "abs":
        kl = delta.abs()
    elif name == "k2":
        kl = 0.5 * delta.square()
    else:
        neg_delta = torch.clamp(-delta, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        kl = torch.clamp(torch.exp(neg_delta) - neg_delta - 1, min=-10.0, max=10.0)

    if straight_through:
        k2 = 0.5 * delta.square()
        kl = k2 + (kl - k2).detach()
    return kl


class FixedKLController:
    """Constant KL coefficient."""

    def __init__(self, kl_coef: float) -> None:
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (kept so both controllers share one interface)."""


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, sec. 2.2): proportional control of the KL towards
    `target_kl`, value <- value * (1 + clip(KL / target - 1, -0.2, 0.2) * n_steps / horizon)."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if horizon <= 0:
            raise ValueError(f"adaptive KL controller needs horizon > 0, got {horizon}")
        self.value = init_kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move the coefficient after `n_steps` samples whose mean KL was `current_kl`."""
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon


def get_kl_controller(kl_ctrl_config: Mapping[str, Any] | Any) -> FixedKLController | AdaptiveKLController:
    """Build the controller of `algorithm.kl_ctrl`: `type` is `fixed` (uses `kl_coef`) or `adaptive`
    (uses `kl_coef`, `target_kl`, `horizon`). The defaults live in the config schema, not here."""

    def value(key: str) -> Any:
        return kl_ctrl_config[key] if isinstance(kl_ctrl_config, Mapping) else getattr(kl_ctrl_config, key)

    ctrl_type = value("type")
    if ctrl_type == "fixed":
        return FixedKLController(kl_coef=value("kl_coef"))
    if ctrl_type == "adaptive":
        return AdaptiveKLController(
            init_kl_coef=value("kl_coef"), target_kl=value("target_kl"), horizon=value("horizon"))
    raise ValueError(f"Unknown algorithm.kl_ctrl.type {ctrl_type!r}; known types: fixed, adaptive")
