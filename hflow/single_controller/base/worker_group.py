"""Backend-independent parts of a worker group: resource pools, deferred construction, method binding."""

from __future__ import annotations

from typing import Any, Callable

from hflow.single_controller.base.decorator import (
    MAGIC_ATTR,
    get_predefined_execute_fn,
    resolve_dispatch_fns,
)


class ResourcePool:
    """How many worker processes run on each node: `process_on_nodes=[8, 8]` is two 8-device nodes.

    `max_colocate_count` is how many *separate* worker processes may share one device. hflow's trainer
    uses 1 (roles share a process instead, see `create_colocated_worker_cls`).
    """

    def __init__(self, process_on_nodes: list[int] | None = None, max_colocate_count: int = 1):
        self._store = list(process_on_nodes or [])
        if any(int(n) <= 0 for n in self._store):
            raise ValueError(f"process_on_nodes must be positive process counts, got {self._store}")
        if max_colocate_count < 1:
            raise ValueError(f"max_colocate_count must be >= 1, got {max_colocate_count}")
        self.max_colocate_count = max_colocate_count

    def add_node(self, process_count: int) -> None:
        self._store.append(process_count)

    @property
    def world_size(self) -> int:
        return sum(self._store)

    @property
    def store(self) -> list[int]:
        return self._store

    def __call__(self) -> list[int]:
        return self._store

    def local_world_size_list(self) -> list[int]:
        return [count for count in self._store for _ in range(count)]

    def local_rank_list(self) -> list[int]:
        return [local_rank for count in self._store for local_rank in range(count)]


class ClassWithInitArgs:
    """A class and its constructor arguments, instantiated later (in the worker process)."""

    def __init__(self, cls: type, *args, **kwargs):
        self.cls = cls
        self.args = args
        self.kwargs = kwargs

    def __call__(self) -> Any:
        return self.cls(*self.args, **self.kwargs)


def registered_methods(cls: type) -> dict[str, dict]:
    """{method name: register attrs} for every `@register`-ed method of `cls` (inherited ones too)."""
    methods = {}
    for name in dir(cls):
        try:
            attr = getattr(cls, name)
        except Exception:  # properties and descriptors that fail on the class
            continue
        attrs = getattr(attr, MAGIC_ATTR, None)
        if callable(attr) and isinstance(attrs, dict):
            methods[name] = attrs
    return methods


class WorkerGroup:
    """A set of workers driven as one: registered worker methods become methods of the group."""

    def __init__(self, resource_pool: ResourcePool | None, **kwargs):
        self._resource_pool = resource_pool
        self._workers: list = []
        self._worker_names: list[str] = []
        self._master_addr: str | None = None
        self._master_port: str | None = None
        self.method_names: list[str] = []

    @property
    def world_size(self) -> int:
        return len(self._workers)

    def _bind_worker_method(self, user_defined_cls: type, func_generator: Callable, prefix: str | None = None):
        """Give this group one method per registered method of `user_defined_cls`.

        With `prefix`, only methods named `{prefix}_<name>` are bound, under `<name>` (the per-role
        view of a colocated class); the remote call still targets the prefixed name.
        """
        bound = []
        for remote_name, attrs in registered_methods(user_defined_cls).items():
            if prefix is None:
                local_name = remote_name
            elif remote_name.startswith(f"{prefix}_"):
                local_name = remote_name[len(prefix) + 1:]
            else:
                continue
            if any(local_name in vars(klass) for klass in type(self).__mro__):
                raise ValueError(
                    f"worker method {remote_name!r} of {user_defined_cls.__name__} would shadow the "
                    f"worker group's own attribute {local_name!r}; rename the method"
                )
            fns = resolve_dispatch_fns(attrs["dispatch_mode"])
            execute_fn = getattr(self, get_predefined_execute_fn(attrs["execute_mode"])["execute_fn_name"])
            method = func_generator(
                self,
                remote_name,
                dispatch_fn=fns["dispatch_fn"],
                collect_fn=fns["collect_fn"],
                execute_fn=execute_fn,
                blocking=attrs["blocking"],
            )
            setattr(self, local_name, method)
            bound.append(local_name)
        self.method_names = bound
        return bound
