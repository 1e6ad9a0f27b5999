"""What every part of the GPU check shares: the Part record the report is written from, a torch.distributed
world of this one process with its 1-rank mesh (FSDP2 needs one), device synchronisation, the allocator's
memory statistics (None on CPU), and the actor's config at the schema's defaults."""

from __future__ import annotations

import gc
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
ENTRY = REPO / "bench" / "gpu_check.py"  # the script scripts/gpu_check.sh runs (and part a runs again)
GiB = 2**30


@dataclass
class Part:
    key: str
    title: str
    target: str
    status: str = "SKIPPED"  # PASS | FAIL | ERROR | SKIPPED
    result: str = ""
    details: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_MESH = None


def mesh():
    """A torch.distributed world of this one process (FSDP2 needs one) and its 1-rank mesh."""
    global _MESH
    if _MESH is None:
        import torch.distributed as dist

        from hflow.utils import device
        from hflow.workers.fsdp import build_device_mesh

        device.set_device()
        if not dist.is_initialized():
            dist.init_process_group(device.dist_backend(), init_method=f"tcp://127.0.0.1:{_free_port()}",
                                    rank=0, world_size=1)
        _MESH = build_device_mesh(1)
    return _MESH


def sync() -> None:
    from hflow.utils import device

    device.synchronize()


def cuda_memory() -> tuple[int, int] | None:
    """(allocated, peak allocated) bytes on the GPU; None on CPU."""
    import torch

    from hflow.utils import device

    if not device.is_cuda():
        return None
    return torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()


def reset_peak() -> None:
    import torch

    from hflow.utils import device

    gc.collect()
    if device.is_cuda():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def actor_config(**overrides):
    """The actor section at the schema's defaults as a worker of one rank normalises it (with the derived
    `ppo_mini_batch_size_per_rank`, in sequences), with `overrides`."""
    from omegaconf import OmegaConf

    from hflow.config_schema import default_section
    from hflow.workers.config import resolved_copy

    config = resolved_copy(default_section("actor_rollout_ref.actor"))
    for key, value in overrides.items():
        OmegaConf.update(config, key, value)
    return config


def gib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / GiB:.2f} GiB"

