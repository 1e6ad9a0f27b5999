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

import torch

from hflow.algorithms.advantages import (  # noqa: F401 (re-exported: the contract's import path)
    AdvantageEstimator,
    AdvantageFn,
    GroupIndex,
    call_adv_estimator,
    compute_gae_advantage_return,
    compute_gdpo_outcome_advantage,
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
from hflow.algorithms.rollout_correction import (  # noqa: F401 (re-exported: the contract's import path)
    RolloutISLevel,
    compute_rollout_correction,
    compute_rollout_is_weights,
    compute_rollout_mismatch_mask,
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


def _policy_loss_value(config: Mapping[str, Any] | Any | None, key: str, default: Any) -> Any:
    """`config.policy_loss.<key>` of the actor config (the mode-specific hyperparameters), else `default`."""
    return _config_value(_config_value(config, "policy_loss", None), key, default)


@register_policy_loss("cispo")
def cispo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Mapping[str, Any] | Any | None = None,
    global_batch_info: GlobalBatchInfo | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO, clipped IS-weight policy optimization (MiniMax-M1, Chen et al. 2025, eq. 4-5):

        w = sg(clip(rho, 1 - eps_low, 1 + eps_high))      rho = exp(log_prob - old_log_prob)
        l = -w * A * log_prob

    The clip bounds the importance weight, not the update: the weight is a constant (stop-gradient), so
    every token keeps the gradient -w A of the score function, where PPO's clip passes 0 for a token whose
    ratio left the trust region. eps_low/eps_high are `policy_loss.cispo_clip_ratio_low/high`; a null
    low means no lower bound (the paper tunes eps_high only). `pg_clipfrac` is the share of valid tokens
    whose weight was clipped (above or below), `pg_clipfrac_lower` the share clipped from below.
    """
    low = _policy_loss_value(config, "cispo_clip_ratio_low", None)
    high = _policy_loss_value(config, "cispo_clip_ratio_high", 0.28)
    log_ratio = torch.clamp(log_prob - old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio).detach()
    weight = torch.clamp(ratio, min=None if low is None else 1 - float(low), max=1 + float(high))
    loss_mat = _apply_rollout_is(-weight * advantages * log_prob, rollout_is_weights)
    pg_loss = agg_loss(loss_mat, response_mask, loss_agg_mode, global_batch_info)
    metrics = {
        "pg_clipfrac": masked_mean((weight != ratio).float(), response_mask).detach(),
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
        "pg_clipfrac_lower": masked_mean((weight > ratio).float(), response_mask).detach(),
    }
    return pg_loss, metrics


@register_policy_loss("sapo")
def sapo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Mapping[str, Any] | Any | None = None,
    global_batch_info: GlobalBatchInfo | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO, soft adaptive policy optimization (Qwen, Gao et al. 2025): a smooth gate instead of the clip.

        f(rho) = sigmoid(tau (rho - 1)) * 4 / tau          tau = tau_pos where A > 0, else tau_neg
        l      = -f(rho) * A

    d f / d log_prob = 4 s (1 - s) rho with s = sigmoid(tau (rho - 1)): at rho = 1 it is 1 (the plain
    policy gradient), and it decays smoothly as rho leaves 1, faster for a larger tau. SAPO damps the
    negative-advantage tokens harder (tau_neg > tau_pos): pushing a token down spreads mass onto the
    whole vocabulary and is the less stable side. Nothing is hard-clipped, so `pg_clipfrac` is 0.
    """
    tau_pos = float(_policy_loss_value(config, "tau_pos", 1.0))
    tau_neg = float(_policy_loss_value(config, "tau_neg", 1.05))
    log_ratio = torch.clamp(log_prob - old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    tau = torch.where(advantages > 0, tau_pos, tau_neg).to(ratio.dtype)
    gate = torch.sigmoid(tau * (ratio - 1)) * 4 / tau
    loss_mat = _apply_rollout_is(-gate * advantages, rollout_is_weights)
    pg_loss = agg_loss(loss_mat, response_mask, loss_agg_mode, global_batch_info)
    zero = torch.zeros((), device=log_prob.device)
    metrics = {
        "pg_clipfrac": zero,
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
        "pg_clipfrac_lower": zero,
    }
    return pg_loss, metrics


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
