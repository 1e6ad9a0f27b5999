"""The local backend: a worker group of one rank that lives in the driver's own process.

The same worker classes, `@register` dispatch/collect modes and `DataProto`s as the Ray backend, with
no Ray (this module never imports it): calls run synchronously in the caller's thread, so a debugger's
breakpoints inside worker methods work and an error surfaces as the original exception with its plain
stack trace. It is also the way to run the real trainer on a machine that has torch but not Ray.
"""

from __future__ import annotations

import asyncio
import inspect
import os

from hflow.single_controller.base.worker_group import (
    ClassWithInitArgs,
    WorkerGroup,
    per_rank_arguments,
    rank_side_class,
)

__all__ = ["LocalWorkerGroup"]

# The rank contract of hflow.single_controller.base.worker for a group of one.
LOCAL_RANK_ENV = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                  "NODE_LOCAL_RANK": "0", "WG_BACKEND": "local"}


class LocalWorkerGroup(WorkerGroup):
    """One worker, built in this process from `cls_with_init`; its registered methods become the
    group's methods exactly as on Ray (`spawn` gives per-role views of a colocated class)."""

    def __init__(self, cls_with_init: ClassWithInitArgs, name_prefix: str = "local"):
        super().__init__(resource_pool=None)
        os.environ.update(LOCAL_RANK_ENV)
        worker_cls = rank_side_class(cls_with_init.cls)
        self._workers = [worker_cls(*cls_with_init.args, **cls_with_init.kwargs)]
        self._worker_names = [f"{name_prefix}{cls_with_init.cls.__name__}_0:0"]
        self._loop = asyncio.new_event_loop()  # for `async def` worker methods, as a Ray async actor has
        self._rendezvous()
        self._bind_worker_method(cls_with_init.cls)

    def _call(self, method_name: str, *args, **kwargs):
        result = getattr(self._workers[0], method_name)(*args, **kwargs)
        return self._loop.run_until_complete(result) if inspect.iscoroutine(result) else result

    def execute_all_async(self, method_name: str, *args, **kwargs) -> list:
        (rank_args, rank_kwargs), = per_rank_arguments(1, args, kwargs)
        return [self._call(method_name, *rank_args, **rank_kwargs)]

    def execute_rank_zero_async(self, method_name: str, *args, **kwargs):
        return self._call(method_name, *args, **kwargs)

    def wait(self, method_name: str, results):
        return results  # already computed: calls run eagerly in this process

    def shutdown(self) -> None:
        """Drop the worker and leave the process group it joined, so a later group can start afresh."""
        import torch.distributed as dist

        # The worker's engine and its process groups go first, while the default group they hang off
        # still exists. Views from `spawn` share this list: clearing it releases the worker everywhere.
        for worker in self._workers:
            worker.close()
        self._workers.clear()
        self._loop.close()
        if dist.is_initialized():
            dist.destroy_process_group()
