"""DAPO's batch and reward details (Yu et al. 2025, "DAPO: an open-source LLM RL system at scale").

Both are off by default:

* Dynamic sampling (`algorithm.filter_groups`): a prompt whose n samples all score the same gives
  GRPO a zero advantage everywhere, so its group only dilutes the batch. `informative_groups` keeps
  the groups whose metric varies; the trainer draws more prompts until the batch is full again and
  `take_groups` trims it to exactly `data.train_batch_size` prompts.
* Soft overlong punishment (`reward_model.overlong_buffer`): responses that run into the last `len`
  tokens before `data.max_response_length` lose up to `penalty_factor`, linearly in the overrun. The
  training reward manager applies it (`hflow.reward.managers.dapo`); this module checks its config.

Scores are sequence-level: each sits on its sequence's last valid response token.
"""

from __future__ import annotations

import numpy as np
import torch

from hflow.protocol import DataProto
from hflow.utils.errors import UserError
# The overlong buffer is applied by the reward manager (the one place); its formula is re-exported here.
from hflow.reward.managers.dapo import (
    apply_overlong_penalty,
    overlong_buffer_enabled,
    overlong_buffer_len,
    overlong_penalty,
)

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


def check_dapo_config(config) -> None:
    """Preflight of `algorithm.filter_groups` and `reward_model.overlong_buffer` (config only)."""
    from hflow.config_schema import ConfigError

    groups, overlong = config.algorithm.filter_groups, config.reward_model.overlong_buffer
    if groups.enable:
        n = int(config.actor_rollout_ref.rollout.n)
        if n < 2:
            raise ConfigError(f"algorithm.filter_groups.enable=true keeps the prompts whose samples differ, which "
                              f"needs actor_rollout_ref.rollout.n >= 2 (it is {n})")
        if int(groups.max_num_gen_batches) < 0:
            raise ConfigError(f"algorithm.filter_groups.max_num_gen_batches must be >= 0 (0 = no limit), "
                              f"got {groups.max_num_gen_batches}")
    if overlong_buffer_enabled(config.reward_model):
        max_len = int(config.data.max_response_length)
        buffer_len = overlong_buffer_len(overlong.len, max_len)
        if not 0 < buffer_len < max_len:
            raise ConfigError(f"reward_model.overlong_buffer.len must be > 0 and < data.max_response_length={max_len}, "
                              f"got {buffer_len}" + (" (null: a fifth of it)" if overlong.len is None else ""))
