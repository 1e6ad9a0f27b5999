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

This module holds the losses; the estimators live in `hflow.algorithms.advantages` and the KL estimators
and controllers in `hflow.algorithms.kl`, and both are re-exported here, so every name of the contract
imports from `hflow.algorithms.core_algos`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hflow.algorithms.advantages import (  # noqa: F401 (re-exported: the contract's import path)
    AdvantageEstimator,
    AdvantageFn,
    GroupIndex,
    call_adv_estimator,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_grpo_turn_return_advantage,
    compute_opo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    compute_turn_returns,
    credit_turn_rewards,
    get_adv_estimator_fn,
    register_adv_est,
)
from hflow.algorithms.kl import (  # noqa: F401 (re-exported: the contract's import path)
    KL_PENALTY_NAMES,
    LOG_RATIO_CLAMP,
    AdaptiveKLController,
    FixedKLController,
    get_kl_controller,
    kl_penalty,
)
from hflow.utils.torch_functional import entropy_from_logits, masked_mean, masked_sum

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


@torch.no_grad()
def compute_rollout_mismatch_mask(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    token_band: tuple[float | None, float | None] = (None, None),
    sequence_band: tuple[float | None, float | None] = (None, None),
) -> tuple[torch.Tensor, dict[str, float]]:
    """Rejection of the samples the sampler and the trainer disagree on, beside truncation: where
    truncation bounds a weight, a mask drops the token (or the response) from the gradient altogether.

        token (IcePop):  keep y_t  iff  low <= pi_old(y_t) / pi_rollout(y_t) <= high
        sequence:        keep y    iff  low <= exp(mean_t log(pi_old(y_t) / pi_rollout(y_t))) <= high

    The sequence test uses the geometric mean of the token ratios, so a band means the same for a short and
    a long response (the product would reject every long one). A bound of None is open on that side. The
    comparisons are in log space: no exp to overflow. Returns `(keep, metrics)`: keep (bs, L) of 1.0 / 0.0,
    0 outside `response_mask`; `rollout_mask/token_masked_frac` (share of valid tokens outside the token
    band), `rollout_mask/seq_masked_frac` (share of responses with a valid token outside the sequence band)
    and `rollout_mask/masked_frac` (share of valid tokens dropped by either).
    """
    valid = response_mask.bool()
    log_ratio = torch.where(valid, old_log_prob.float() - rollout_log_prob.float(), 0.0)

    def outside(value: torch.Tensor, band: tuple[float | None, float | None]) -> torch.Tensor:
        low, high = band
        out = torch.zeros_like(value, dtype=torch.bool)
        if low is not None and low > 0:  # a low of 0 rejects nothing
            out |= value < float(np.log(low))
        if high is not None:
            out |= value > float(np.log(high))
        return out

    token_out = outside(log_ratio, token_band) & valid
    has_tokens = valid.any(dim=-1, keepdim=True)
    seq_log_ratio = log_ratio.sum(dim=-1, keepdim=True) / valid.sum(dim=-1, keepdim=True).clamp(min=1)
    seq_out = outside(seq_log_ratio, sequence_band) & has_tokens
    keep = valid & ~token_out & ~seq_out
    n_valid = valid.sum().clamp(min=1)
    metrics = {
        "rollout_mask/token_masked_frac": (token_out.sum() / n_valid).item(),
        "rollout_mask/seq_masked_frac": (seq_out.sum() / has_tokens.sum().clamp(min=1)).item(),
        "rollout_mask/masked_frac": ((valid & ~keep).sum() / n_valid).item(),
    }
    return keep.float(), metrics


def compute_rollout_correction(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    is_level: str | None = None,
    is_threshold: float = 2.0,
    token_band: tuple[float | None, float | None] = (None, None),
    sequence_band: tuple[float | None, float | None] = (None, None),
) -> tuple[torch.Tensor, dict[str, float]]:
    """The per-token factors of the policy loss for the sampler/trainer gap: the truncated IS weights
    (`is_level`, None = off: 1 on valid tokens) times the mismatch mask (no band: keep all). A masked token's
    factor is exactly 0, so it passes no gradient; it keeps its place in the loss's denominator, so masking a
    token does not up-weight the others (IcePop's objective). Returns `(weights, metrics)` of both parts."""
    metrics: dict[str, float] = {}
    if is_level is None:
        weights = response_mask.float()
    else:
        weights, metrics = compute_rollout_is_weights(old_log_prob, rollout_log_prob, response_mask,
                                                      level=is_level, threshold=is_threshold)
    if any(bound is not None for bound in (*token_band, *sequence_band)):
        keep, mask_metrics = compute_rollout_mismatch_mask(old_log_prob, rollout_log_prob, response_mask,
                                                           token_band, sequence_band)
        weights = weights * keep
        metrics.update(mask_metrics)
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
