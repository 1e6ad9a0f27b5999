"""Weights from the training pool to the standalone rollout engines (`trainer.placement=split`).

The two pools are separate torch.distributed worlds, so the stream runs over a process group of its
own that spans both: the training pool's rank 0 (group rank 0) and every rollout rank (group ranks
1..R). It is built from a TCP store at rank 0's address, not from `torch.distributed.new_group`
(which only splits the default world): gloo on CPU, NCCL on GPU, the device helper decides.

One update is a sequence of broadcasts from group rank 0, one per tensor of the `WeightManifest`,
in its order. On the training side every rank all-gathers each FSDP parameter (a collective of the
training world) and rank 0 broadcasts it; on the rollout side each rank receives into one buffer at a
time and hands it straight to vLLM's `reload_weights`. No rank ever holds more than one full tensor
beside its own weights, and nothing touches the disk.
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


@dataclass(frozen=True)
class WeightManifest:
    """What one update carries, in order: (HF name, full shape, dtype name) per tensor. Both sides
    know it before the first update, so the receivers can allocate each buffer."""

    entries: tuple[tuple[str, tuple[int, ...], str], ...]


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
        options = dist.BroadcastOptions()
        options.rootRank = SENDER
        self._group.broadcast([tensor], options).wait()


def manifest_of(named_shapes: Iterable[tuple[str, torch.Size, torch.dtype]], dtype: torch.dtype) -> WeightManifest:
    """Floating-point tensors travel in the rollout's `dtype` (half the bytes for a bf16 engine); other
    tensors keep theirs."""
    entries = []
    for name, shape, tensor_dtype in named_shapes:
        wire = dtype if tensor_dtype.is_floating_point else tensor_dtype
        entries.append((name, tuple(int(s) for s in shape), str(wire).removeprefix("torch.")))
    return WeightManifest(tuple(entries))


def send_weights(group: WeightGroup | None, manifest: WeightManifest,
                 named_tensors: Iterable[tuple[str, torch.Tensor]], version: int = 0) -> int:
    """Announce policy `version` and stream `named_tensors` (in the manifest's order) to the receivers;
    returns the bytes sent.

    Every training rank calls this with its gathering iterator; only rank 0 has a `group`: the others
    just take part in the gathers.
    """
    if group is not None:
        group.announce(version)
    sent = 0
    expected = iter(manifest.entries)
    for name, tensor in named_tensors:
        entry = next(expected, None)
        if entry is None or entry[0] != name or tuple(tensor.shape) != entry[1]:
            raise RuntimeError(f"weight stream out of step with its manifest at {name!r} {tuple(tensor.shape)} "
                               f"(manifest expects {entry})")
        if group is not None:
            wire = tensor.to(getattr(torch, entry[2])).contiguous()
            group.broadcast(wire)
            sent += wire.numel() * wire.element_size()
    if next(expected, None) is not None:
        raise RuntimeError("the model yielded fewer tensors than its weight manifest lists")
    return sent


def receive_weights(group: WeightGroup, manifest: WeightManifest) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for each tensor of an update, received when the consumer asks for it. A consumer
    that stops early must `drain` the rest (see `StreamedWeights`), or the sender waits forever."""
    target = device.get_device()
    for name, shape, dtype in manifest.entries:
        buffer = torch.empty(shape, dtype=getattr(torch, dtype), device=target)
        group.broadcast(buffer)
        yield name, buffer


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
