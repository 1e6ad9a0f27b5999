"""Worker groups on Ray: placement groups, actors, fail-fast result collection, colocation."""

from __future__ import annotations

import inspect
import os
import random
import string
import time
from contextlib import contextmanager
from typing import Any, Callable

import ray
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hflow.single_controller.base.decorator import MAGIC_ATTR
from hflow.single_controller.base.worker import (
    DISABLE_WORKER_INIT,
    Worker,
    forget_rendezvous,
    read_rendezvous,
)
from hflow.single_controller.base.worker_group import (
    ClassWithInitArgs,
    ResourcePool,
    WorkerGroup,
    registered_methods,
)
from hflow.utils import device


class WorkerGroupError(RuntimeError):
    """A worker method failed (raised, or its process died) on one rank."""


class RayResourcePool(ResourcePool):
    """A resource pool backed by one Ray placement group per node, one bundle per worker process.

    Each bundle holds one device -- a GPU on GPU machines, nothing more on CPU-only machines -- and
    `cpus_per_worker` CPUs (`use_gpu=None` asks the device helper). Ray sets a worker's
    OMP_NUM_THREADS to its CPUs, so on a CPU-only machine this is the worker's torch thread count.
    """

    def __init__(self, process_on_nodes: list[int] | None = None, use_gpu: bool | None = None,
                 name_prefix: str = "", max_colocate_count: int = 1, detached: bool = False,
                 cpus_per_worker: int = 1):
        super().__init__(process_on_nodes, max_colocate_count)
        if cpus_per_worker < 1:
            raise ValueError(f"cpus_per_worker must be at least 1, got {cpus_per_worker}")
        self.cpus_per_worker = int(cpus_per_worker)
        self.use_gpu = device.is_cuda() if use_gpu is None else use_gpu
        self.name_prefix = name_prefix
        self.detached = detached
        self.pgs: list[PlacementGroup] | None = None

    def bundle(self) -> dict[str, float]:
        return {"CPU": self.cpus_per_worker, "GPU": 1} if self.use_gpu else {"CPU": self.cpus_per_worker}

    def get_placement_groups(self, strategy: str = "STRICT_PACK", timeout_s: float = 120.0) -> list[PlacementGroup]:
        if self.pgs is not None:
            return self.pgs
        self._check_cluster_can_fit()
        lifetime = "detached" if self.detached else None
        # Names are unique per cluster: several pools with the same shape may coexist.
        name = f"{self.name_prefix}hflow_group_{'_'.join(map(str, self._store))}_{_random_prefix()}"
        pgs = [
            placement_group([self.bundle()] * count, strategy=strategy, name=f"{name}:{i}", lifetime=lifetime)
            for i, count in enumerate(self._store)
        ]
        ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=timeout_s)
        if len(ready) < len(pgs):
            for pg in pgs:
                ray.util.remove_placement_group(pg)
            raise TimeoutError(
                f"Ray could not reserve {self._store} worker slots of {self.bundle()} within {timeout_s:.0f}s: "
                f"free now {_summary(ray.available_resources())} of {_summary(ray.cluster_resources())}. "
                "Another job or worker group holds them; shut it down or ask for fewer workers."
            )
        self.pgs = _sort_by_node_ip(pgs)
        return self.pgs

    def _check_cluster_can_fit(self) -> None:
        """Fail at once (rather than wait) when the cluster can never hold this pool."""
        total = ray.cluster_resources()
        for resource, per_bundle in self.bundle().items():
            needed = per_bundle * self.world_size
            if total.get(resource, 0) < needed:
                raise ValueError(
                    f"the resource pool needs {needed:g} {resource} ({self.world_size} workers x {per_bundle:g}) "
                    f"but the Ray cluster has {total.get(resource, 0):g}. Lower the number of workers "
                    "(trainer.n_gpus_per_node x trainer.nnodes) or start Ray with more resources."
                )

    def remove(self) -> None:
        """Release the placement groups (the pool's actors should be shut down first)."""
        for pg in self.pgs or []:
            ray.util.remove_placement_group(pg)
        self.pgs = None


def _summary(resources: dict[str, float]) -> str:
    return ", ".join(f"{resources.get(k, 0):g} {k}" for k in ("CPU", "GPU") if k in resources or k == "CPU")


def _sort_by_node_ip(pgs: list[PlacementGroup]) -> list[PlacementGroup]:
    """Stable rank order across runs (sharded checkpoints are per rank)."""
    node_ip = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}

    def key(pg: PlacementGroup) -> str:
        table = ray.util.placement_group_table(pg)
        return node_ip.get(table["bundles_to_node_id"][0], "")

    return sorted(pgs, key=key)


class RayClassWithInitArgs(ClassWithInitArgs):
    """A worker class (plain or `ray.remote`) and its init args, started later as a Ray actor."""

    def __init__(self, cls: type, *args, **kwargs):
        user_cls = getattr(cls, "__ray_actor_class__", cls)
        super().__init__(user_cls, *args, **kwargs)
        self.remote_cls = cls if hasattr(cls, "__ray_actor_class__") else ray.remote(cls)
        self._options: dict[str, Any] = {}

    def update_options(self, options: dict[str, Any]) -> None:
        self._options.update(options)

    def __call__(self, placement_group: PlacementGroup, bundle_index: int, resources: dict[str, float],
                 env_vars: dict[str, str], name: str, detached: bool = False):
        user_runtime_env = dict(self._options.get("runtime_env") or {})
        # The user's env vars first, the group's (rank, world size, group name) over them.
        user_runtime_env["env_vars"] = {**user_runtime_env.get("env_vars", {}), **env_vars}
        options = {
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=placement_group, placement_group_bundle_index=bundle_index
            ),
            "name": name,
            "num_cpus": resources.get("CPU", 0),
            "num_gpus": resources.get("GPU", 0),
            **self._options,
            "runtime_env": user_runtime_env,
        }
        if detached:
            options["lifetime"] = "detached"
        return self.remote_cls.options(**options).remote(*self.args, **self.kwargs)


def _random_prefix() -> str:
    return "".join(random.choices(string.ascii_lowercase + string.digits, k=6))


def _make_group_method(worker_group: "RayWorkerGroup", method_name: str, dispatch_fn: Callable,
                       collect_fn: Callable, execute_fn: Callable, blocking: bool) -> Callable:
    """The driver-side body of a registered method: dispatch -> execute -> (wait) -> collect."""

    def group_method(*args, **kwargs):
        args, kwargs = dispatch_fn(worker_group, *args, **kwargs)
        refs = execute_fn(method_name, *args, **kwargs)
        outputs = worker_group.wait(method_name, refs) if blocking else refs
        return collect_fn(worker_group, outputs)

    group_method.__name__ = method_name
    return group_method


class RayWorkerGroup(WorkerGroup):
    """SPMD workers as Ray actors, one per bundle of a `RayResourcePool`.

    Build it from a pool and a `RayClassWithInitArgs`, or attach it to existing actors
    (`worker_names` / `worker_handles`, e.g. from `spawn`).
    """

    def __init__(self, resource_pool: RayResourcePool | None = None,
                 ray_cls_with_init: RayClassWithInitArgs | None = None, bin_pack: bool = True,
                 name_prefix: str | None = None, detached: bool = False, worker_names: list[str] | None = None,
                 worker_handles: list | None = None, ray_wait_register_center_timeout: float = 300.0,
                 **kwargs):
        super().__init__(resource_pool, **kwargs)
        self.ray_cls_with_init = ray_cls_with_init
        self.name_prefix = name_prefix or _random_prefix()
        self._register_center_timeout = ray_wait_register_center_timeout
        if resource_pool is not None:
            self._init_with_resource_pool(resource_pool, ray_cls_with_init, bin_pack, detached)
        else:
            self._init_with_existing_workers(worker_names, worker_handles)
        if ray_cls_with_init is not None:
            self._bind_worker_method(ray_cls_with_init.cls, _make_group_method)

    # ------------------------------------------------------------------ construction

    def _init_with_resource_pool(self, pool: RayResourcePool, cls_with_init: RayClassWithInitArgs,
                                 bin_pack: bool, detached: bool) -> None:
        if cls_with_init is None:
            raise ValueError("RayWorkerGroup needs ray_cls_with_init when built from a resource pool")
        pgs = pool.get_placement_groups(strategy="STRICT_PACK" if bin_pack else "PACK")
        per_process = {key: value / pool.max_colocate_count for key, value in pool.bundle().items()}
        class_name = cls_with_init.cls.__name__
        # All ranks start at once; ranks > 0 read rank 0's rendezvous address when it is published.
        for pg_index, (pg, local_world_size) in enumerate(zip(pgs, pool.store)):
            for local_rank in range(local_world_size):
                env_vars = {
                    "WORLD_SIZE": str(pool.world_size),
                    "RANK": str(len(self._workers)),
                    "LOCAL_RANK": str(local_rank),
                    "LOCAL_WORLD_SIZE": str(local_world_size),
                    "WG_PREFIX": self.name_prefix,
                    "WG_BACKEND": "ray",
                }
                name = f"{self.name_prefix}{class_name}_{pg_index}:{local_rank}"
                self._workers.append(cls_with_init(pg, local_rank, per_process, env_vars, name, detached))
                self._worker_names.append(name)
        self._master_addr, self._master_port = self._read_rendezvous()

    def _read_rendezvous(self) -> tuple[str, str]:
        """Wait for rank 0 to publish MASTER_ADDR/PORT; fail fast if rank 0 dies while starting."""
        started = self._workers[0].__ray_ready__.remote()
        deadline = time.monotonic() + self._register_center_timeout
        while time.monotonic() < deadline:
            if (found := read_rendezvous(self.name_prefix)) is not None:
                return found
            done, _ = ray.wait([started], timeout=0.05)
            if done:
                self._get_one(done[0], rank=0, name=self._worker_names[0], method_name="__init__")
        rank_zero_name = self._worker_names[0]
        raise TimeoutError(
            f"rank 0 ({rank_zero_name}) did not publish its rendezvous address within "
            f"{self._register_center_timeout:.0f}s; is its worker class a subclass of hflow's Worker?"
        )

    def _init_with_existing_workers(self, worker_names: list[str] | None, worker_handles: list | None) -> None:
        if worker_handles is None:
            if worker_names is None:
                raise ValueError("RayWorkerGroup needs a resource_pool, worker_names or worker_handles")
            worker_handles = [ray.get_actor(name) for name in worker_names]
        self._workers = list(worker_handles)
        self._worker_names = list(worker_names or [f"worker_{i}" for i in range(len(worker_handles))])

    @classmethod
    def from_detached(cls, name_prefix: str, worker_names: list[str] | None = None,
                      worker_handles: list | None = None, ray_cls_with_init: RayClassWithInitArgs | None = None):
        return cls(resource_pool=None, ray_cls_with_init=ray_cls_with_init, name_prefix=name_prefix,
                   worker_names=worker_names, worker_handles=worker_handles)

    def spawn(self, prefix_set) -> dict[str, "RayWorkerGroup"]:
        """Per-role views of a colocated group: `spawn({"actor", "critic"})["critic"].update_critic(...)`.

        Each view drives the same actors; its methods are the role's methods without the role prefix.
        """
        views = {}
        for prefix in prefix_set:
            view = RayWorkerGroup.from_detached(self.name_prefix, self._worker_names, self._workers)
            view.ray_cls_with_init = self.ray_cls_with_init
            view._master_addr, view._master_port = self._master_addr, self._master_port
            if not view._bind_worker_method(self.ray_cls_with_init.cls, _make_group_method, prefix=prefix):
                raise ValueError(f"the colocated class has no role {prefix!r}")
            views[prefix] = view
        return views

    def shutdown(self) -> None:
        """Kill this group's actors (views made by `spawn` share them) and release its resource pool."""
        for worker in self._workers:
            ray.kill(worker, no_restart=True)
        self._workers = []
        forget_rendezvous(self.name_prefix)
        if isinstance(self._resource_pool, RayResourcePool):
            self._resource_pool.remove()

    # ------------------------------------------------------------------ properties

    @property
    def worker_names(self) -> list[str]:
        return self._worker_names

    @property
    def workers(self) -> list:
        return self._workers

    @property
    def master_address(self) -> str | None:
        return self._master_addr

    @property
    def master_port(self) -> str | None:
        return self._master_port

    # ------------------------------------------------------------------ execution

    def _call(self, worker, method_name: str, *args, **kwargs):
        return getattr(worker, method_name).remote(*args, **kwargs)

    def execute_all_async(self, method_name: str, *args, **kwargs) -> list:
        """Call `method_name` on every rank. If every argument is a list of world-size length, rank i
        gets element i of each (scatter); otherwise every rank gets the same arguments (broadcast)."""
        n = len(self._workers)
        values = [*args, *kwargs.values()]
        if values and all(isinstance(v, list) and len(v) == n for v in values):
            return [
                self._call(worker, method_name, *(a[i] for a in args), **{k: v[i] for k, v in kwargs.items()})
                for i, worker in enumerate(self._workers)
            ]
        return [self._call(worker, method_name, *args, **kwargs) for worker in self._workers]

    execute_all = execute_all_async

    def execute_all_sync(self, method_name: str, *args, **kwargs) -> list:
        return self.wait(method_name, self.execute_all_async(method_name, *args, **kwargs))

    def execute_rank_zero_async(self, method_name: str, *args, **kwargs):
        return self._call(self._workers[0], method_name, *args, **kwargs)

    execute_rank_zero = execute_rank_zero_async

    def execute_rank_zero_sync(self, method_name: str, *args, **kwargs):
        return self.wait(method_name, self.execute_rank_zero_async(method_name, *args, **kwargs))

    def wait(self, method_name: str, refs):
        """Results of one call on every rank, in rank order; raise as soon as any rank fails.

        Waiting on the refs one completion at a time (rather than `ray.get` of the whole list) means a
        rank that raised, or whose process died, ends the call at once even while the other ranks are
        blocked in a collective waiting for it.
        """
        if isinstance(refs, ray.ObjectRef):
            return self._get_one(refs, rank=0, name=self._worker_names[0], method_name=method_name)
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                rank = rank_of[ref]
                results[rank] = self._get_one(ref, rank, self._worker_names[rank], method_name)
        return results

    def _get_one(self, ref, rank: int, name: str, method_name: str):
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as err:
            raise WorkerGroupError(f"worker {name} (rank {rank}) raised in {method_name}():\n{err}") from None
        except ray.exceptions.RayActorError as err:
            raise WorkerGroupError(
                f"worker {name} (rank {rank}) died during {method_name}(): {type(err).__name__}: {err}"
            ) from None


# ---------------------------------------------------------------------- colocation


@contextmanager
def _env_set(key: str, value: str):
    old = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


def _forwarder(role: str, method_name: str, attrs: dict, is_async: bool) -> Callable:
    """A WorkerDict method that forwards to one role's registered method, keeping its dispatch attrs."""
    if is_async:

        async def forward(self, *args, **kwargs):
            return await getattr(self.worker_dict[role], method_name)(*args, **kwargs)

    else:

        def forward(self, *args, **kwargs):
            return getattr(self.worker_dict[role], method_name)(*args, **kwargs)

    forward.__name__ = f"{role}_{method_name}"
    setattr(forward, MAGIC_ATTR, attrs)
    return forward


def create_colocated_worker_cls(class_dict: dict[str, RayClassWithInitArgs]) -> RayClassWithInitArgs:
    """One worker class that hosts several roles in the same process (one process per device).

    Role `key`'s registered method `m` becomes `key_m` on the combined class; `RayWorkerGroup.spawn`
    turns the group back into one view per role. Roles share the process, its device and its
    torch.distributed group, so they take turns on the device instead of partitioning the hardware.
    """
    if not class_dict:
        raise ValueError("create_colocated_worker_cls needs at least one role")
    roles = {role: (cwi.cls, cwi.args, cwi.kwargs) for role, cwi in class_dict.items()}
    for role, (cls, _, _) in roles.items():
        if not issubclass(cls, Worker):
            raise TypeError(f"role {role!r}: {cls.__name__} must subclass hflow's Worker")

    class WorkerDict(Worker):
        def __init__(self):
            super().__init__()
            self.worker_dict = {}
            with _env_set(DISABLE_WORKER_INIT, "1"):
                for role, (cls, args, kwargs) in roles.items():
                    self.worker_dict[role] = cls(*args, **kwargs)

    for role, (cls, _, _) in roles.items():
        for method_name, attrs in registered_methods(cls).items():
            is_async = inspect.iscoroutinefunction(getattr(cls, method_name))
            setattr(WorkerDict, f"{role}_{method_name}", _forwarder(role, method_name, attrs, is_async))
    WorkerDict.__name__ = WorkerDict.__qualname__ = "WorkerDict_" + "_".join(roles)
    return RayClassWithInitArgs(WorkerDict)
