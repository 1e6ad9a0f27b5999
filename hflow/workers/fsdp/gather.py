"""Full tensors out of FSDP2 shards, a bucket of parameters per collective and in the receiver's dtype.

A weight sync needs every full parameter once. Gathering each alone costs one all-gather per tensor (hundreds
for a 3B model), and gathering fp32 master shards moves twice the bytes a bf16 engine keeps. `gather_full`
casts each shard to the wire dtype on its own rank first (a cast commutes with a gather: the full tensor is
bitwise the gathered fp32 one cast afterwards), then packs consecutive shards of one mesh into one byte buffer
and all-gathers that once. FSDP2 shards dim 0 as `torch.chunk` does (ceil(rows / world) rows per rank, the
last ranks short or empty), so each rank pads its shard to that many rows; the full tensor is the ranks'
padded pieces in rank order, cut to its rows. Tensors that are not such a shard (replicated, other
placements, plain tensors) are gathered alone, in order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from hflow.utils import device

__all__ = ["GatherStats", "gather_full"]

ALIGN = 8  # byte offset of each shard in a bucket: any dtype's view of the buffer lines up


@dataclass
class GatherStats:
    """What a gathering pass moved: the bytes of the full tensors it assembled and its collectives."""

    bytes: int = 0
    collectives: int = 0


def gather_full(named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None,
                bucket_bytes: int | None = None, stats: GatherStats | None = None
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for each of `named`, in order. Floating-point tensors are cast to `dtype` (None:
    kept) before they are gathered; with `bucket_bytes`, dim-0 shards of one mesh are gathered together up to
    that many bytes of full tensors per collective (a larger tensor goes alone). Every rank must consume the
    iterator in the same order: each gather is a collective."""
    stats = stats if stats is not None else GatherStats()
    target = device.get_device()
    bucket: list[tuple[str, DTensor, torch.dtype]] = []
    filled = 0
    for name, tensor in named:
        wire = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        size = tensor.numel() * wire.itemsize
        if bucket and (not _packable(tensor, bucket_bytes) or filled + size > bucket_bytes
                       or tensor.device_mesh != bucket[0][1].device_mesh):
            yield from _gather_bucket(bucket, target, stats)
            bucket, filled = [], 0
        if _packable(tensor, bucket_bytes):
            bucket.append((name, tensor, wire))
            filled += size
            continue
        full = tensor.to(target)  # shards kept on the host (CPUOffloadPolicy) are gathered on the device
        full = full.to(wire)
        if isinstance(full, DTensor):
            full = full.full_tensor()
            stats.collectives += 1
        stats.bytes += full.numel() * full.element_size()
        yield name, full
    if bucket:
        yield from _gather_bucket(bucket, target, stats)


def _packable(tensor: torch.Tensor, bucket_bytes: int | None) -> bool:
    return (bucket_bytes is not None and isinstance(tensor, DTensor) and tensor.device_mesh.ndim == 1
            and tuple(tensor.placements) == (Shard(0),) and tensor.dim() >= 1)


def _gather_bucket(bucket: list[tuple[str, DTensor, torch.dtype]], target: torch.device,
                   stats: GatherStats) -> Iterator[tuple[str, torch.Tensor]]:
    mesh = bucket[0][1].device_mesh
    world = mesh.size()
    layout = []  # (name, full shape, wire dtype, rows per rank, byte offset, bytes per rank)
    offset = 0
    for name, tensor, wire in bucket:
        rows = -(-tensor.shape[0] // world)
        nbytes = rows * (tensor.numel() // max(tensor.shape[0], 1)) * wire.itemsize
        layout.append((name, tuple(tensor.shape), wire, rows, offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    send = torch.zeros(offset, dtype=torch.uint8, device=target)
    for (name, shape, wire, rows, start, nbytes), (_, tensor, _) in zip(layout, bucket):
        local = tensor.to_local()
        slot = send[start:start + nbytes].view(wire).view(rows, *shape[1:])
        slot[:local.shape[0]].copy_(local)  # the cast happens here, on this rank's shard
    if world > 1:
        received = torch.empty(world * offset, dtype=torch.uint8, device=target)
        dist.all_gather_into_tensor(received, send, group=mesh.get_group())
    else:
        received = send
    del send
    stats.collectives += 1
    by_rank = received.view(world, offset)
    for name, shape, wire, rows, start, nbytes in layout:
        pieces = by_rank[:, start:start + nbytes].view(wire)  # (world, rows * row elements)
        full = pieces.reshape(world * rows, *shape[1:])[:shape[0]]
        stats.bytes += full.numel() * full.element_size()
        yield name, full
