"""The parts of a DataProto's columns that every other protocol module builds on: its error, its
global switches, and the helpers that convert, compare and merge tensors, non-tensors and meta_info."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch
from tensordict import TensorDict

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

def to_object_array(key: str, values: Any) -> np.ndarray:
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


def leaf_items(batch: TensorDict) -> list[tuple[str | tuple[str, ...], torch.Tensor]]:
    """All tensors of a TensorDict, nested ones under tuple keys, in insertion order."""
    return [(key, batch.get(key)) for key in batch.keys(include_nested=True, leaves_only=True)]


def tensordict_from_leaves(leaves: dict, batch_size: Sequence[int], device: Any = None) -> TensorDict:
    """Inverse of `leaf_items`: rebuilds nesting from tuple keys."""
    batch = TensorDict({}, batch_size=batch_size, device=device)
    for key, tensor in leaves.items():
        batch.set(key, tensor)
    return batch


def values_equal(a: Any, b: Any) -> bool:
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
    incoming = leaf_items(tensor_dict2)
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


def merge_meta_info(metas: list[dict]) -> dict:
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
            elif not values_equal(merged[key], value):
                raise DataProtoError(
                    f"DataProto.concat: Conflicting values for meta_info key {key!r}: {merged[key]!r} in part "
                    f"{first_seen[key]} vs {value!r} in part {part}; all parts must agree on meta_info except "
                    "'metrics' (pop the key before concat if it is per-part)"
                )
    if metrics:
        merged["metrics"] = _merge_metrics(metrics)
    return merged


def same_keys(kind: str, key_lists: list[list]) -> None:
    """Raises unless every part of a concat has the same keys."""
    for part, keys in enumerate(key_lists):
        if set(keys) != set(key_lists[0]):
            raise DataProtoError(
                f"DataProto.concat: part {part} has {kind} keys {sorted(map(str, keys))} but part 0 has "
                f"{sorted(map(str, key_lists[0]))}; all parts must carry the same keys"
            )
