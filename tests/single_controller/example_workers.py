"""Worker classes shared by the worker-group tests: plain hflow workers with no Ray import, so the local
backend's tests (and the GPU check, on a machine without Ray) can use them too."""

import os
import time

import numpy as np
import torch

from hflow.protocol import DataProto
from hflow.single_controller.base import Dispatch, Execute, Worker, register


def _split_pairs(wg, x):
    """Custom dispatch: send x[i] to rank i of a pair list; collect doubles the list."""
    return ([x[i % len(x)] for i in range(wg.world_size)],), {}


class ComputeWorker(Worker):
    def __init__(self, offset=0):
        super().__init__()
        self.offset = offset

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def add_rank(self, x, y=0):
        return x + y + self.rank + self.offset

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def times_ten(self, x):
        return x * 10

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def dp_plus_one(self, x):
        return x + 1

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def tag_rank(self, data: DataProto, other: DataProto = None):
        """Adds the rank to 'a' (and copies 'b' of a second DataProto) so tests can see the chunking."""
        out = DataProto.from_dict({"a": data.batch["a"] + 100 * self.rank},
                                  non_tensors={"na": data.non_tensor_batch["na"]})
        if other is not None:
            out.batch["b"] = other.batch["b"].clone()
        out.meta_info["metrics"] = {"rows": [len(data)]}
        return out

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def sample_twice(self, data: DataProto):
        return data.repeat(2, interleave=True)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    async def double_async(self, data: DataProto):
        return DataProto.from_dict({"a": data.batch["a"] * 2 + self.rank})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def count_rows(self, data: DataProto):
        return {"rank": self.rank, "rows": len(data)}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def only_rank_zero(self, x):
        return (self.rank, x)

    @register(dispatch_mode={"dispatch_fn": _split_pairs, "collect_fn": lambda wg, out: out * 2})
    def custom(self, x):
        return x

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rank_info(self):
        return {"rank": self.rank, "world_size": self.world_size, "local_rank": self.local_rank,
                "master": self.get_master_addr_port(), "pid": os.getpid()}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def nap(self, seconds):
        """When this rank started and ended a sleep (wall clock)."""
        started = time.time()
        time.sleep(seconds)
        return started, time.time()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def threads(self):
        return torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_reduce_rank(self):
        import torch.distributed as dist

        self.init_distributed()
        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)
        return t.item()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def fail_on_rank_one(self):
        """Rank 1 raises while rank 0 waits in a collective that can never complete."""
        import torch.distributed as dist

        self.init_distributed()
        if self.rank == 1:
            raise ValueError("boom from rank one")
        dist.barrier()
        return "unreachable"


class CriticLike(Worker):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def scale_a(self, data: DataProto):
        return DataProto.from_dict({"a": data.batch["a"] * self.scale})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self):
        return os.getpid()


def _data(n):
    return DataProto.from_dict({"a": torch.arange(n)}, non_tensors={"na": np.array([f"s{i}" for i in range(n)], dtype=object)})


def fresh_worker_class():
    """A new worker class, with its own method objects, on every call.

    `ray.remote(cls)` marks a class's methods for the rest of the process (Ray pins each one's signature
    on the function object, shared with subclasses), so a test about the order in which a class is used
    with and without `ray.remote` needs a class that nothing else in the process has touched.
    """

    class FreshWorker(Worker):
        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
        def tag_rank(self, data: DataProto, other: DataProto = None):
            out = DataProto.from_dict({"a": data.batch["a"] + 100 * self.rank})
            if other is not None:
                out.batch["b"] = other.batch["b"].clone()
            return out

        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
        def double_later(self, data: DataProto):
            return DataProto.from_dict({"a": data.batch["a"] * 2})

    return FreshWorker
