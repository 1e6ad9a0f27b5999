"""`Worker`: the base class of every SPMD worker (one process per device).

A worker knows its place in its group from environment variables that the worker group sets before
the worker is built -- the torchrun names, so torch.distributed and vLLM read the same values:

| variable            | meaning                                                                    |
|---------------------|----------------------------------------------------------------------------|
| `RANK`, `WORLD_SIZE`| this process's rank in the group, and the group's size                     |
| `LOCAL_RANK`        | index of this process's device among the devices *it can see*: 0 when the  |
|                     | backend gives each process one device (Ray bundles, the local backend)     |
| `LOCAL_WORLD_SIZE`  | processes of the group on this node                                        |
| `NODE_LOCAL_RANK`   | this process's position among them (0 .. LOCAL_WORLD_SIZE - 1)            |
| `MASTER_ADDR/PORT`  | the rendezvous: rank 0's node address and a free port there                |

`LOCAL_RANK` is a device index, not a position on the node, because that is how every consumer uses
it: `torch.cuda.set_device(LOCAL_RANK)` and vLLM's `assert local_rank < device_count()`. With one GPU
per Ray actor, a node-position `LOCAL_RANK` of 1..7 would point past the only visible device.

The worker does not rendezvous in its constructor: the group builds every worker, asks rank 0 for an
address (`pick_rendezvous_address`) and hands it to all ranks (`set_rendezvous`) before any method that
needs collectives (`init_model`) runs. `init_distributed()` then joins the default process group.
"""

from __future__ import annotations

import os
import socket
import sys
from contextlib import closing

from hflow.single_controller.base.decorator import Dispatch, Execute, register
from hflow.utils.logging_utils import install_library_filter


def get_free_port() -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def node_ip_address() -> str:
    """This node's address as other nodes reach it: Ray's view when this process runs under Ray, else
    loopback (a single-process group)."""
    ray = sys.modules.get("ray")  # never import Ray here: the local backend runs without it
    if ray is not None and ray.is_initialized():
        return ray.util.get_node_ip_address()
    return "127.0.0.1"


class Worker:
    """Base class of SPMD workers; subclasses add `@register`-ed methods."""

    def __init__(self):
        install_library_filter()  # the worker's process prints the user's run, not library noise
        env = os.environ
        self._rank = int(env.get("RANK", "0"))
        self._world_size = int(env.get("WORLD_SIZE", "1"))
        self._local_rank = int(env.get("LOCAL_RANK", "0"))
        self._local_world_size = int(env.get("LOCAL_WORLD_SIZE", "1"))

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def local_rank(self) -> int:
        """Index of this process's device among the visible ones (see the module docstring)."""
        return self._local_rank

    @property
    def local_world_size(self) -> int:
        return self._local_world_size

    # ------------------------------------------------------------------ rendezvous (called by the group)

    def pick_rendezvous_address(self) -> tuple[str, str]:
        """This node's address and a free port on it; the group asks rank 0 and hands the answer to all."""
        return node_ip_address(), str(get_free_port())

    def set_rendezvous(self, master_addr: str, master_port: str) -> None:
        """Where rank 0 listens. Process-wide, so colocated roles of this process see it too."""
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = str(master_addr), str(master_port)

    def get_master_addr_port(self) -> tuple[str | None, str | None]:
        return os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")

    def init_distributed(self, timeout_s: float = 600.0) -> None:
        """Join this group's default torch.distributed process group (idempotent).

        The device helper picks the backend (gloo on CPU; NCCL for device tensors plus gloo for host
        tensors on GPU). Colocated roles in one process share the group.
        """
        import datetime

        import torch.distributed as dist

        from hflow.utils import device

        if dist.is_initialized():
            return
        addr, port = self.get_master_addr_port()
        if addr is None or port is None:
            if self._world_size > 1:
                raise RuntimeError(
                    f"rank {self._rank}: MASTER_ADDR/MASTER_PORT are not set; build workers through a worker "
                    "group (it hands rank 0's address to every rank) or set them in the environment"
                )
            addr, port = "127.0.0.1", str(get_free_port())  # a stand-alone worker meets itself
            self.set_rendezvous(addr, port)
        device.set_device()
        dist.init_process_group(
            backend=device.dist_backend(),
            init_method=f"tcp://{addr}:{port}",
            rank=self._rank,
            world_size=self._world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )

    def close(self) -> None:
        """Release what this worker built that outlives it otherwise (an inference engine and its process
        groups) while its process group still exists. The local backend calls it on shutdown; a Ray
        worker's process simply ends."""

    # Plain (unregistered) helpers, callable through worker_group.execute_all_sync(name, ...).
    def seed_everything(self, seed: int) -> None:
        """Seed this process's Python, NumPy and torch RNGs (model init, mini-batch shuffling)."""
        import random

        import numpy as np
        import torch

        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)  # the CUDA generators too

    def get_pid(self) -> int:
        return os.getpid()

    def getenv(self, key: str) -> str | None:
        return os.environ.get(key)

    def path_exists(self, path: str) -> bool:
        """Whether this worker's node sees `path` (the trainer checks that checkpoint folders are shared)."""
        return os.path.exists(path)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    def execute_with_func_generator(self, func, *args, **kwargs):
        """Run a driver-supplied function on every rank with that rank's chunk of the data."""
        return func(self, *args, **kwargs)

    @register(dispatch_mode=Dispatch.ALL_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def execute_func_rank_zero(self, func, *args, **kwargs):
        """Run a driver-supplied function once, on rank 0."""
        return func(*args, **kwargs)
