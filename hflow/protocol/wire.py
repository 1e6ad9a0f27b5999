"""DataProto's wire format: every tensor of a batch packed into one byte buffer, so that pickle
protocol 5 (Ray) ships the batch out-of-band in one piece instead of one copy per tensor."""

from __future__ import annotations

import math
from typing import Any

import torch
from tensordict import TensorDict

from hflow.protocol.columns import leaf_items, tensordict_from_leaves

# Tensors start at multiples of this many bytes inside the pickled buffer, so every view is aligned.
_BUFFER_ALIGNMENT = 64


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _BUFFER_ALIGNMENT) * _BUFFER_ALIGNMENT


def _tensor_view(buffer: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], offset: int) -> torch.Tensor:
    """The tensor stored at ``offset`` of a uint8 buffer, as a view (no copy)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:  # an empty byte slice cannot be viewed as a wider dtype
        return torch.empty(shape, dtype=dtype)
    return buffer[offset : offset + nbytes].view(dtype).view(shape)


def pack_batch(batch: TensorDict) -> dict[str, Any]:
    """Copies every tensor once into a single uint8 buffer, handed to pickle as a numpy array.

    Pickle protocol 5 (used by Ray) then ships that one buffer out-of-band; a uint8 buffer keeps
    dtypes numpy lacks (bfloat16).
    """
    leaves = leaf_items(batch)
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


def unpack_batch(packed: dict[str, Any]) -> TensorDict:
    """Rebuilds the TensorDict as views into one buffer (on CPU).

    A read-only buffer (Ray's shared-memory view) is copied once, so the tensors are writable.
    """
    array = packed["buffer"]
    if not array.flags.writeable:
        array = array.copy()
    buffer = torch.from_numpy(array)
    leaves = {key: _tensor_view(buffer, dtype, shape, offset) for key, dtype, shape, offset in packed["fields"]}
    return tensordict_from_leaves(leaves, packed["batch_size"], "cpu" if packed["had_device"] else None)


