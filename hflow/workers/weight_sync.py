"""Weights from the training pool to the standalone rollout engines (`trainer.placement=split`).

The two pools are separate torch.distributed worlds, so the stream runs over a process group of its
own that spans both: the training pool's rank 0 (group rank 0) and every rollout rank (group ranks
1..R). It is built from a TCP store at rank 0's address, not from `torch.distributed.new_group`
(which only splits the default world): gloo on CPU, NCCL on GPU, the device helper decides.

One update is a sequence of broadcasts from group rank 0, one per bucket of the `WeightManifest`, in
its order. A bucket packs consecutive tensors, as raw bytes, into one buffer of at most
`actor_rollout_ref.rollout.weight_bucket_mb` (a tensor larger than that goes alone, as itself; null: by
device, GPU-sized on CUDA), so a model of many small tensors costs a few collectives instead of one per
tensor. Both sides derive the same buckets from the manifest. On the training side every rank all-gathers
the FSDP shards, cast to the engines' dtype, a bucket of them per collective (`hflow.workers.fsdp.gather`),
and rank 0 copies each full tensor into the bucket, broadcasting it when the next tensor would not fit;
on the rollout side each rank receives one bucket at a time and hands its tensors (views into it) straight
to vLLM's `reload_weights`. Broadcasts overlap the work beside them: the sender gathers and packs bucket
k + 1 while bucket k is on the wire, and a receiver has bucket k + 1 arriving while its engine loads
bucket k, so each side holds at most two buckets (and the gathered tensors of one) beside its own
weights, and nothing touches the disk.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hflow.utils import device

__all__ = ["StagedWeights", "WeightGroup", "WeightManifest", "receive_weights", "send_weights"]

# Group rank of the sender (the training pool's rank 0).
SENDER = 0


# Offsets of the tensors in a bucket are multiples of this, so that each slice of the byte buffer can be
# viewed as its own dtype (8 bytes: the widest element of a weight).
ALIGN = 8


@dataclass(frozen=True)
class WeightManifest:
    """What one update carries, in order: (HF name, full shape, dtype name) per tensor, and the bucket size
    in bytes (None: one tensor per broadcast). Both sides know it before the first update, so the receivers
    can allocate each buffer."""

    entries: tuple[tuple[str, tuple[int, ...], str], ...]
    bucket_bytes: int | None = None

    def float_dtype(self) -> torch.dtype | None:
        """The dtype floating-point tensors travel in (the engines'), None when none does."""
        return next((getattr(torch, d) for _, _, d in self.entries if getattr(torch, d).is_floating_point), None)

    def buckets(self) -> list[list[tuple[int, int]]]:
        """The broadcasts of one update: per bucket, (entry index, byte offset) of each tensor in it, in the
        manifest's order. Greedy: a bucket takes the next tensors while they fit; a tensor larger than a
        bucket is a bucket of its own; a bucket of one tensor is broadcast as that tensor."""
        buckets: list[list[tuple[int, int]]] = []
        current: list[tuple[int, int]] = []
        used = 0
        for index, (_, shape, dtype) in enumerate(self.entries):
            size = entry_bytes(shape, dtype)
            start = -(-used // ALIGN) * ALIGN
            if self.bucket_bytes is None or not current or start + size > self.bucket_bytes:
                if current:
                    buckets.append(current)
                current, used, start = [], 0, 0
            current.append((index, start))
            used = start + size
        if current:
            buckets.append(current)
        return buckets


def entry_bytes(shape: tuple[int, ...], dtype: str) -> int:
    numel = 1
    for dim in shape:
        numel *= int(dim)
    return numel * getattr(torch, dtype).itemsize


def bucket_size(bucket: list[tuple[int, int]], manifest: WeightManifest) -> int:
    """The bytes of a packed bucket's buffer: up to the end of its last tensor."""
    index, offset = bucket[-1]
    _, shape, dtype = manifest.entries[index]
    return offset + entry_bytes(shape, dtype)


class WeightGroup:
    """A process group over the sender and the rollout ranks; `rank` 0 is the sender."""

    def __init__(self, master_addr: str, master_port: int | str, rank: int, world_size: int,
                 timeout_s: float = 600.0):
        if world_size < 2:
            raise ValueError(f"a weight group needs the sender and at least one receiver, got world_size={world_size}")
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(str(master_addr), int(master_port), world_size, is_master=rank == SENDER,
                              timeout=timeout)
        store = dist.PrefixStore("hflow_weight_sync", store)
        if device.is_cuda():
            from torch.distributed.distributed_c10d import ProcessGroupNCCL

            options = ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._group = ProcessGroupNCCL(store, rank, world_size, options)
        else:
            self._group = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        self._store = store
        self.rank, self.world_size = rank, world_size

    # An update is announced in the group's store before its broadcasts start, so a receiver that is
    # busy generating can see one waiting (a cheap store read) and take it between two engine steps.
    # The sender announces the next update only after every receiver took the last one.

    def announce(self, version: int) -> None:
        """Sender: the next broadcasts carry the policy `version`."""
        self._store.set("version", str(int(version)))
        self._store.add("updates", 1)

    def updates_announced(self) -> int:
        """How many updates the sender has announced so far (it never waits)."""
        return int(self._store.add("updates", 0))

    def announced_version(self) -> int:
        """The version of the latest announced update (call after `updates_announced` counted one)."""
        return int(self._store.get("version"))

    def broadcast(self, tensor: torch.Tensor) -> None:
        """`tensor` from the sender into every other member's `tensor`, in place."""
        self.start_broadcast(tensor).wait()

    def start_broadcast(self, tensor: torch.Tensor) -> dist.Work:
        """`broadcast`, started: `.wait()` on the result before `tensor` is read (receiver) or reused (sender)."""
        options = dist.BroadcastOptions()
        options.rootRank = SENDER
        return self._group.broadcast([tensor], options)


def manifest_of(named_shapes: Iterable[tuple[str, torch.Size, torch.dtype]], dtype: torch.dtype,
                bucket_mb: float | None = None) -> WeightManifest:
    """Floating-point tensors travel in the rollout's `dtype` (half the bytes for a bf16 engine); other
    tensors keep theirs. `bucket_mb`: the bucket size in MiB (None: one tensor per broadcast)."""
    entries = []
    for name, shape, tensor_dtype in named_shapes:
        wire = dtype if tensor_dtype.is_floating_point else tensor_dtype
        entries.append((name, tuple(int(s) for s in shape), str(wire).removeprefix("torch.")))
    if bucket_mb is not None and not float(bucket_mb) > 0:
        raise ValueError(f"a weight bucket must be > 0 MiB (or None: one tensor per broadcast), got {bucket_mb}")
    return WeightManifest(tuple(entries), None if bucket_mb is None else int(float(bucket_mb) * 2**20))


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 tensor (no copy)."""
    return tensor.reshape(-1).view(torch.uint8)


def send_weights(group: WeightGroup | None, manifest: WeightManifest,
                 named_tensors: Iterable[tuple[str, torch.Tensor]], version: int = 0) -> tuple[int, int]:
    """Announce policy `version` and stream `named_tensors` (in the manifest's order) to the receivers,
    bucket by bucket; returns (bytes sent, broadcasts).

    Every training rank calls this with its gathering iterator; only rank 0 has a `group`: the others
    just take part in the gathers.
    """
    if group is not None:
        group.announce(version)
    sent = broadcasts = 0
    tensors = iter(named_tensors)
    in_flight: list[tuple[dist.Work, torch.Tensor]] = []  # on the wire while the next bucket is gathered, packed
    for bucket in manifest.buckets():
        packed = None
        for index, offset in bucket:
            name, shape, dtype = manifest.entries[index]
            item = next(tensors, None)
            if item is None:
                raise RuntimeError("the model yielded fewer tensors than its weight manifest lists")
            if item[0] != name or tuple(item[1].shape) != shape:
                raise RuntimeError(f"weight stream out of step with its manifest at {item[0]!r} "
                                   f"{tuple(item[1].shape)} (manifest expects {manifest.entries[index]})")
            if group is None:
                continue
            wire = item[1].to(getattr(torch, dtype)).contiguous()
            if len(bucket) == 1:  # alone: the tensor itself, no copy
                packed = wire
                break
            if packed is None:
                packed = torch.empty(bucket_size(bucket, manifest), dtype=torch.uint8, device=wire.device)
            chunk = as_bytes(wire)
            packed[offset:offset + chunk.numel()].copy_(chunk)
        if group is not None:
            in_flight.append((group.start_broadcast(packed), packed))  # the buffer kept until its work is done
            if len(in_flight) > 1:
                in_flight.pop(0)[0].wait()
            sent += packed.numel() * packed.element_size()
            broadcasts += 1
    for work, _ in in_flight:
        work.wait()
    if next(tensors, None) is not None:
        raise RuntimeError("the model yielded more tensors than its weight manifest lists")
    return sent, broadcasts


def receive_weights(group: WeightGroup, manifest: WeightManifest) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for each tensor of an update, received a bucket at a time when the consumer asks for
    the bucket's first tensor; the tensors of a bucket are views into its buffer. A consumer that stops
    early must `drain` the rest (see `StreamedWeights`), or the sender waits forever."""
    target = device.get_device()

    def start(bucket: list[tuple[int, int]]) -> tuple[dist.Work, torch.Tensor]:
        if len(bucket) == 1:
            _, shape, dtype = manifest.entries[bucket[0][0]]
            buffer = torch.empty(shape, dtype=getattr(torch, dtype), device=target)
        else:
            buffer = torch.empty(bucket_size(bucket, manifest), dtype=torch.uint8, device=target)
        return group.start_broadcast(buffer), buffer

    buckets = manifest.buckets()
    coming = start(buckets[0]) if buckets else None
    for i, bucket in enumerate(buckets):
        work, packed = coming
        work.wait()
        # the next bucket arrives while the consumer loads this one
        coming = start(buckets[i + 1]) if i + 1 < len(buckets) else None
        if len(bucket) == 1:
            yield manifest.entries[bucket[0][0]][0], packed
            continue
        for index, offset in bucket:
            name, shape, dtype = manifest.entries[index]
            size = entry_bytes(shape, dtype)
            yield name, packed[offset:offset + size].view(getattr(torch, dtype)).view(shape)


class StreamedWeights:
    """An update being received: iterate it once (vLLM's loader does), then `drain()` whatever the
    loader left, so the group's broadcasts stay in step with the sender's."""

    def __init__(self, group: WeightGroup, manifest: WeightManifest):
        self._stream = receive_weights(group, manifest)
        self.received = 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for item in self._stream:
            self.received += 1
            yield item

    def drain(self) -> int:
        """Receive and drop the tensors the consumer did not ask for; returns how many there were."""
        left = 0
        for _ in self._stream:
            left += 1
        self.received += left
        return left


class StagedWeights:
    """An update received while the engine was generating and kept, in host memory, until the next
    generation starts (`actor_rollout_ref.rollout.partial_rollout=false`): taking it at once lets the
    sender go back to training instead of waiting for the longest response in flight."""

    def __init__(self, group: WeightGroup, manifest: WeightManifest, version: int):
        self.version = int(version)
        # each buffer is fresh, so on CPU it is kept as received; a device buffer is copied out and freed
        self.tensors = [(name, tensor.cpu()) for name, tensor in receive_weights(group, manifest)]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        target = device.get_device()
        for name, tensor in self.tensors:
            yield name, tensor.to(target)
