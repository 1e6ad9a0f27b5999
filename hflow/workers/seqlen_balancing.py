"""Cutting a batch into mini-batches (one optimizer step each) and micro-batches (one forward each).

A micro-batch is the unit of one forward (and backward) pass. With a token budget
(`use_dynamic_bsz`), sequences are grouped so that each micro-batch holds at most `max_token_len`
valid tokens and the groups carry nearly equal token counts; rows are reordered to get there, so
every function that cuts by budget also returns the original row index of each row it emits:

    micro_batches, indices = rearrange_micro_batches(batch, max_token_len=4096)
    outputs = torch.cat([forward(mb) for mb in micro_batches])
    outputs = outputs[get_reverse_idx([i for idx in indices for i in idx])]   # original order

Under FSDP every rank must run the same number of forward passes (each one gathers parameters
collectively), so when torch.distributed is initialised the number of micro-batches is agreed over
`dp_group`: the largest any rank needs.
"""

from __future__ import annotations

from collections.abc import Iterator

import heapq
import math
from collections.abc import Sequence
from typing import TypeVar

import torch
import torch.distributed as dist
from tensordict import TensorDict

from hflow.protocol import DataProto

__all__ = [
    "balanced_partitions",
    "get_reverse_idx",
    "rearrange_micro_batches",
    "split_micro_batches",
    "split_mini_batches",
]

Batch = TypeVar("Batch", TensorDict, DataProto)


def balanced_partitions(seqlens: Sequence[int], k_partitions: int) -> list[list[int]]:
    """Split item indices into exactly `k_partitions` non-empty groups with near-equal length sums.

    Longest-processing-time greedy: take items from longest to shortest and give each to the group
    with the smallest sum so far (ties: the one with fewer items, so no group stays empty). Its
    largest sum is at most 4/3 of the optimum. Groups list indices in ascending order and are ordered
    by their first index, which keeps the result deterministic.
    """
    if not 1 <= k_partitions <= len(seqlens):
        raise ValueError(f"cannot split {len(seqlens)} sequences into {k_partitions} non-empty micro-batches")
    heap = [(0, 0, p) for p in range(k_partitions)]  # (token sum, item count, partition id)
    groups: list[list[int]] = [[] for _ in range(k_partitions)]
    for i in sorted(range(len(seqlens)), key=lambda j: (-seqlens[j], j)):
        total, count, p = heapq.heappop(heap)
        groups[p].append(i)
        heapq.heappush(heap, (total + seqlens[i], count + 1, p))
    return sorted((sorted(g) for g in groups), key=lambda g: g[0])


def _fits(seqlens: Sequence[int], groups: list[list[int]], max_token_len: int) -> bool:
    return all(sum(seqlens[i] for i in g) <= max_token_len for g in groups)


def _all_reduce_int(value: int, op: dist.ReduceOp, group: dist.ProcessGroup | None, device: torch.device) -> int:
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=op, group=group)
    return int(tensor.item())


def rearrange_micro_batches(
    batch: Batch,
    max_token_len: int,
    dp_group: dist.ProcessGroup | None = None,
    same_micro_num_in_dp: bool = True,
) -> tuple[list[Batch], list[list[int]]]:
    """Micro-batches of at most `max_token_len` valid tokens each (`attention_mask.sum(-1)`), balanced.

    Returns the micro-batches (a `TensorDict` or `DataProto`, like `batch`) and, for each, the
    original row indices of its rows. Uses the fewest micro-batches the greedy balancing can fit;
    with `same_micro_num_in_dp` and torch.distributed initialised, the count is the maximum over
    `dp_group` (default: the world). A single sequence longer than the budget is an error.
    """
    tensors = batch.batch if isinstance(batch, DataProto) else batch
    mask = tensors["attention_mask"]
    seqlens = mask.sum(dim=-1).tolist()
    longest = max(seqlens, default=0)
    if longest > max_token_len:
        raise ValueError(
            f"a sequence has {longest} tokens, more than the micro-batch token budget max_token_len="
            f"{max_token_len}; raise ppo_max_token_len_per_gpu (or the log_prob/forward budget) to at "
            f"least the longest prompt + response"
        )
    sync = same_micro_num_in_dp and dist.is_available() and dist.is_initialized()
    k = max(1, math.ceil(sum(seqlens) / max_token_len))
    while True:
        if sync:
            k = _all_reduce_int(k, dist.ReduceOp.MAX, dp_group, mask.device)
        groups = balanced_partitions(seqlens, min(k, len(seqlens)))
        fits = _fits(seqlens, groups, max_token_len)
        if sync:
            fits = bool(_all_reduce_int(int(fits), dist.ReduceOp.MIN, dp_group, mask.device))
        if fits:
            break
        k += 1
    if len(groups) < k:
        raise ValueError(
            f"the data-parallel group needs {k} micro-batches but this rank holds only {len(seqlens)} "
            "sequences; give every rank the same number of sequences"
        )
    if isinstance(batch, DataProto):
        micro_batches = [batch.select_idxs(g) for g in groups]
    else:
        micro_batches = [batch[torch.tensor(g, device=mask.device)] for g in groups]
    return micro_batches, groups


def get_reverse_idx(idx_map: Sequence[int]) -> torch.Tensor:
    """The inverse permutation: `concatenated[get_reverse_idx(order)]` puts rows emitted in `order`
    (row j of the concatenation is original row `order[j]`) back into their original positions."""
    order = torch.as_tensor(list(idx_map), dtype=torch.long)
    reverse = torch.empty_like(order)
    reverse[order] = torch.arange(len(order))
    return reverse


def split_micro_batches(
    batch: TensorDict,
    micro_batch_size: int | None = None,
    max_token_len: int | None = None,
    use_dynamic_bsz: bool = False,
    dp_group: dist.ProcessGroup | None = None,
) -> tuple[list[TensorDict], torch.Tensor | None]:
    """The micro-batches of one pass, and the reverse index that restores the original row order of
    their concatenated outputs (None when the rows were not reordered).

    By token budget `max_token_len` when `use_dynamic_bsz`, else consecutive groups of
    `micro_batch_size` rows.
    """
    if use_dynamic_bsz:
        if max_token_len is None:
            raise ValueError("use_dynamic_bsz needs a token budget (max_token_len), got None")
        micro_batches, groups = rearrange_micro_batches(batch, max_token_len, dp_group=dp_group)
        return micro_batches, get_reverse_idx([i for g in groups for i in g])
    if not micro_batch_size or micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size must be a positive number of sequences, got {micro_batch_size!r}")
    return list(batch.split(micro_batch_size)), None


def split_mini_batches(
    batch: TensorDict, mini_batch_size: int, shuffle: bool = False, generator: torch.Generator | None = None
) -> list[TensorDict]:
    """Mini-batches of `mini_batch_size` rows (the last may be smaller), in order or, with `shuffle`,
    in a random order drawn from `generator` (default: the global torch RNG, which checkpoints save and
    restore, so a resumed run shuffles exactly as an uninterrupted one)."""
    if mini_batch_size <= 0:
        raise ValueError(f"mini_batch_size must be a positive number of sequences, got {mini_batch_size}")
    rows = batch.batch_size[0]
    order = torch.randperm(rows, generator=generator) if shuffle else torch.arange(rows)
    if batch.device is not None:
        order = order.to(batch.device)
    return [batch[index] for index in order.split(mini_batch_size)]


def ppo_mini_batches(batch: TensorDict, config) -> Iterator[TensorDict]:
    """The mini-batches of one PPO update, one optimizer step each: `config.ppo_epochs` passes over
    `batch`, each cut into `config.ppo_mini_batch_size_per_rank` rows (the worker derives it from the
    global `ppo_mini_batch_size`; shuffled when `config.shuffle`)."""
    for _ in range(config.ppo_epochs):
        yield from split_mini_batches(batch, config.ppo_mini_batch_size_per_rank, shuffle=config.shuffle)


def ppo_micro_batches(mini_batch: TensorDict, config) -> list[TensorDict]:
    """A mini-batch cut into forward/backward micro-batches: `ppo_micro_batch_size_per_gpu` rows each,
    or token budgets of `ppo_max_token_len_per_gpu` with `use_dynamic_bsz`."""
    micro_batches, _ = split_micro_batches(
        mini_batch,
        micro_batch_size=config.ppo_micro_batch_size_per_gpu,
        max_token_len=config.ppo_max_token_len_per_gpu,
        use_dynamic_bsz=config.use_dynamic_bsz,
    )
    return micro_batches
