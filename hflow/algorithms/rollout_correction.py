"""Rollout correction: the per-token factors of the policy loss for the gap between the sampler (vLLM) and
the trainer: truncated importance-sampling weights and the mismatch mask (IcePop). Re-exported by
`hflow.algorithms.core_algos`, the contract's import path."""

from __future__ import annotations

import enum

import numpy as np
import torch


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
