"""Backend-independent parts of a worker group: resource pools, deferred construction, colocation, and
the one place where `@register` metadata becomes behaviour, for every backend:

* rank side -- `rank_side_class(cls)` wraps each registered method so that a rank resolves
  `DataProtoFuture` arguments into its own chunk and drops the outputs of padding rows;
* driver side -- `WorkerGroup._bind_worker_method` gives the group one method per registered method
  that runs dispatch -> execute -> wait -> collect, where only `execute_*` and `wait` are the
  backend's own (Ray actors, or the driver's process for the local backend). Callers name the worker
  method itself: `group.call(Worker.method, ...)` (blocking, as registered) or `group.start(...)`
  (returns a `GroupCall` at once).
"""

from __future__ import annotations

import copy
import functools
import inspect
from typing import Any, Callable

from hflow.single_controller.base.decorator import (
    MAGIC_ATTR,
    get_predefined_execute_fn,
    prepare_inputs,
    resolve_dispatch_fns,
    strip_padding,
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


class WorkerGroupError(RuntimeError):
    """A worker method failed (raised, or its process died) on one rank."""

    # The worker's own exception when it is a `UserError` (a bad config, data or reward function): the
    # trainer's entry point then prints that message alone, with no traceback.
    user_error: Exception | None = None


def _rank_side_method(func: Callable, attrs: dict) -> Callable:
    """`func` as a rank runs it for a group call: futures resolved to this rank's chunk, padding dropped."""
    materialize = attrs.get("materialize_futures", True)
    if inspect.iscoroutinefunction(func):

        async def run(self, *args, **kwargs):
            args, kwargs, pad_rows, in_rows = prepare_inputs(args, kwargs, materialize)
            return strip_padding(await func(self, *args, **kwargs), pad_rows, in_rows)

    else:

        def run(self, *args, **kwargs):
            args, kwargs, pad_rows, in_rows = prepare_inputs(args, kwargs, materialize)
            return strip_padding(func(self, *args, **kwargs), pad_rows, in_rows)

    functools.update_wrapper(run, func)  # name, doc and the function's attributes (e.g. @ray.method options)
    # Ray checks call arguments against inspect.signature(run), which must accept the reserved shard
    # keyword. It would follow __wrapped__ to the user's signature, and it would read a __signature__
    # copied from `func`: `ray.remote(cls)` pins one on each of the user's functions (Ray's tracing
    # hook), so after any `ray.remote(MyWorker)` in the process that copy is the user's signature.
    del run.__wrapped__
    run.__dict__.pop("__signature__", None)
    setattr(run, MAGIC_ATTR, attrs)
    return run


def rank_side_class(cls: type) -> type:
    """A subclass of worker class `cls` whose registered methods run as group calls need (see
    `_rank_side_method`); what both backends instantiate. Unregistered methods are untouched."""
    methods = {name: _rank_side_method(getattr(cls, name), attrs) for name, attrs in registered_methods(cls).items()}
    return type(cls.__name__, (cls,), {**methods, "__module__": cls.__module__, "__doc__": cls.__doc__})


def per_rank_arguments(n: int, args: tuple, kwargs: dict) -> list[tuple[tuple, dict]]:
    """Each rank's arguments for a call on `n` ranks: if every argument is a list of length `n`, rank i
    gets element i of each (scatter); otherwise every rank gets the same arguments (broadcast)."""
    values = [*args, *kwargs.values()]
    if values and all(isinstance(v, list) and len(v) == n for v in values):
        return [(tuple(a[i] for a in args), {k: v[i] for k, v in kwargs.items()}) for i in range(n)]
    return [(args, kwargs)] * n


def _make_group_method(worker_group: "WorkerGroup", method_name: str, dispatch_fn: Callable,
                       collect_fn: Callable, execute_fn: Callable, blocking: bool) -> Callable:
    """The driver-side body of a registered method: dispatch -> execute -> (wait) -> collect."""

    def group_method(*args, **kwargs):
        args, kwargs = dispatch_fn(worker_group, *args, **kwargs)
        pending = execute_fn(method_name, *args, **kwargs)
        outputs = worker_group.wait(method_name, pending) if blocking else pending
        return collect_fn(worker_group, outputs)

    def start(*args, **kwargs) -> "GroupCall":
        """Start the call and return at once; `.result()` waits and collects (see `GroupCall`)."""
        args, kwargs = dispatch_fn(worker_group, *args, **kwargs)
        return GroupCall(worker_group, method_name, execute_fn(method_name, *args, **kwargs), collect_fn)

    group_method.__name__ = method_name
    group_method.start = start
    return group_method


class GroupCall:
    """A group call in flight: `wg.start(CriticWorker.update_critic, batch)` returns one, whatever the method's
    `blocking` flag. The driver goes on (for example, to call another group whose workers sit on other
    devices) and asks for the result when it needs it; `result()` raises what the workers raised.

    On Ray each rank runs the calls it receives in order, so a call submitted to workers that are still
    busy starts when they finish. The local backend runs the call at submission; `result()` only collects.
    """

    def __init__(self, worker_group: "WorkerGroup", method_name: str, pending: Any, collect_fn: Callable):
        self._worker_group, self._method_name = worker_group, method_name
        self._pending, self._collect_fn = pending, collect_fn
        self._done, self._value = False, None

    def ready(self) -> bool:
        """Every rank has finished (result() would not wait)."""
        return self._done or self._worker_group.ready(self._pending)

    def result(self) -> Any:
        if not self._done:
            outputs = self._worker_group.wait(self._method_name, self._pending)
            self._value, self._done = self._collect_fn(self._worker_group, outputs), True
        return self._value


class WorkerGroup:
    """A set of workers driven as one: registered worker methods become methods of the group.

    A backend provides the workers and four primitives: `execute_all_async` / `execute_rank_zero_async`
    (start a call by method name), `wait` (its results, in rank order) and `shutdown`.
    """

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

    def ready(self, pending: Any) -> bool:
        """Whether a started call's results are all in (a backend that runs calls at submission: always)."""
        return True

    def _rendezvous(self) -> None:
        """Rank 0 picks the address; every rank learns it before any method that needs collectives."""
        self._master_addr, self._master_port = self.execute_rank_zero_sync("pick_rendezvous_address")
        self.execute_all_sync("set_rendezvous", self._master_addr, self._master_port)

    def execute_all_sync(self, method_name: str, *args, **kwargs) -> list:
        return self.wait(method_name, self.execute_all_async(method_name, *args, **kwargs))

    def execute_rank_zero_sync(self, method_name: str, *args, **kwargs):
        return self.wait(method_name, self.execute_rank_zero_async(method_name, *args, **kwargs))

    def execute_all(self, method_name: str, *args, **kwargs):
        return self.execute_all_async(method_name, *args, **kwargs)

    def execute_rank_zero(self, method_name: str, *args, **kwargs):
        return self.execute_rank_zero_async(method_name, *args, **kwargs)

    def call(self, method: Callable, *args, **kwargs) -> Any:
        """Run a registered worker method on every rank as its `@register` says, and return the collected
        result: ``critic_wg.call(CriticWorker.update_critic, batch)``.

        The method is named by reference, not by string or attribute, so that a reader (or an editor's
        "go to definition") lands on the worker code the call runs."""
        return self._group_method(method)(*args, **kwargs)

    def start(self, method: Callable, *args, **kwargs) -> GroupCall:
        """Start `method` on the group and return at once, whatever its `blocking` flag: the driver goes
        on (for example, to drive another group on other devices) and calls `.result()` when it needs it."""
        return self._group_method(method).start(*args, **kwargs)

    def _group_method(self, method: Callable) -> Callable:
        name = getattr(method, "__name__", None)
        if getattr(method, MAGIC_ATTR, None) is None:
            raise TypeError(f"{name or method!r} is not a @register-ed worker method; a group calls only those")
        if name not in self.method_names:
            raise TypeError(f"{getattr(method, '__qualname__', name)} is not a method of this group's workers "
                            f"(it has {sorted(self.method_names)})")
        return getattr(self, name)

    def spawn(self, prefix_set) -> dict[str, "WorkerGroup"]:
        """Per-role views of a colocated group: `spawn({"actor", "critic"})["critic"].update_critic(...)`.

        Each view drives the same workers; its methods are the role's methods without the role prefix.
        """
        views = {}
        for prefix in prefix_set:
            view = copy.copy(self)
            for name in self.method_names:
                view.__dict__.pop(name, None)
            if not view._bind_worker_method(self._worker_cls, prefix=prefix):
                raise ValueError(f"the colocated class has no role {prefix!r}")
            views[prefix] = view
        return views

    def _bind_worker_method(self, user_defined_cls: type, prefix: str | None = None) -> list[str]:
        """Give this group one method per registered method of `user_defined_cls`.

        With `prefix`, only methods named `{prefix}_<name>` are bound, under `<name>` (the per-role
        view of a colocated class); the remote call still targets the prefixed name.
        """
        self._worker_cls = user_defined_cls
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
            method = _make_group_method(self, remote_name, dispatch_fn=fns["dispatch_fn"],
                                        collect_fn=fns["collect_fn"], execute_fn=execute_fn,
                                        blocking=attrs["blocking"])
            setattr(self, local_name, method)
            bound.append(local_name)
        self.method_names = bound
        return bound


# ---------------------------------------------------------------------- colocation


def _forwarder(role: str, method_name: str, attrs: dict, is_async: bool) -> Callable:
    """A colocated class's method that forwards to one role's registered method, keeping its attrs."""
    if is_async:

        async def forward(self, *args, **kwargs):
            return await getattr(self.worker_dict[role], method_name)(*args, **kwargs)

    else:

        def forward(self, *args, **kwargs):
            return getattr(self.worker_dict[role], method_name)(*args, **kwargs)

    forward.__name__ = f"{role}_{method_name}"
    setattr(forward, MAGIC_ATTR, attrs)
    return forward


def create_colocated_worker_cls(class_dict: dict[str, ClassWithInitArgs]) -> ClassWithInitArgs:
    """One worker class that hosts several roles in the same process (one process per device).

    Role `key`'s registered method `m` becomes `key_m` on the combined class; `WorkerGroup.spawn`
    turns the group back into one view per role. Roles share the process, its device and its
    torch.distributed group, so they take turns on the device instead of partitioning the hardware.
    Any backend's group can be built from the result.
    """
    from hflow.single_controller.base.worker import Worker

    if not class_dict:
        raise ValueError("create_colocated_worker_cls needs at least one role")
    roles = {role: (cwi.cls, cwi.args, cwi.kwargs) for role, cwi in class_dict.items()}
    for role, (cls, _, _) in roles.items():
        if not issubclass(cls, Worker):
            raise TypeError(f"role {role!r}: {cls.__name__} must subclass hflow's Worker")

    class WorkerDict(Worker):
        def __init__(self):
            super().__init__()
            self.worker_dict = {role: cls(*args, **kwargs) for role, (cls, args, kwargs) in roles.items()}

        def close(self):
            for worker in self.worker_dict.values():
                worker.close()

    for role, (cls, _, _) in roles.items():
        for method_name, attrs in registered_methods(cls).items():
            is_async = inspect.iscoroutinefunction(getattr(cls, method_name))
            setattr(WorkerDict, f"{role}_{method_name}", _forwarder(role, method_name, attrs, is_async))
    WorkerDict.__name__ = WorkerDict.__qualname__ = "WorkerDict_" + "_".join(roles)
    return ClassWithInitArgs(WorkerDict)
