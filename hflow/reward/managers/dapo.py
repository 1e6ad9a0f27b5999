"""DAPORewardManager: the naive manager plus DAPO's soft overlong punishment (Yu et al. 2025).

The overlong buffer lives here, in the reward manager, and nowhere else: a manager built with an
`OverlongBuffer` adds the penalty to each sequence's score on its last valid response token and reports
``reward/overlong_penalty_mean`` and ``response/overlong_frac`` in its ``reward_metrics``. Every manager
built on `NaiveRewardManager` (naive, batch, dapo, a user's subclass) accepts ``overlong_buffer=``.

Which managers get one is the loader's choice (`hflow.reward.managers.loader`): the training manager
gets the buffer when ``reward_model.overlong_buffer.enable`` is true, or when it is null (the default) and
``reward_model.reward_manager=dapo``; the validation manager never does (validation scores the task alone).
So ``reward_manager=dapo`` turns the buffer on, ``dapo`` with ``overlong_buffer.enable=false`` is naive, and
``naive`` with ``overlong_buffer.enable=true`` keeps the penalty it always had.

The length is the response as generated: the batch's ``generated_response_mask`` when the trainer shows the
manager a cut view (``algorithm.stop_token``), else the response the manager sees. With a stop token and
``algorithm.missing_stop_penalty``, a response without the stop token scores that penalty alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hflow.reward.managers.naive import GENERATED_RESPONSE_MASK, NaiveRewardManager
from hflow.reward.managers.registry import register
from hflow.utils.torch_functional import last_valid_index

__all__ = ["DAPORewardManager", "GENERATED_RESPONSE_MASK", "OverlongBuffer", "apply_overlong_penalty", "overlong_buffer_len",
           "overlong_penalty"]


def overlong_buffer_len(buffer_len: int | None, max_response_length: int) -> int:
    """`reward_model.overlong_buffer.len`, or a fifth of `data.max_response_length` when null (DAPO's
    4096 of 20480)."""
    return int(max_response_length) // 5 if buffer_len is None else int(buffer_len)


def overlong_penalty(response_lengths: torch.Tensor, max_response_length: int, buffer_len: int,
                     penalty_factor: float) -> torch.Tensor:
    """min(-(l - (L_max - len)) / len * penalty_factor, 0) per response of valid length l: 0 up to
    L_max - len tokens, then down linearly to -penalty_factor at L_max."""
    expected = max_response_length - buffer_len
    exceed = response_lengths.to(torch.float32) - expected
    return torch.clamp(-exceed / buffer_len * penalty_factor, max=0.0)


def apply_overlong_penalty(token_level_scores: torch.Tensor, response_mask: torch.Tensor, max_response_length: int,
                           buffer_len: int, penalty_factor: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Scores (a copy) with the overlong penalty added on each sequence's last valid token (position 0 for
    an empty response), and `reward/overlong_penalty_mean` (over all responses) and `response/overlong_frac`
    (penalised ones)."""
    penalty = overlong_penalty(response_mask.sum(-1), max_response_length, buffer_len, penalty_factor)
    out = token_level_scores.clone()
    last = last_valid_index(response_mask)
    out[torch.arange(len(out), device=out.device), last] += penalty.to(out.dtype)
    metrics = {"reward/overlong_penalty_mean": penalty.mean().item() if len(penalty) else 0.0,
               "response/overlong_frac": (penalty < 0).float().mean().item() if len(penalty) else 0.0}
    return out, metrics


@dataclass(frozen=True)
class OverlongBuffer:
    """`reward_model.overlong_buffer` resolved: responses longer than ``max_response_length - len`` lose up
    to `penalty_factor`, linearly in the overrun."""

    max_response_length: int
    len: int | None = None  # None: a fifth of max_response_length
    penalty_factor: float = 1.0

    def apply(self, scores: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        return apply_overlong_penalty(scores, response_mask, self.max_response_length,
                                      overlong_buffer_len(self.len, self.max_response_length), self.penalty_factor)


@register("dapo")
class DAPORewardManager(NaiveRewardManager):
    """`NaiveRewardManager` whose overlong buffer is required: ``max_response_length`` (and optionally
    ``overlong_buffer_len``, ``overlong_penalty_factor``) build it when ``overlong_buffer`` is not given.
    The loader passes ``overlong_buffer=None`` for validation, which this class accepts (the task alone)."""

    def __init__(self, tokenizer: Any, num_examine: int, *args: Any, max_response_length: int | None = None,
                 overlong_buffer_len: int | None = None, overlong_penalty_factor: float = 1.0,
                 **kwargs: Any) -> None:
        if "overlong_buffer" not in kwargs and max_response_length is not None:
            kwargs["overlong_buffer"] = OverlongBuffer(max_response_length, overlong_buffer_len,
                                                       overlong_penalty_factor)
        super().__init__(tokenizer, num_examine, *args, **kwargs)


def overlong_buffer_enabled(reward_model: Any) -> bool:
    """Whether training scores get the overlong penalty: ``reward_model.overlong_buffer.enable``, where null
    means on for ``reward_model.reward_manager=dapo`` and off otherwise."""
    enable = reward_model.overlong_buffer.enable
    return reward_model.reward_manager == "dapo" if enable is None else bool(enable)
