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
import os
import pickle
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict
from torch.utils.data import DataLoader

from hflow.protocol.columns import (
    DataProtoConfig,
    DataProtoError,
    Index,
    leaf_items,
    merge_meta_info,
    same_keys,
    to_object_array,
    union_numpy_dict,
    union_tensor_dict,
    values_equal,
)
from hflow.protocol.wire import pack_batch, unpack_batch


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
        non_tensor_batch = {key: to_object_array(key, value) for key, value in (non_tensors or {}).items()}
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
            if key in self.meta_info and not values_equal(self.meta_info[key], value):
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
            same_keys("tensor", [list(part.batch.keys(include_nested=True, leaves_only=True)) for part in parts])
            batch = torch.cat([part.batch for part in parts], dim=0)
        non_tensors = {}
        if parts:
            same_keys("non-tensor", [list(part.non_tensor_batch) for part in parts])
            non_tensors = {
                key: np.concatenate([part.non_tensor_batch[key] for part in parts]) for key in parts[0].non_tensor_batch
            }
        meta_info = merge_meta_info([part.meta_info for part in data])
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
        tensors = leaf_items(self.batch) if self.batch is not None else []
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
        """The batch as one packed buffer (see `pack_batch`); non-tensors and meta_info as they are."""
        return {
            "batch": pack_batch(self.batch) if self.batch is not None else None,
            "non_tensor_batch": self.non_tensor_batch,
            "meta_info": self.meta_info,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.batch = unpack_batch(state["batch"]) if state["batch"] is not None else None
        self.non_tensor_batch = state["non_tensor_batch"]
        self.meta_info = state["meta_info"]
