"""Row helpers around DataProto: pad to a divisor and unpad, fold and unfold a batch dim, collate rows,
and gather a batch across ranks."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hflow.protocol.columns import (
    DataProtoError,
    leaf_items,
    list_of_dict_to_dict_of_list,
    tensordict_from_leaves,
    to_object_array,
)
from hflow.protocol.data_proto import DataProto, DataProtoItem

if TYPE_CHECKING:
    import torch.distributed

def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """Pads ``data`` to a multiple of ``size_divisor`` rows by cycling rows from the start.

    3 rows to divisor 7 appends rows 0, 1, 2, 0. Returns ``(padded, pad_size)``; ``data`` is untouched.
    """
    if size_divisor <= 0:
        raise DataProtoError(f"pad_dataproto_to_divisor: size_divisor must be positive, got {size_divisor}")
    rows = len(data)
    if rows % size_divisor == 0:
        return data, 0
    pad_size = size_divisor - rows % size_divisor
    index = torch.cat([torch.arange(rows), torch.arange(pad_size) % rows])
    return data.select_idxs(index), pad_size


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """Drops the last ``pad_size`` rows added by `pad_dataproto_to_divisor`."""
    return data.slice(0, len(data) - pad_size) if pad_size else data


def fold_batch_dim(data: DataProto, new_batch_size: int) -> DataProto:
    """Reshapes rows ``[n, ...]`` into ``[new_batch_size, n // new_batch_size, ...]``."""
    rows = len(data)
    if new_batch_size <= 0 or rows % new_batch_size:
        raise DataProtoError(f"fold_batch_dim: {rows} rows cannot be folded into {new_batch_size} groups")
    inner = rows // new_batch_size
    batch = None
    if data.batch is not None:
        batch = data.batch.apply(
            lambda t: t.reshape(new_batch_size, inner, *t.shape[1:]), batch_size=[new_batch_size]
        )
    non_tensors = {k: v.reshape(new_batch_size, inner, *v.shape[1:]) for k, v in data.non_tensor_batch.items()}
    return type(data)(batch=batch, non_tensor_batch=non_tensors, meta_info=data.meta_info)


def unfold_batch_dim(data: DataProto, batch_dims: int = 2) -> DataProto:
    """Inverse of `fold_batch_dim`: flattens the first ``batch_dims`` dims into the row dim."""
    columns = [t for _, t in leaf_items(data.batch)] if data.batch is not None else []
    columns += list(data.non_tensor_batch.values())
    if not columns:
        return data
    rows = math.prod(columns[0].shape[:batch_dims])
    batch = None
    if data.batch is not None:
        batch = data.batch.apply(lambda t: t.reshape(rows, *t.shape[batch_dims:]), batch_size=[rows])
    non_tensors = {k: v.reshape(rows, *v.shape[batch_dims:]) for k, v in data.non_tensor_batch.items()}
    return type(data)(batch=batch, non_tensor_batch=non_tensors, meta_info=data.meta_info)


def collate_fn(x: list[DataProtoItem]) -> DataProto:
    """Stacks DataProtoItems (rows) back into a DataProto; meta_info comes from the first item."""
    if not x:
        raise DataProtoError("collate_fn: got no items; nothing to collate")
    has_batch = [item.batch is not None for item in x]
    if any(has_batch) and not all(has_batch):
        raise DataProtoError("collate_fn: some items have tensors and some do not; items must come from one batch")
    batch = torch.stack([item.batch for item in x]) if all(has_batch) else None
    non_tensors = list_of_dict_to_dict_of_list([item.non_tensor_batch for item in x])
    return DataProto(
        batch=batch,
        non_tensor_batch={k: to_object_array(k, v) for k, v in non_tensors.items()},
        meta_info=x[0].meta_info,
    )


def _collective_device(process_group: Any) -> torch.device:
    """gloo gathers CPU tensors; other backends (nccl, ...) gather on the current accelerator."""
    if torch.distributed.get_backend(process_group) == "gloo":
        return torch.device("cpu")
    return torch.accelerator.current_accelerator()


def all_gather_data_proto(data: DataProto, process_group: torch.distributed.ProcessGroup) -> None:
    """Replaces ``data`` (in place) with the concatenation of every rank's ``data``, in rank order.

    All ranks must hold the same keys and shapes.
    """
    import torch.distributed as dist

    world_size = dist.get_world_size(group=process_group)
    if data.batch is not None:
        device = _collective_device(process_group)
        gathered = {}
        # Same key order on every rank, whatever order the batches were built in.
        for key, local in sorted(leaf_items(data.batch), key=lambda item: str(item[0])):
            send = local.to(device).contiguous()
            parts = [torch.empty_like(send) for _ in range(world_size)]
            dist.all_gather(parts, send, group=process_group)
            gathered[key] = torch.cat(parts).to(local.device)
        data.batch = tensordict_from_leaves(gathered, [len(data) * world_size], data.batch.device)
    all_non_tensors: list[dict[str, np.ndarray]] = [{} for _ in range(world_size)]
    dist.all_gather_object(all_non_tensors, data.non_tensor_batch, group=process_group)
    data.non_tensor_batch = {
        key: np.concatenate([rank_data[key] for rank_data in all_non_tensors]) for key in data.non_tensor_batch
    }

