"""`Worker`: the base class of every SPMD worker (one process per device).

A worker knows its place in its group -- rank, world size, local rank, and the rendezvous address
(`MASTER_ADDR`/`MASTER_PORT`) that rank 0 publishes for the others -- from environment variables the
worker group sets. It does not start torch.distributed itself: the worker that needs collectives calls
`init_distributed()` (NCCL on GPU, gloo on CPU) when it builds its model.

Rendezvous: rank 0 picks its node address and a free port *before* its `__init__` runs (in `__new__`,
so a slow or collective-using `__init__` cannot delay it) and publishes them under the group's name in
Ray's key-value store. The other ranks, started at the same time, read them there (waiting until rank 0
has published), and so does the driver.
"""

from __future__ import annotations

import json
import os
import socket
import time
from contextlib import closing

from hflow.single_controller.base.decorator import Dispatch, Execute, register

# Set while a colocated WorkerDict builds its roles, so the nested Worker.__new__ does not publish again.
DISABLE_WORKER_INIT = "DISABLE_WORKER_INIT"


def _rendezvous_key(name_prefix: str) -> bytes:
    return f"hflow/{name_prefix}/rendezvous".encode()


def publish_rendezvous(name_prefix: str, addr: str, port: str) -> None:
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(_rendezvous_key(name_prefix), json.dumps([addr, port]).encode(), overwrite=True)


def read_rendezvous(name_prefix: str) -> tuple[str, str] | None:
    """Rank 0's (MASTER_ADDR, MASTER_PORT) for the group, or None if it has not published yet."""
    from ray.experimental.internal_kv import _internal_kv_get

    value = _internal_kv_get(_rendezvous_key(name_prefix))
    return tuple(json.loads(value)) if value else None


def forget_rendezvous(name_prefix: str) -> None:
    from ray.experimental.internal_kv import _internal_kv_del

    _internal_kv_del(_rendezvous_key(name_prefix))


def get_free_port() -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def get_node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"


class Worker:
    """Base class of SPMD workers; subclasses add `@register`-ed methods."""

    def __new__(cls, *args, **kwargs):
        instance = super().__new__(cls)
        if os.environ.get(DISABLE_WORKER_INIT, "0") not in ("", "0"):
            return instance
        rank, prefix = os.environ.get("RANK"), os.environ.get("WG_PREFIX")
        if rank is not None and prefix is not None and int(rank) == 0:
            addr, port = get_node_ip(), str(get_free_port())
            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, port
            publish_rendezvous(prefix, addr, port)
        return instance

    @staticmethod
    def _wait_for_rendezvous(prefix: str, timeout_s: float = 300.0) -> None:
        """Non-zero ranks of a worker group: read rank 0's address (rank 0 may still be starting)."""
        deadline = time.monotonic() + timeout_s
        while (found := read_rendezvous(prefix)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 of worker group {prefix!r} did not publish its address in {timeout_s:.0f}s")
            time.sleep(0.05)
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = found

    def __init__(self):
        env = os.environ
        self._rank = int(env.get("RANK", "0"))
        self._world_size = int(env.get("WORLD_SIZE", "1"))
        self._local_rank = int(env.get("LOCAL_RANK", "0"))
        self._local_world_size = int(env.get("LOCAL_WORLD_SIZE", "1"))
        prefix = env.get("WG_PREFIX")
        if prefix and env.get(DISABLE_WORKER_INIT, "0") in ("", "0"):
            # Always the group's own address: a MASTER_ADDR inherited from the driver's environment
            # (e.g. a stand-alone worker built there before Ray started) would pair ranks on a stale port.
            self._wait_for_rendezvous(prefix)
        if self._world_size == 1:
            # A stand-alone worker (built in-process, e.g. for debugging) rendezvouses with itself.
            env.setdefault("MASTER_ADDR", "127.0.0.1")
            env.setdefault("MASTER_PORT", str(get_free_port()))
        self._master_addr = env.get("MASTER_ADDR")
        self._master_port = env.get("MASTER_PORT")
        for key, value in (("RANK", self._rank), ("WORLD_SIZE", self._world_size),
                           ("LOCAL_RANK", self._local_rank), ("LOCAL_WORLD_SIZE", self._local_world_size)):
            env[key] = str(value)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def local_rank(self) -> int:
        return self._local_rank

    @property
    def local_world_size(self) -> int:
        return self._local_world_size

    def get_master_addr_port(self) -> tuple[str | None, str | None]:
        return self._master_addr, self._master_port

    def init_distributed(self, timeout_s: float = 600.0) -> None:
        """Join this group's default torch.distributed process group (idempotent).

        NCCL on GPU, gloo on CPU (the device helper decides). Colocated roles in one process share it.
        """
        import datetime

        import torch.distributed as dist

        from hflow.utils import device

        if dist.is_initialized():
            return
        if self._master_addr is None or self._master_port is None:
            raise RuntimeError(
                f"rank {self._rank}: MASTER_ADDR/MASTER_PORT are not set; start workers through a "
                "RayWorkerGroup (rank 0 publishes them) or set them in the environment"
            )
        device.set_device()
        dist.init_process_group(
            backend=device.dist_backend(),
            init_method=f"tcp://{self._master_addr}:{self._master_port}",
            rank=self._rank,
            world_size=self._world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )

    # Plain (unregistered) helpers, callable through worker_group.execute_all_sync(name, ...).
    def get_pid(self) -> int:
        return os.getpid()

    def getenv(self, key: str) -> str | None:
        return os.environ.get(key)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    def execute_with_func_generator(self, func, *args, **kwargs):
        """Run a driver-supplied function on every rank with that rank's chunk of the data."""
        return func(self, *args, **kwargs)

    @register(dispatch_mode=Dispatch.ALL_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def execute_func_rank_zero(self, func, *args, **kwargs):
        """Run a driver-supplied function once, on rank 0."""
        return func(*args, **kwargs)
