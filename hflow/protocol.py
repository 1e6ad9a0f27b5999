"""DataProto: the batch that flows between the single controller and the worker groups.

A DataProto holds three things that always travel together:

* ``batch``: a ``TensorDict`` of tensors sharing dim 0 (exactly one batch dimension);
* ``non_tensor_batch``: a dict of numpy object arrays, one entry per row (strings, dicts, lists ...);
* ``meta_info``: a dict of batch-level metadata (token ids, temperature, metrics ...).

Every row operation (index, chunk, concat, repeat, pad ...) is applied to tensors and non-tensors
alike so the two never fall out of step. Pickling (which Ray uses for every dispatch) packs all
tensors into one byte buffer so that Ray ships it out-of-band, without a copy per tensor.
"""

from __future__ import annotations

import copy
import math
import os
import pickle
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch
from tensordict import TensorDict
from torch.utils.data import DataLoader

if TYPE_CHECKING:
    import ray
    import torch.distributed

__all__ = [
    "DataProto",
    "DataProtoConfig",
    "DataProtoError",
    "DataProtoFuture",
    "DataProtoItem",
    "all_gather_data_proto",
    "collate_fn",
    "fold_batch_dim",
    "list_of_dict_to_dict_of_list",
    "pad_dataproto_to_divisor",
    "unfold_batch_dim",
    "union_numpy_dict",
    "union_tensor_dict",
    "unpad_dataproto",
]

# Tensors start at multiples of this many bytes inside the pickled buffer, so every view is aligned.
_BUFFER_ALIGNMENT = 64

Index = Sequence[int] | Sequence[bool] | np.ndarray | torch.Tensor


class DataProtoError(ValueError, AssertionError):
    """Inconsistent DataProto contents.

    Subclasses both ValueError and AssertionError: code ported from verl (which asserts) and code
    expecting a ValueError both catch it.
    """


class _DataProtoConfigMeta(type):
    """Gives DataProtoConfig a class-level ``auto_padding`` property that also reads the environment."""

    @property
    def auto_padding(cls) -> bool:
        from_env = os.getenv("HFLOW_AUTO_PADDING", "").strip().lower() in ("1", "true")
        return cls._auto_padding or from_env

    @auto_padding.setter
    def auto_padding(cls, enabled: bool) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"DataProtoConfig.auto_padding must be a bool, got {type(enabled).__name__}")
        cls._auto_padding = enabled


class DataProtoConfig(metaclass=_DataProtoConfigMeta):
    """Global switches. ``DataProtoConfig.auto_padding = True`` (or env ``HFLOW_AUTO_PADDING=1``) lets
    uneven batches be padded for dispatch instead of rejected."""

    _auto_padding: bool = False
    # meta_info key that enables auto padding for one DataProto only.
    auto_padding_key: str = "_hflow_auto_padding"


# --------------------------------------------------------------------------------------------------
# Module-level helpers
# --------------------------------------------------------------------------------------------------


def _to_object_array(key: str, values: Any) -> np.ndarray:
    """Per-row values as a numpy object array.

    Lists are filled element by element: ``np.array(list_of_equal_length_lists, dtype=object)``
    would build a 2-D array and lose the per-row lists.
    """
    if isinstance(values, np.ndarray):
        return values.astype(object)
    if isinstance(values, (list, tuple)):
        array = np.empty(len(values), dtype=object)
        for i, value in enumerate(values):
            array[i] = value
        return array
    raise DataProtoError(
        f"non-tensor {key!r} is a {type(values).__name__}; pass a list or numpy array with one entry per row"
    )


def _leaf_items(batch: TensorDict) -> list[tuple[str | tuple[str, ...], torch.Tensor]]:
    """All tensors of a TensorDict, nested ones under tuple keys, in insertion order."""
    return [(key, batch.get(key)) for key in batch.keys(include_nested=True, leaves_only=True)]


def _tensordict_from_leaves(leaves: dict, batch_size: Sequence[int], device: Any = None) -> TensorDict:
    """Inverse of `_leaf_items`: rebuilds nesting from tuple keys."""
    batch = TensorDict({}, batch_size=batch_size, device=device)
    for key, tensor in leaves.items():
        batch.set(key, tensor)
    return batch


def _values_equal(a: Any, b: Any) -> bool:
    """Equality for meta_info values, which may be tensors or arrays (whose ``==`` is elementwise)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(a, b)
    return bool(a == b)


def _numpy_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Array equality judged by pandas, so NaN equals NaN and object arrays compare element by element."""
    if a.shape != b.shape:
        return False
    if a.ndim > 2:
        a, b = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
    return pd.DataFrame(a, dtype=object).equals(pd.DataFrame(b, dtype=object))


def union_tensor_dict(tensor_dict1: TensorDict, tensor_dict2: TensorDict) -> TensorDict:
    """Adds the tensors of ``tensor_dict2`` to ``tensor_dict1`` (in place) and returns it.

    A key present in both must hold equal tensors; nothing is changed when any key conflicts.
    """
    if tensor_dict1.batch_size != tensor_dict2.batch_size:
        raise DataProtoError(
            f"union: batch sizes differ: {list(tensor_dict1.batch_size)} vs {list(tensor_dict2.batch_size)}; "
            "only batches with the same rows can be united"
        )
    incoming = _leaf_items(tensor_dict2)
    existing = set(tensor_dict1.keys(include_nested=True, leaves_only=True))
    for key, tensor in incoming:
        if key in existing:
            mine = tensor_dict1.get(key)
            if mine.shape != tensor.shape or not torch.equal(mine, tensor):
                raise DataProtoError(
                    f"union: tensor {key!r} differs between the two batches (shapes {tuple(mine.shape)} and "
                    f"{tuple(tensor.shape)}); rename or pop one of them before the union"
                )
    for key, tensor in incoming:
        tensor_dict1.set(key, tensor)
    return tensor_dict1


def union_numpy_dict(tensor_dict1: dict[str, np.ndarray], tensor_dict2: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Adds the arrays of ``tensor_dict2`` to ``tensor_dict1`` (in place) and returns it.

    A key present in both must hold equal arrays (NaN counts as equal to NaN); nothing is changed when
    any key conflicts.
    """
    for key, array in tensor_dict2.items():
        if key in tensor_dict1 and not _numpy_equal(tensor_dict1[key], array):
            raise DataProtoError(
                f"union: non-tensor {key!r} differs between the two batches (shapes {tensor_dict1[key].shape} "
                f"and {array.shape}); rename or pop one of them before the union"
            )
    tensor_dict1.update(tensor_dict2)
    return tensor_dict1


def list_of_dict_to_dict_of_list(list_of_dict: list[dict]) -> dict[Any, list]:
    """``[{"a": 1}, {"a": 2, "b": 3}]`` -> ``{"a": [1, 2], "b": [3]}``."""
    output: dict[Any, list] = {}
    for item in list_of_dict:
        for key, value in item.items():
            output.setdefault(key, []).append(value)
    return output


def _merge_metrics(per_part: list[tuple[int, Any]]) -> dict[str, list]:
    """Per-rank metrics (dicts, or lists of dicts; values scalars or lists) -> one dict of flat lists."""
    merged: dict[str, list] = {}
    for part, metrics in per_part:
        for entry in metrics if isinstance(metrics, list) else [metrics]:
            if not isinstance(entry, dict):
                raise DataProtoError(
                    f"DataProto.concat: meta_info['metrics'] of part {part} holds a {type(entry).__name__}; "
                    "metrics must be a dict (or a list of dicts) of metric name -> value(s)"
                )
            for name, value in entry.items():
                if isinstance(value, list):
                    merged.setdefault(name, []).extend(value)
                else:
                    merged.setdefault(name, []).append(value)
    return merged


def _merge_meta_info(metas: list[dict]) -> dict:
    """Union of meta_info dicts: ``"metrics"`` are merged across parts, every other key must agree."""
    merged: dict = {}
    first_seen: dict[str, int] = {}
    metrics: list[tuple[int, Any]] = []
    for part, meta in enumerate(metas):
        for key, value in meta.items():
            if key == "metrics":
                metrics.append((part, value))
            elif key not in merged:
                merged[key], first_seen[key] = value, part
            elif not _values_equal(merged[key], value):
                raise DataProtoError(
                    f"DataProto.concat: Conflicting values for meta_info key {key!r}: {merged[key]!r} in part "
                    f"{first_seen[key]} vs {value!r} in part {part}; all parts must agree on meta_info except "
                    "'metrics' (pop the key before concat if it is per-part)"
                )
    if metrics:
        merged["metrics"] = _merge_metrics(metrics)
    return merged


def _same_keys(kind: str, key_lists: list[list]) -> None:
    """Raises unless every part of a concat has the same keys."""
    for part, keys in enumerate(key_lists):
        if set(keys) != set(key_lists[0]):
            raise DataProtoError(
                f"DataProto.concat: part {part} has {kind} keys {sorted(map(str, keys))} but part 0 has "
                f"{sorted(map(str, key_lists[0]))}; all parts must carry the same keys"
            )


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
    columns = [t for _, t in _leaf_items(data.batch)] if data.batch is not None else []
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
        non_tensor_batch={k: _to_object_array(k, v) for k, v in non_tensors.items()},
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
        for key, local in sorted(_leaf_items(data.batch), key=lambda item: str(item[0])):
            send = local.to(device).contiguous()
            parts = [torch.empty_like(send) for _ in range(world_size)]
            dist.all_gather(parts, send, group=process_group)
            gathered[key] = torch.cat(parts).to(local.device)
        data.batch = _tensordict_from_leaves(gathered, [len(data) * world_size], data.batch.device)
    all_non_tensors: list[dict[str, np.ndarray]] = [{} for _ in range(world_size)]
    dist.all_gather_object(all_non_tensors, data.non_tensor_batch, group=process_group)
    data.non_tensor_batch = {
        key: np.concatenate([rank_data[key] for rank_data in all_non_tensors]) for key in data.non_tensor_batch
    }


# --------------------------------------------------------------------------------------------------
# Serialisation: all tensors of a batch in one byte buffer
# --------------------------------------------------------------------------------------------------


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _BUFFER_ALIGNMENT) * _BUFFER_ALIGNMENT


def _tensor_view(buffer: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], offset: int) -> torch.Tensor:
    """The tensor stored at ``offset`` of a uint8 buffer, as a view (no copy)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:  # an empty byte slice cannot be viewed as a wider dtype
        return torch.empty(shape, dtype=dtype)
    return buffer[offset : offset + nbytes].view(dtype).view(shape)


def _pack_batch(batch: TensorDict) -> dict[str, Any]:
    """Copies every tensor once into a single uint8 buffer, handed to pickle as a numpy array.

    Pickle protocol 5 (used by Ray) then ships that one buffer out-of-band; a uint8 buffer keeps
    dtypes numpy lacks (bfloat16).
    """
    leaves = _leaf_items(batch)
    fields = []
    end = 0
    for key, tensor in leaves:
        fields.append((key, tensor.dtype, tuple(tensor.shape), end))
        end = _aligned(end + tensor.nbytes)
    buffer = torch.empty(end, dtype=torch.uint8)
    with torch.no_grad():
        for (_, tensor), (_, dtype, shape, offset) in zip(leaves, fields):
            _tensor_view(buffer, dtype, shape, offset).copy_(tensor)
            # Zero the alignment gap so that equal batches pickle to equal bytes.
            buffer[offset + tensor.nbytes : _aligned(offset + tensor.nbytes)].zero_()
    return {
        "buffer": buffer.numpy(),
        "fields": fields,
        "batch_size": tuple(batch.batch_size),
        "had_device": batch.device is not None,
    }


def _unpack_batch(packed: dict[str, Any]) -> TensorDict:
    """Rebuilds the TensorDict as views into one buffer (on CPU).

    A read-only buffer (Ray's shared-memory view) is copied once, so the tensors are writable.
    """
    array = packed["buffer"]
    if not array.flags.writeable:
        array = array.copy()
    buffer = torch.from_numpy(array)
    leaves = {key: _tensor_view(buffer, dtype, shape, offset) for key, dtype, shape, offset in packed["fields"]}
    return _tensordict_from_leaves(leaves, packed["batch_size"], "cpu" if packed["had_device"] else None)


# --------------------------------------------------------------------------------------------------
# DataProto
# --------------------------------------------------------------------------------------------------


@dataclass
class DataProtoItem:
    """One row of a DataProto (what integer indexing returns)."""

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, Any] = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)


def _as_index(idxs: Index, rows: int) -> torch.Tensor:
    """Row indices or a boolean mask as a 1-D CPU tensor (int64 or bool)."""
    if isinstance(idxs, torch.Tensor):
        index = idxs.detach().cpu()
    else:
        array = np.asarray(idxs)
        index = torch.tensor(array if array.size else array.astype(np.int64))
    if index.ndim != 1:
        raise IndexError(f"DataProto: row index must be 1-D, got shape {tuple(index.shape)}")
    if index.dtype == torch.bool:
        if index.numel() != rows:
            raise IndexError(f"DataProto: boolean mask has {index.numel()} entries but the batch has {rows} rows")
        return index
    if index.is_floating_point() or index.is_complex():
        raise TypeError(f"DataProto: row indices must be integers or booleans, got {index.dtype}")
    return index.long()


@dataclass
class DataProto:
    """A batch of rows: tensors in ``batch``, per-row Python objects in ``non_tensor_batch``, and
    batch-level ``meta_info``. See the module docstring."""

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.non_tensor_batch is None:
            self.non_tensor_batch = {}
        if self.meta_info is None:
            self.meta_info = {}
        self.check_consistency()

    # ---- construction ----------------------------------------------------------------------------

    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, Any] | None = None,
        meta_info: dict | None = None,
        num_batch_dims: int = 1,
        auto_padding: bool = False,
    ) -> DataProto:
        """Builds a DataProto from a dict of tensors (sharing dim 0) and a dict of per-row values."""
        if num_batch_dims != 1:
            raise DataProtoError(
                f"DataProto.from_dict: num_batch_dims={num_batch_dims}, but a DataProto has exactly one batch "
                "dimension; reshape (or use fold_batch_dim) instead"
            )
        tensors = tensors or {}
        pivot_key, pivot_rows = None, None
        for key, tensor in tensors.items():
            if not isinstance(tensor, torch.Tensor):
                raise DataProtoError(
                    f"DataProto.from_dict: tensor {key!r} is a {type(tensor).__name__}; put per-row Python "
                    "values in non_tensors"
                )
            if tensor.ndim == 0:
                raise DataProtoError(f"DataProto.from_dict: tensor {key!r} is 0-d; tensors need a batch dim 0")
            if pivot_key is None:
                pivot_key, pivot_rows = key, tensor.shape[0]
            elif tensor.shape[0] != pivot_rows:
                raise DataProtoError(
                    f"DataProto.from_dict: tensor {key!r} has batch size {tensor.shape[0]} but {pivot_key!r} has "
                    f"{pivot_rows}; all tensors must share dim 0"
                )
        batch = TensorDict(tensors, batch_size=[pivot_rows]) if tensors else None
        non_tensor_batch = {key: _to_object_array(key, value) for key, value in (non_tensors or {}).items()}
        meta_info = dict(meta_info or {})
        if auto_padding:
            meta_info[DataProtoConfig.auto_padding_key] = True
        return cls(batch=batch, non_tensor_batch=non_tensor_batch, meta_info=meta_info)

    @classmethod
    def from_single_dict(
        cls, data: dict[str, torch.Tensor | np.ndarray], meta_info: dict | None = None, auto_padding: bool = False
    ) -> DataProto:
        """Like `from_dict`, sorting one flat dict into tensors and numpy arrays."""
        tensors, non_tensors = {}, {}
        for key, value in data.items():
            if isinstance(value, torch.Tensor):
                tensors[key] = value
            elif isinstance(value, np.ndarray):
                non_tensors[key] = value
            else:
                raise DataProtoError(
                    f"DataProto.from_single_dict: {key!r} is a {type(value).__name__}; values must be "
                    "torch.Tensor or np.ndarray"
                )
        return cls.from_dict(tensors, non_tensors, meta_info, auto_padding=auto_padding)

    def check_consistency(self) -> None:
        """Raises DataProtoError unless every tensor and non-tensor has one entry per row."""
        if self.batch is not None:
            if not isinstance(self.batch, TensorDict):
                raise DataProtoError(
                    f"DataProto.batch is a {type(self.batch).__name__}; it must be a TensorDict or None "
                    "(use DataProto.from_dict for a dict of tensors)"
                )
            if len(self.batch.batch_size) != 1:
                raise DataProtoError(
                    f"DataProto.batch has batch_size {list(self.batch.batch_size)}; exactly one batch dimension "
                    "is allowed"
                )
        pivot = ("the batch", self.batch.batch_size[0]) if self.batch is not None else None
        for key, value in self.non_tensor_batch.items():
            if not isinstance(value, np.ndarray):
                raise DataProtoError(
                    f"DataProto: non-tensor {key!r} is a {type(value).__name__}; non-tensor values must be numpy "
                    "arrays (DataProto.from_dict converts lists for you)"
                )
            if value.ndim == 0:
                raise DataProtoError(f"DataProto: non-tensor {key!r} is a 0-d array; it needs one entry per row")
            if pivot is None:
                pivot = (repr(key), value.shape[0])
            elif value.shape[0] != pivot[1]:
                raise DataProtoError(
                    f"DataProto: non-tensor {key!r} has {value.shape[0]} rows but {pivot[0]} has {pivot[1]}; "
                    "every non-tensor array needs one entry per row"
                )

    # ---- size and indexing -----------------------------------------------------------------------

    def __len__(self) -> int:
        if self.batch is not None:
            return self.batch.batch_size[0]
        if self.non_tensor_batch:
            return next(iter(self.non_tensor_batch.values())).shape[0]
        return 0

    def _has_columns(self) -> bool:
        """Whether any tensor or non-tensor is present (a meta-only DataProto has none)."""
        return self.batch is not None or bool(self.non_tensor_batch)

    def __getitem__(self, item: int | np.integer | slice | Index) -> DataProtoItem | DataProto:
        if isinstance(item, slice):
            return self.slice(item.start, item.stop, item.step)
        if isinstance(item, (list, np.ndarray, torch.Tensor)):
            return self.select_idxs(item)
        if isinstance(item, (int, np.integer)):
            return DataProtoItem(
                batch=self.batch[item] if self.batch is not None else None,
                non_tensor_batch={key: value[item] for key, value in self.non_tensor_batch.items()},
                meta_info=self.meta_info,
            )
        raise TypeError(f"DataProto indices must be int, slice, list, np.ndarray or torch.Tensor, not {type(item)}")

    def slice(self, start: int | None = None, end: int | None = None, step: int | None = None) -> DataProto:
        """Rows ``start:end:step`` as views; meta_info is shared."""
        rows = slice(start, end, step)
        return type(self)(
            batch=self.batch[rows] if self.batch is not None else None,
            non_tensor_batch={key: value[rows] for key, value in self.non_tensor_batch.items()},
            meta_info=self.meta_info,
        )

    def select_idxs(self, idxs: Index) -> DataProto:
        """Rows picked by integer indices or a boolean mask (list, numpy array or tensor); a copy."""
        index = _as_index(idxs, len(self))
        batch = None
        if self.batch is not None:
            batch = self.batch[index.to(self.batch.device) if self.batch.device is not None else index]
        numpy_index = index.numpy()
        return type(self)(
            batch=batch,
            non_tensor_batch={key: value[numpy_index] for key, value in self.non_tensor_batch.items()},
            meta_info=self.meta_info,
        )

    # ---- keys ------------------------------------------------------------------------------------

    def _require_keys(
        self, operation: str, batch_keys: list | None, non_tensor_batch_keys: list | None, meta_info_keys: list | None
    ) -> None:
        """KeyError naming the first requested key that is missing."""
        available = {
            "tensor": list(self.batch.keys()) if self.batch is not None else [],
            "non-tensor": list(self.non_tensor_batch),
            "meta_info": list(self.meta_info),
        }
        requested = {"tensor": batch_keys, "non-tensor": non_tensor_batch_keys, "meta_info": meta_info_keys}
        for kind, keys in requested.items():
            for key in keys or []:
                if key not in available[kind]:
                    raise KeyError(
                        f"DataProto.{operation}: {kind} key {key!r} not found; available: {available[kind]}"
                    )

    def select(
        self,
        batch_keys: list[str] | None = None,
        non_tensor_batch_keys: list[str] | None = None,
        meta_info_keys: list[str] | None = None,
        deepcopy: bool = False,
    ) -> DataProto:
        """A DataProto with only the given keys (None keeps all). Tensors are shared, not copied;
        ``deepcopy`` copies the non-tensors and meta_info."""
        self._require_keys("select", batch_keys, non_tensor_batch_keys, meta_info_keys)
        batch = self.batch
        if batch is not None:
            batch = batch.select(*batch_keys) if batch_keys is not None else batch.copy()
        non_tensors = {
            k: v
            for k, v in self.non_tensor_batch.items()
            if non_tensor_batch_keys is None or k in non_tensor_batch_keys
        }
        meta_info = {k: v for k, v in self.meta_info.items() if meta_info_keys is None or k in meta_info_keys}
        if deepcopy:
            non_tensors, meta_info = copy.deepcopy(non_tensors), copy.deepcopy(meta_info)
        return type(self)(batch=batch, non_tensor_batch=non_tensors, meta_info=meta_info)

    def pop(
        self,
        batch_keys: list[str] | None = None,
        non_tensor_batch_keys: list[str] | None = None,
        meta_info_keys: list[str] | None = None,
    ) -> DataProto:
        """Removes the given keys from self and returns them as a new DataProto."""
        self._require_keys("pop", batch_keys, non_tensor_batch_keys, meta_info_keys)
        batch = None
        if batch_keys:
            popped = {key: self.batch.pop(key) for key in batch_keys}
            batch = TensorDict(popped, batch_size=self.batch.batch_size, device=self.batch.device)
        non_tensors = {key: self.non_tensor_batch.pop(key) for key in non_tensor_batch_keys or []}
        meta_info = {key: self.meta_info.pop(key) for key in meta_info_keys or []}
        return type(self)(batch=batch, non_tensor_batch=non_tensors, meta_info=meta_info)

    def rename(self, old_keys: str | list[str] | None = None, new_keys: str | list[str] | None = None) -> DataProto:
        """Renames tensor keys in place; returns self."""
        old = [old_keys] if isinstance(old_keys, str) else list(old_keys or [])
        new = [new_keys] if isinstance(new_keys, str) else list(new_keys or [])
        if len(old) != len(new):
            raise DataProtoError(f"DataProto.rename: {len(old)} old keys but {len(new)} new keys; give one per key")
        self._require_keys("rename", old, None, None)
        for old_key, new_key in zip(old, new):
            self.batch.rename_key_(old_key, new_key)
        return self

    # ---- combining -------------------------------------------------------------------------------

    def union(self, other: DataProto) -> DataProto:
        """Adds other's keys to self (in place) and returns self.

        Keys present in both must hold equal values; on any conflict self is left unchanged.
        """
        if self._has_columns() and other._has_columns() and len(self) != len(other):
            raise DataProtoError(
                f"DataProto.union: batch sizes differ: {len(self)} vs {len(other)}; only batches with the same "
                "rows can be united"
            )
        for key, value in other.meta_info.items():
            if key in self.meta_info and not _values_equal(self.meta_info[key], value):
                raise DataProtoError(
                    f"DataProto.union: meta_info {key!r} differs: {self.meta_info[key]!r} vs {value!r}; pop it from "
                    "one side before the union"
                )
        batch = self.batch
        if batch is None:
            batch = other.batch.copy() if other.batch is not None else None
        elif other.batch is not None:
            batch = union_tensor_dict(self.batch.copy(), other.batch)
        self.non_tensor_batch = union_numpy_dict(dict(self.non_tensor_batch), other.non_tensor_batch)
        self.batch = batch
        self.meta_info = {**self.meta_info, **other.meta_info}
        return self

    def chunk(self, chunks: int) -> list[DataProto]:
        """Splits the rows into ``chunks`` equal consecutive pieces (views).

        Rows must divide evenly unless padding is enabled, in which case pieces follow torch.chunk
        (all of size ceil(n / chunks) but the last, possibly fewer pieces).
        """
        if chunks <= 0:
            raise DataProtoError(f"DataProto.chunk: chunks must be positive, got {chunks}")
        rows = len(self)
        if rows % chunks and not self.is_padding_enabled():
            raise DataProtoError(
                f"DataProto.chunk: {rows} rows cannot be split into {chunks} equal chunks; pad first "
                "(pad_dataproto_to_divisor) or enable auto padding"
            )
        if rows == 0:
            return [self.slice(0, 0) for _ in range(chunks)]
        size = -(-rows // chunks)
        return [self.slice(start, start + size) for start in range(0, rows, size)]

    def split(self, split_size: int) -> list[DataProto]:
        """Consecutive pieces of ``split_size`` rows (views); the last may be smaller."""
        if split_size <= 0:
            raise DataProtoError(f"DataProto.split: split_size must be positive, got {split_size}")
        return [self.slice(start, start + split_size) for start in range(0, len(self), split_size)]

    @staticmethod
    def concat(data: list[DataProto]) -> DataProto:
        """Concatenates rows of several DataProtos (e.g. one per rank).

        meta_info is merged: ``"metrics"`` from all parts become one dict of lists, other keys must
        agree. Parts with no columns at all (meta-only) contribute only their meta_info.
        """
        if not data:
            raise DataProtoError("DataProto.concat: got an empty list; nothing to concatenate")
        parts = [part for part in data if part._has_columns()]
        batch = None
        with_batch = [part.batch is not None for part in parts]
        if any(with_batch):
            if not all(with_batch):
                raise DataProtoError(
                    f"DataProto.concat: part {with_batch.index(False)} has no tensors but part "
                    f"{with_batch.index(True)} does; all parts must carry the same keys"
                )
            _same_keys("tensor", [list(part.batch.keys(include_nested=True, leaves_only=True)) for part in parts])
            batch = torch.cat([part.batch for part in parts], dim=0)
        non_tensors = {}
        if parts:
            _same_keys("non-tensor", [list(part.non_tensor_batch) for part in parts])
            non_tensors = {
                key: np.concatenate([part.non_tensor_batch[key] for part in parts]) for key in parts[0].non_tensor_batch
            }
        meta_info = _merge_meta_info([part.meta_info for part in data])
        return type(data[0])(batch=batch, non_tensor_batch=non_tensors, meta_info=meta_info)

    # ---- row order and repetition ----------------------------------------------------------------

    def reorder(self, indices: Index) -> None:
        """Permutes the rows in place: row i becomes old row ``indices[i]``."""
        reordered = self.select_idxs(indices)
        self.batch, self.non_tensor_batch = reordered.batch, reordered.non_tensor_batch

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Each row ``repeat_times`` times: interleaved ``[a,a,b,b]`` or tiled ``[a,b,a,b]``."""
        rows = torch.arange(len(self))
        return self.select_idxs(rows.repeat_interleave(repeat_times) if interleave else rows.repeat(repeat_times))

    def sample_level_repeat(self, repeat_times: Sequence[int] | np.ndarray | torch.Tensor) -> DataProto:
        """Row i repeated ``repeat_times[i]`` times, consecutively."""
        counts = torch.as_tensor(np.asarray(repeat_times), dtype=torch.long)
        if counts.shape != (len(self),):
            raise DataProtoError(
                f"DataProto.sample_level_repeat: got {tuple(counts.shape)} repeat counts for {len(self)} rows; "
                "give one count per row"
            )
        return self.select_idxs(torch.arange(len(self)).repeat_interleave(counts))

    def is_padding_enabled(self) -> bool:
        """Per-object flag (``from_dict(auto_padding=True)``) or the global DataProtoConfig switch."""
        return bool(self.meta_info.get(DataProtoConfig.auto_padding_key, False)) or DataProtoConfig.auto_padding

    def padding(self, padding_size: int, padding_candidate: str = "") -> None:
        """Appends ``padding_size`` copies of the last row (first row if ``padding_candidate="first"``), in place."""
        if padding_candidate not in ("", "last", "first"):
            raise DataProtoError(
                f"DataProto.padding: padding_candidate must be 'first' or 'last', got {padding_candidate!r}"
            )
        if padding_size == 0:
            return
        rows = len(self)
        if rows == 0:
            raise DataProtoError("DataProto.padding: cannot pad an empty DataProto; there is no row to repeat")
        row = 0 if padding_candidate == "first" else rows - 1
        padded = self.select_idxs(torch.cat([torch.arange(rows), torch.full((padding_size,), row)]))
        self.batch, self.non_tensor_batch = padded.batch, padded.non_tensor_batch

    # ---- devices, iteration, inspection ----------------------------------------------------------

    def to(self, device: str | torch.device) -> DataProto:
        """Moves the tensors in place; returns self."""
        if self.batch is not None:
            self.batch = self.batch.to(device)
        return self

    def make_iterator(
        self, mini_batch_size: int, epochs: int, seed: int | None = None, dataloader_kwargs: dict | None = None
    ) -> Iterator[DataProto]:
        """Yields mini-batches for ``epochs`` passes; each carries self.meta_info.

        ``dataloader_kwargs`` go to a torch DataLoader over row indices (e.g. ``{"shuffle": True}``);
        with a ``seed`` the order is reproducible.
        """
        rows = len(self)
        if mini_batch_size <= 0 or rows % mini_batch_size:
            raise DataProtoError(
                f"DataProto.make_iterator: {rows} rows are not divisible by mini_batch_size={mini_batch_size}"
            )
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        loader = DataLoader(range(rows), batch_size=mini_batch_size, generator=generator, **(dataloader_kwargs or {}))

        def mini_batches() -> Iterator[DataProto]:
            for _ in range(epochs):
                for index in loader:
                    mini_batch = self.select_idxs(index)
                    mini_batch.meta_info = self.meta_info
                    yield mini_batch

        return mini_batches()

    def print_size(self, prefix: str = "") -> None:
        """Prints the memory held by tensors and by numpy arrays (object arrays: pointers only)."""
        tensors = _leaf_items(self.batch) if self.batch is not None else []
        tensor_bytes = sum(t.numel() * t.element_size() for _, t in tensors)
        numpy_bytes = sum(value.nbytes for value in self.non_tensor_batch.values())
        print(f"{prefix}batch: {tensor_bytes / 2**30:.3f} GiB, non_tensor_batch: {numpy_bytes / 2**30:.3f} GiB")

    # ---- persistence -----------------------------------------------------------------------------

    def save_to_disk(self, filepath: str | os.PathLike) -> None:
        with open(filepath, "wb") as f:
            pickle.dump(self, f, protocol=pickle.HIGHEST_PROTOCOL)

    @staticmethod
    def load_from_disk(filepath: str | os.PathLike) -> DataProto:
        with open(filepath, "rb") as f:
            return pickle.load(f)

    def __getstate__(self) -> dict[str, Any]:
        """The batch as one packed buffer (see `_pack_batch`); non-tensors and meta_info as they are."""
        return {
            "batch": _pack_batch(self.batch) if self.batch is not None else None,
            "non_tensor_batch": self.non_tensor_batch,
            "meta_info": self.meta_info,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.batch = _unpack_batch(state["batch"]) if state["batch"] is not None else None
        self.non_tensor_batch = state["non_tensor_batch"]
        self.meta_info = state["meta_info"]


# --------------------------------------------------------------------------------------------------
# DataProtoFuture
# --------------------------------------------------------------------------------------------------


def _take_chunk(
    data: DataProto, chunks: int, index: int, previous: Callable[[DataProto], DataProto] | None
) -> DataProto:
    """Chunk ``index`` of ``data`` (after an earlier dispatch_fn, if any)."""
    if previous is not None:
        data = previous(data)
    return data.chunk(chunks)[index]


@dataclass
class DataProtoFuture:
    """The not-yet-collected output of a non-blocking worker-group call.

    Meant to be passed straight into another worker group's method, which resolves it on the
    workers: ``get()`` fetches all refs, collects them and applies ``dispatch_fn`` (e.g. take one chunk).
    """

    collect_fn: Callable[[list[DataProto]], DataProto]
    futures: list[ray.ObjectRef]
    dispatch_fn: Callable[[DataProto], DataProto] | None = None

    @staticmethod
    def concat(data: list[ray.ObjectRef]) -> DataProtoFuture:
        return DataProtoFuture(collect_fn=DataProto.concat, futures=data)

    def chunk(self, chunks: int) -> list[DataProtoFuture]:
        """``chunks`` futures over the same refs; future i resolves to chunk i of the collected data."""
        return [
            DataProtoFuture(
                collect_fn=self.collect_fn,
                futures=self.futures,
                dispatch_fn=partial(_take_chunk, chunks=chunks, index=i, previous=self.dispatch_fn),
            )
            for i in range(chunks)
        ]

    def get(self) -> DataProto:
        import ray

        outputs = ray.get(self.futures)
        for rank, output in enumerate(outputs):
            if not isinstance(output, DataProto):
                raise TypeError(
                    f"DataProtoFuture.get: ref {rank} resolved to a {type(output).__name__}, not a DataProto"
                )
        output = self.collect_fn(outputs)
        if self.dispatch_fn is not None:
            output = self.dispatch_fn(output)
        return output
