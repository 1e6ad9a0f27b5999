"""Advantage estimators and their registry (`algorithm.adv_estimator`).

Notation as in `hflow.algorithms.core_algos`: `r_t` token reward, `m_t` response mask, `V_t` value,
`S_i = sum_t r_{i,t}` the sequence score of sample `i` (outcome rewards sit at the last valid token), `G`
the group of samples drawn from the same prompt (same `uid`). Every estimator runs without gradient and
returns `(advantages, returns)`, both zero outside `response_mask`.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from hflow.utils.torch_functional import masked_whiten

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
    GDPO = "gdpo"


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
    adv = _group_normalize(token_level_rewards.sum(dim=-1), index, epsilon, norm_adv_by_std_in_grpo)
    advantages = _broadcast(adv, response_mask)
    return advantages, advantages


def _group_normalize(scores: torch.Tensor, index: GroupIndex, epsilon: float, by_std: bool) -> torch.Tensor:
    """GRPO's per-sample A_i = (S_i - mean_G S) / (std_G S + epsilon) (without `by_std`: S_i - mean_G S);
    a group of one: mean 0, std 1."""
    size, total, std = _group_stats(scores, _group_ids(index, scores.device))
    single = size == 1
    adv = scores - torch.where(single, 0.0, total / size)
    return adv / (torch.where(single, 1.0, std) + epsilon) if by_std else adv


def gdpo_weighted_parts(reward_scores: Mapping[str, torch.Tensor], reward_weights: Mapping[str, float],
                        index: GroupIndex, epsilon: float = 1e-6, by_std: bool = True) -> dict[str, torch.Tensor]:
    """GDPO's w_k A_i^k per reward k (N,): each reward group-normalized, times its weight."""
    return {name: float(weight) * _group_normalize(reward_scores[name].to(torch.float64), index, epsilon, by_std)
            for name, weight in reward_weights.items()}


@register_adv_est(AdvantageEstimator.GDPO)
@torch.no_grad()
def compute_gdpo_outcome_advantage(
    reward_scores: Mapping[str, torch.Tensor],
    reward_weights: Mapping[str, float],
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO, group reward-decoupled normalization (NVIDIA, Liu et al. 2026), for several named rewards:

        A_i^k = (r_i^k - mean_G r^k) / (std_G r^k + epsilon)     each reward k within the group (GRPO's rule)
        S_i   = sum_k w_k A_i^k                                    the weighted sum of the normalized rewards
        A_i   = (S_i - mean_B S) / (std_B S + epsilon)             then over the whole batch B

    Normalizing each reward before the sum is the point: with the plain sum, a reward on a 100x larger scale
    decides every advantage and the small one is drowned; here each reward moves the advantage by its weight
    whatever its scale. `reward_scores` maps each name of `reward_weights` to the samples' scores (N,);
    `norm_adv_by_std_in_grpo=False` drops the per-group std (Dr.GRPO), the batch step stays. The token-level
    rewards (the `score` and any KL in it) are not read. returns = advantages.
    """
    parts = gdpo_weighted_parts(reward_scores, reward_weights, index, epsilon, norm_adv_by_std_in_grpo)
    total = torch.stack(list(parts.values())).sum(dim=0).to(torch.float32)
    std = total.std() if total.numel() > 1 else torch.ones_like(total.mean())
    adv = (total - total.mean()) / (std + epsilon)
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


# --------------------------------------------------------------------------------------------------
# Turn-level returns (multi-turn episodes, `algorithm.turn_rewards=turn_return`)
# --------------------------------------------------------------------------------------------------


def credit_turn_rewards(scores: torch.Tensor, turn_rewards: torch.Tensor | None, mode: str) -> torch.Tensor:
    """The token-level scores an estimator reads: the outcome `scores` alone with mode ``ignore`` (the very
    tensor: nothing changes), else plus the step/turn rewards, each already on its turn's last sampled token."""
    if mode == "ignore":
        return scores
    return scores + turn_rewards


@torch.no_grad()
def compute_turn_returns(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                         turn_gamma: float) -> torch.Tensor:
    """Return-to-go with one discount per *turn*: a turn is a run of valid (sampled) tokens, the masked
    tool / user tokens between runs separate turns. G_t = r_t + G_next within a turn, and
    G_t = r_t + turn_gamma * G_next at the last token of a turn; masked positions are skipped and get 0.
    With rewards only on turn ends, every token of turn k holds G_k = sum_{j >= k} turn_gamma^(j-k) R_j."""
    mask = response_mask.to(token_level_rewards.dtype)
    following = torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], dim=-1)
    turn_end = (mask > 0) & (following == 0)
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros_like(token_level_rewards[:, 0])
    for t in reversed(range(token_level_rewards.shape[1])):
        m = mask[:, t]
        discount = torch.where(turn_end[:, t], float(turn_gamma), 1.0)
        running = m * (token_level_rewards[:, t] + discount * running) + (1 - m) * running
        returns[:, t] = m * running
    return returns


@torch.no_grad()
def compute_grpo_turn_return_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    turn_gamma: float = 1.0,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO on turn-level returns: A_t = (G_t - mean_G G_0) / (std_G G_0 + epsilon), where G_t is the
    per-turn discounted return-to-go (`compute_turn_returns`) and G_0 the episode's return at its first
    sampled token; the group's statistics are those of the episodes' returns, as GRPO's are of their
    scores. A later turn is credited with what follows it only, so a turn reward trains the turns up to
    it. With a single reward at the episode's end and turn_gamma 1, this is GRPO exactly.
    returns = the turn-level returns G_t."""
    returns = compute_turn_returns(token_level_rewards, response_mask, turn_gamma)
    mask = response_mask.to(returns.dtype)
    rows = torch.arange(len(returns), device=returns.device)
    first = returns[rows, mask.argmax(dim=-1)]
    size, total, std = _group_stats(first, _group_ids(index, first.device))
    single = size == 1
    mean = torch.where(single, 0.0, total / size)
    std = torch.where(single, 1.0, std)
    advantages = returns - mean.unsqueeze(-1)
    if norm_adv_by_std_in_grpo:
        advantages = advantages / (std.unsqueeze(-1) + epsilon)
    return advantages * mask, returns
