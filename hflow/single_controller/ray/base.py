"""Worker groups on Ray: placement groups, one actor per device, fail-fast result collection."""

from __future__ import annotations

import random
import string
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hflow.single_controller.base.worker_group import (
    ClassWithInitArgs,
    ResourcePool,
    WorkerGroup,
    WorkerGroupError,
    create_colocated_worker_cls as _create_colocated_worker_cls,
    per_rank_arguments,
    rank_side_class,
)
from hflow.utils import device
from hflow.utils.errors import UserError


class RayResourcePool(ResourcePool):
    """A resource pool backed by one Ray placement group per node, one bundle per worker process.

    Each bundle holds one device -- a GPU on GPU machines, nothing more on CPU-only machines -- and
    `cpus_per_worker` CPUs. `use_gpu=None` asks the cluster (GPU bundles when Ray has GPUs, unless
    HFLOW_DEVICE=cpu), not the driver's own hardware: a head node without a GPU still drives GPU
    workers. A worker's torch threads (OMP_NUM_THREADS) are `threads_per_worker`, by default its
    CPUs: on a CPU-only machine the CPUs are the compute; a GPU worker that reserves one CPU still
    wants several threads for its host-side work, which `threads_per_worker` gives without
    reserving more of Ray's CPUs.
    """

    def __init__(self, process_on_nodes: list[int] | None = None, use_gpu: bool | None = None,
                 name_prefix: str = "", max_colocate_count: int = 1, detached: bool = False,
                 cpus_per_worker: int = 1, threads_per_worker: int | None = None):
        super().__init__(process_on_nodes, max_colocate_count)
        if cpus_per_worker < 1:
            raise ValueError(f"cpus_per_worker must be at least 1, got {cpus_per_worker}")
        if threads_per_worker is not None and threads_per_worker < 1:
            raise ValueError(f"threads_per_worker must be at least 1, got {threads_per_worker}")
        self.cpus_per_worker = int(cpus_per_worker)
        self.threads_per_worker = threads_per_worker
        self.use_gpu = device.cluster_has_gpus(_cluster_resources()) if use_gpu is None else use_gpu
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
        total = _cluster_resources()
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


def _cluster_resources() -> dict[str, float]:
    """Ray's view of the cluster; like Ray's task and actor APIs, start a local Ray when none runs."""
    if not ray.is_initialized():
        ray.init()
    return ray.cluster_resources()


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
        super().__init__(getattr(cls, "__ray_actor_class__", cls), *args, **kwargs)
        self._options: dict[str, Any] = {}
        self._remote_cls = None

    @classmethod
    def wrap(cls, cls_with_init: ClassWithInitArgs) -> "RayClassWithInitArgs":
        if isinstance(cls_with_init, RayClassWithInitArgs):
            return cls_with_init
        return cls(cls_with_init.cls, *cls_with_init.args, **cls_with_init.kwargs)

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
        if self._remote_cls is None:
            self._remote_cls = ray.remote(rank_side_class(self.cls))
        return self._remote_cls.options(**options).remote(*self.args, **self.kwargs)


def _random_prefix() -> str:
    return "".join(random.choices(string.ascii_lowercase + string.digits, k=6))


class RayWorkerGroup(WorkerGroup):
    """SPMD workers as Ray actors, one per bundle of a `RayResourcePool`.

    Build it from a pool and a worker class with its init args (`ClassWithInitArgs` or
    `RayClassWithInitArgs`), or attach it to existing actors (`worker_names` / `worker_handles`).
    """

    def __init__(self, resource_pool: RayResourcePool | None = None,
                 ray_cls_with_init: ClassWithInitArgs | None = None, bin_pack: bool = True,
                 name_prefix: str | None = None, detached: bool = False, worker_names: list[str] | None = None,
                 worker_handles: list | None = None, **kwargs):
        super().__init__(resource_pool, **kwargs)
        self.ray_cls_with_init = RayClassWithInitArgs.wrap(ray_cls_with_init) if ray_cls_with_init else None
        self.name_prefix = name_prefix or _random_prefix()
        if resource_pool is not None:
            self._init_with_resource_pool(resource_pool, self.ray_cls_with_init, bin_pack, detached)
        else:
            self._init_with_existing_workers(worker_names, worker_handles)
        if self.ray_cls_with_init is not None:
            self._bind_worker_method(self.ray_cls_with_init.cls)

    # ------------------------------------------------------------------ construction

    def _init_with_resource_pool(self, pool: RayResourcePool, cls_with_init: RayClassWithInitArgs,
                                 bin_pack: bool, detached: bool) -> None:
        if cls_with_init is None:
            raise ValueError("RayWorkerGroup needs ray_cls_with_init when built from a resource pool")
        pgs = pool.get_placement_groups(strategy="STRICT_PACK" if bin_pack else "PACK")
        per_process = {key: value / pool.max_colocate_count for key, value in pool.bundle().items()}
        class_name = cls_with_init.cls.__name__
        for pg_index, (pg, local_world_size) in enumerate(zip(pgs, pool.store)):
            for node_local_rank in range(local_world_size):
                env_vars = {
                    "WORLD_SIZE": str(pool.world_size),
                    "RANK": str(len(self._workers)),
                    # Each actor holds one device (Ray narrows CUDA_VISIBLE_DEVICES to it), so its index
                    # among the visible devices is 0 (see hflow.single_controller.base.worker).
                    "LOCAL_RANK": "0",
                    "LOCAL_WORLD_SIZE": str(local_world_size),
                    "NODE_LOCAL_RANK": str(node_local_rank),
                    "WG_PREFIX": self.name_prefix,
                    "WG_BACKEND": "ray",
                }
                if pool.threads_per_worker is not None:
                    env_vars["OMP_NUM_THREADS"] = str(pool.threads_per_worker)
                name = f"{self.name_prefix}{class_name}_{pg_index}:{node_local_rank}"
                self._workers.append(cls_with_init(pg, node_local_rank, per_process, env_vars, name, detached))
                self._worker_names.append(name)
        self._rendezvous()

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

    def beside(self, cls_with_init: ClassWithInitArgs, name_prefix: str | None = None) -> "RayWorkerGroup":
        """Another group of processes on this group's devices, one per bundle of its pool (which must allow
        `max_colocate_count` processes per device): the same ranks and devices, a torch.distributed world of
        its own. This group's `shutdown` releases the pool; the other's kills only its own actors."""
        if self._resource_pool is None or self._resource_pool.max_colocate_count < 2:
            raise ValueError("a group beside another needs a resource pool with max_colocate_count >= 2")
        group = RayWorkerGroup(self._resource_pool, cls_with_init, name_prefix=name_prefix)
        group._owns_pool = False
        return group

    _owns_pool = True

    def shutdown(self) -> None:
        """Kill this group's actors (views made by `spawn` share them) and release its resource pool (unless
        the group was made `beside` another, whose pool it is)."""
        for worker in self._workers:
            ray.kill(worker, no_restart=True)
        self._workers = []
        if self._owns_pool and isinstance(self._resource_pool, RayResourcePool):
            self._resource_pool.remove()

    # ------------------------------------------------------------------ execution

    def _call(self, worker, method_name: str, *args, **kwargs):
        return getattr(worker, method_name).remote(*args, **kwargs)

    def execute_all_async(self, method_name: str, *args, **kwargs) -> list:
        return [self._call(worker, method_name, *rank_args, **rank_kwargs)
                for worker, (rank_args, rank_kwargs) in zip(self._workers, per_rank_arguments(len(self._workers), args, kwargs))]

    def execute_rank_zero_async(self, method_name: str, *args, **kwargs):
        return self._call(self._workers[0], method_name, *args, **kwargs)

    def ready(self, refs) -> bool:
        refs = [refs] if isinstance(refs, ray.ObjectRef) else list(refs)
        return len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) == len(refs)

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
            error = WorkerGroupError(f"worker {name} (rank {rank}) raised in {method_name}():\n{err}")
            if isinstance(err.cause, UserError):
                error.user_error = err.cause
            raise error from None
        except ray.exceptions.RayActorError as err:
            raise WorkerGroupError(
                f"worker {name} (rank {rank}) died during {method_name}(): {type(err).__name__}: {err}"
            ) from None


# ---------------------------------------------------------------------- colocation


def create_colocated_worker_cls(class_dict: dict[str, ClassWithInitArgs]) -> RayClassWithInitArgs:
    """`hflow.single_controller.base.create_colocated_worker_cls`, ready for a `RayWorkerGroup`."""
    return RayClassWithInitArgs.wrap(_create_colocated_worker_cls(class_dict))
