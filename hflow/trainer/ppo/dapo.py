"""DAPO's batch and reward details (Yu et al. 2025, "DAPO: an open-source LLM RL system at scale").

Both are off by default and are plain functions the trainer calls:

* Dynamic sampling (`algorithm.filter_groups`): a prompt whose n samples all score the same gives
  GRPO a zero advantage everywhere, so its group only dilutes the batch. `informative_groups` keeps
  the groups whose metric varies; the trainer draws more prompts until the batch is full again and
  `take_groups` trims it to exactly `data.train_batch_size` prompts.
* Soft overlong punishment (`reward_model.overlong_buffer`): responses that run into the last `len`
  tokens before `data.max_response_length` lose up to `penalty_factor`, linearly in the overrun.

Scores are sequence-level: each sits on its sequence's last valid response token.
"""

from __future__ import annotations

import numpy as np
import torch

from hflow.protocol import DataProto
from hflow.trainer.ppo.reward_shaping import last_valid_index
from hflow.utils.errors import UserError

__all__ = [
    "apply_overlong_penalty",
    "check_dapo_config",
    "group_metric_values",
    "informative_groups",
    "overlong_buffer_len",
    "overlong_penalty",
    "take_groups",
]


def group_metric_values(metric: str, scores: torch.Tensor, extra_info: dict[str, list]) -> np.ndarray:
    """Per-sample values of `algorithm.filter_groups.metric`: `score` is the sequence score (token-level
    scores summed); any other name is a per-sample key the reward function returned (e.g. `acc`)."""
    if metric == "score":
        return scores.sum(-1).double().numpy()
    values = extra_info.get(metric)
    if values is None or len(values) != len(scores):
        raise UserError(
            f"algorithm.filter_groups.metric={metric!r}: the reward function returned no per-sample {metric!r} "
            f"(its extra keys: {sorted(extra_info)}); use metric=score or return {metric!r} in its result dict")
    return np.asarray(values, dtype=np.float64)


def informative_groups(uids: np.ndarray, values: np.ndarray) -> np.ndarray:
    """A boolean mask over samples: True where the sample's group (same uid) has values that are not all
    equal (std > 0), i.e. where GRPO's group-relative advantage is not zero for every sample."""
    keep = np.zeros(len(uids), dtype=bool)
    for uid in dict.fromkeys(uids):  # first-seen order; groups need not be contiguous
        members = uids == uid
        group = values[members]
        keep[members] = group.max() > group.min()
    return keep


def take_groups(batch: DataProto, num_groups: int) -> DataProto:
    """The samples of the first `num_groups` groups (by first appearance of their `uid`), in batch order."""
    uids = batch.non_tensor_batch["uid"]
    chosen = set(list(dict.fromkeys(uids))[:num_groups])
    return batch.select_idxs(np.array([uid in chosen for uid in uids], dtype=bool))


def overlong_buffer_len(buffer_len: int | None, max_response_length: int) -> int:
    """`reward_model.overlong_buffer.len`, or a fifth of `data.max_response_length` when null (DAPO's
    4096 of 20480)."""
    return int(max_response_length) // 5 if buffer_len is None else int(buffer_len)


def check_dapo_config(config) -> None:
    """Preflight of `algorithm.filter_groups` and `reward_model.overlong_buffer` (config only)."""
    from hflow.config_schema import ConfigError

    groups, overlong = config.algorithm.filter_groups, config.reward_model.overlong_buffer
    if groups.enable:
        n = int(config.actor_rollout_ref.rollout.n)
        if n < 2:
            raise ConfigError(f"algorithm.filter_groups.enable=true keeps the prompts whose samples differ, which "
                              f"needs actor_rollout_ref.rollout.n >= 2 (it is {n})")
        if int(config.trainer.async_steps):
            raise ConfigError("algorithm.filter_groups.enable=true draws more prompts within a step, which "
                              "trainer.async_steps=1 does not support; set trainer.async_steps=0 or "
                              "algorithm.filter_groups.enable=false")
        if int(groups.max_num_gen_batches) < 0:
            raise ConfigError(f"algorithm.filter_groups.max_num_gen_batches must be >= 0 (0 = no limit), "
                              f"got {groups.max_num_gen_batches}")
    if overlong.enable:
        max_len = int(config.data.max_response_length)
        buffer_len = overlong_buffer_len(overlong.len, max_len)
        if not 0 < buffer_len < max_len:
            raise ConfigError(f"reward_model.overlong_buffer.len must be > 0 and < data.max_response_length={max_len}, "
                              f"got {buffer_len}" + (" (null: a fifth of it)" if overlong.len is None else ""))


def overlong_penalty(response_lengths: torch.Tensor, max_response_length: int, buffer_len: int,
                     penalty_factor: float) -> torch.Tensor:
    """min(-(l - (L_max - len)) / len * penalty_factor, 0) per response of valid length l: 0 up to
    L_max - len tokens, then down linearly to -penalty_factor at L_max."""
    expected = max_response_length - buffer_len
    exceed = response_lengths.to(torch.float32) - expected
    return torch.clamp(-exceed / buffer_len * penalty_factor, max=0.0)


def apply_overlong_penalty(token_level_scores: torch.Tensor, response_mask: torch.Tensor, max_response_length: int,
                           buffer_len: int, penalty_factor: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Scores (a copy) with the overlong penalty added on each sequence's last valid token, and
    `reward/overlong_penalty_mean` (over all responses) and `response/overlong_frac` (penalised ones)."""
    penalty = overlong_penalty(response_mask.sum(-1), max_response_length, buffer_len, penalty_factor)
    out = token_level_scores.clone()
    rows = torch.arange(len(out), device=out.device)
    out[rows, last_valid_index(response_mask)] += penalty.to(out.dtype)
    metrics = {"reward/overlong_penalty_mean": penalty.mean().item() if len(penalty) else 0.0,
               "response/overlong_frac": (penalty < 0).float().mean().item() if len(penalty) else 0.0}
    return out, metrics
