"""`@register`: how a worker method is called from the driver.

A worker method decorated with `@register(dispatch_mode=..., execute_mode=..., blocking=...)` becomes,
on its worker group, one driver-side call that

1. *dispatches* the arguments into one set per rank (`Dispatch`),
2. *executes* the method on all ranks or on rank 0 (`Execute`),
3. waits for the results (unless `blocking=False`), and
4. *collects* them into one value (a concatenated `DataProto`, a list, ...).

Dispatch modes are members of an extensible enum backed by one registry of
`{"dispatch_fn", "collect_fn"}` pairs; `register_dispatch_mode` adds a mode and a custom mode may also
be given inline as such a dict.

Uneven batches: `DP_COMPUTE_PROTO` pads its `DataProto` arguments (positional and keyword) to a
multiple of the world size and tells each rank how many padding rows it holds. The rank strips the
outputs of those rows before returning, so results -- blocking or `DataProtoFuture` -- come back with
exactly as many rows as went in (times the method's repeat factor, e.g. `n` samples per prompt).
"""

from __future__ import annotations

from typing import Any, Callable

from hflow.protocol import DataProto, DataProtoFuture, pad_dataproto_to_divisor

# Attribute under which `register` stores a method's dispatch metadata (an unlikely name, so it never
# collides with a user's attribute).
MAGIC_ATTR = "__hflow_register__"

# Reserved keyword argument that carries a rank's shard information from the dispatcher to the worker.
SHARD_KWARG = "__hflow_shard__"


class _DynamicEnumMeta(type):
    def __iter__(cls):
        return iter(cls._members.values())

    def __contains__(cls, item) -> bool:
        if isinstance(item, str):
            return item.upper() in cls._members
        return isinstance(item, cls) and cls._members.get(item.name) is item

    def __getitem__(cls, name: str):
        return cls._members[name.upper()]

    def __len__(cls) -> int:
        return len(cls._members)


class DynamicEnum(metaclass=_DynamicEnumMeta):
    """An enum whose members can be added at run time (custom dispatch modes).

    Members are singletons that pickle by name, so a mode sent to a Ray actor is the same object there.
    """

    _members: dict[str, "DynamicEnum"] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._members = {}

    def __init__(self, name: str, value: int):
        self.name = name
        self.value = value

    def __repr__(self) -> str:
        return f"<{type(self).__name__}.{self.name}: {self.value}>"

    def __reduce__(self):
        return (type(self)._lookup_or_register, (self.name,))

    @classmethod
    def register(cls, name: str) -> "DynamicEnum":
        key = name.upper()
        if key in cls._members:
            raise ValueError(f"{cls.__name__}.{key} already exists")
        member = cls(key, max((m.value for m in cls._members.values()), default=-1) + 1)
        cls._members[key] = member
        setattr(cls, key, member)
        return member

    @classmethod
    def remove(cls, name: str) -> "DynamicEnum":
        key = name.upper()
        member = cls._members.pop(key)
        delattr(cls, key)
        return member

    @classmethod
    def from_name(cls, name: str) -> "DynamicEnum | None":
        return cls._members.get(name.upper())

    @classmethod
    def names(cls) -> list[str]:
        return list(cls._members)

    @classmethod
    def values(cls) -> list["DynamicEnum"]:
        return list(cls._members.values())

    @classmethod
    def _lookup_or_register(cls, name: str) -> "DynamicEnum":
        # A custom mode registered on the driver reaches a worker inside a pickled class.
        return cls._members.get(name) or cls.register(name)


class Dispatch(DynamicEnum):
    """How the driver turns one call's arguments into per-rank arguments (and back)."""


class Execute(DynamicEnum):
    """Which ranks run the method."""


for _name in ("RANK_ZERO", "ONE_TO_ALL", "ALL_TO_ALL", "DP_COMPUTE", "DP_COMPUTE_PROTO",
              "DP_COMPUTE_PROTO_WITH_FUNC", "DP_COMPUTE_METRIC"):
    Dispatch.register(_name)
for _name in ("ALL", "RANK_ZERO"):
    Execute.register(_name)


# --------------------------------------------------------------------------------------------------
# Dispatch and collect functions: dispatch (worker_group, *args, **kwargs) -> (args, kwargs) with one
# list entry per rank; collect (worker_group, outputs) -> result.
# --------------------------------------------------------------------------------------------------


def dispatch_all_to_all(worker_group, *args, **kwargs):
    """Arguments pass through: lists of world-size length are scattered by `execute_all`, others broadcast."""
    return args, kwargs


def collect_all_to_all(worker_group, outputs):
    return outputs


def dispatch_one_to_all(worker_group, *args, **kwargs):
    """Every rank receives the same arguments."""
    n = worker_group.world_size
    return tuple([arg] * n for arg in args), {key: [value] * n for key, value in kwargs.items()}


def dispatch_dp_compute(worker_group, *args, **kwargs):
    """The caller already split the data: every argument is a list with one entry per rank."""
    n = worker_group.world_size
    for name, value in _named_arguments(args, kwargs):
        if not isinstance(value, (list, tuple)) or len(value) != n:
            raise ValueError(
                f"DP_COMPUTE expects every argument to be a list with one entry per rank ({n}); "
                f"argument {name} is {_describe(value)}"
            )
    return args, kwargs


def collect_dp_compute(worker_group, outputs):
    if len(outputs) != worker_group.world_size:
        raise RuntimeError(f"expected {worker_group.world_size} outputs, got {len(outputs)}")
    return list(outputs)


def dispatch_dp_compute_data_proto(worker_group, *args, **kwargs):
    """Split every `DataProto` (or `DataProtoFuture`) argument into one equal chunk per rank.

    Uneven batches are padded by cycling rows from the start; each rank learns how many of its rows are
    padding (through `SHARD_KWARG`) and strips their outputs. A future's length is unknown on the driver,
    so the receiving rank materialises it and pads it itself.
    """
    n = worker_group.world_size
    lengths = {}
    has_future = False
    for name, value in _named_arguments(args, kwargs):
        if isinstance(value, DataProto):
            lengths[name] = len(value)
        elif isinstance(value, DataProtoFuture):
            has_future = True
        else:
            raise TypeError(
                f"DP_COMPUTE_PROTO expects DataProto or DataProtoFuture arguments; argument {name} is "
                f"{_describe(value)}. Wrap tensors with DataProto.from_dict or use another dispatch mode."
            )
    if len(set(lengths.values())) > 1:
        raise ValueError(
            "DP_COMPUTE_PROTO got DataProto arguments of different lengths "
            f"({', '.join(f'{k}={v}' for k, v in lengths.items())}); they are split row-wise and must match"
        )
    length = next(iter(lengths.values()), None)

    def split(value):
        if isinstance(value, DataProtoFuture):
            return [value] * n  # materialised, padded and chunked on the receiving rank
        padded, _ = pad_dataproto_to_divisor(value, n)
        return padded.chunk(n)

    args = tuple(split(arg) for arg in args)
    kwargs = {key: split(value) for key, value in kwargs.items()}
    pad_rows = padding_rows_per_rank(length, n) if length is not None else [0] * n
    if has_future or any(pad_rows):
        kwargs[SHARD_KWARG] = [{"rank": i, "world_size": n, "pad_rows": pad_rows[i]} for i in range(n)]
    return args, kwargs


def dispatch_dp_compute_data_proto_with_func(worker_group, func, *args, **kwargs):
    """Like DP_COMPUTE_PROTO, with a plain function as the first argument sent to every rank."""
    if not callable(func):
        raise TypeError(f"DP_COMPUTE_PROTO_WITH_FUNC expects a function first, got {_describe(func)}")
    args, kwargs = dispatch_dp_compute_data_proto(worker_group, *args, **kwargs)
    return ([func] * worker_group.world_size, *args), kwargs


def collect_dp_compute_data_proto(worker_group, outputs):
    """Concatenate per-rank DataProtos, or (non-blocking) wrap the per-rank pending results in a future.

    A backend that runs calls eagerly (the local one) hands over DataProtos even for `blocking=False`.
    """
    if all(isinstance(out, DataProto) for out in outputs):
        return DataProto.concat(list(outputs))
    if all(_is_pending_result(out) for out in outputs):
        return DataProtoFuture.concat(list(outputs))
    raise TypeError(
        "DP_COMPUTE_PROTO methods must return a DataProto on every rank; got "
        + ", ".join(type(out).__name__ for out in outputs)
    )


def _is_pending_result(value) -> bool:
    """A Ray object ref, recognised without importing Ray (the local backend must not need it)."""
    return type(value).__name__ == "ObjectRef" and type(value).__module__.startswith("ray")


DISPATCH_MODE_FN_REGISTRY: dict[Dispatch, dict[str, Callable]] = {
    # RANK_ZERO as a dispatch mode means: pass the arguments through and run on rank 0 only.
    Dispatch.RANK_ZERO: {"dispatch_fn": dispatch_all_to_all, "collect_fn": collect_all_to_all},
    Dispatch.ONE_TO_ALL: {"dispatch_fn": dispatch_one_to_all, "collect_fn": collect_all_to_all},
    Dispatch.ALL_TO_ALL: {"dispatch_fn": dispatch_all_to_all, "collect_fn": collect_all_to_all},
    Dispatch.DP_COMPUTE: {"dispatch_fn": dispatch_dp_compute, "collect_fn": collect_dp_compute},
    Dispatch.DP_COMPUTE_PROTO: {
        "dispatch_fn": dispatch_dp_compute_data_proto,
        "collect_fn": collect_dp_compute_data_proto,
    },
    Dispatch.DP_COMPUTE_PROTO_WITH_FUNC: {
        "dispatch_fn": dispatch_dp_compute_data_proto_with_func,
        "collect_fn": collect_dp_compute_data_proto,
    },
    Dispatch.DP_COMPUTE_METRIC: {
        "dispatch_fn": dispatch_dp_compute_data_proto,
        "collect_fn": collect_dp_compute,
    },
}

EXECUTE_MODE_FN_NAMES: dict[Execute, str] = {
    Execute.ALL: "execute_all",
    Execute.RANK_ZERO: "execute_rank_zero",
}


def get_predefined_dispatch_fn(dispatch_mode: Dispatch) -> dict[str, Callable]:
    return DISPATCH_MODE_FN_REGISTRY[dispatch_mode]


def get_predefined_execute_fn(execute_mode: Execute) -> dict[str, str]:
    return {"execute_fn_name": EXECUTE_MODE_FN_NAMES[execute_mode]}


def register_dispatch_mode(name: str, dispatch_fn: Callable, collect_fn: Callable) -> Dispatch:
    """Add a named dispatch mode, usable as `Dispatch.<NAME>` in `@register`."""
    if name.upper() in Dispatch:
        raise ValueError(f"dispatch mode {name.upper()} already exists; use update_dispatch_mode to change it")
    mode = Dispatch.register(name)
    DISPATCH_MODE_FN_REGISTRY[mode] = {"dispatch_fn": dispatch_fn, "collect_fn": collect_fn}
    return mode


def update_dispatch_mode(dispatch_mode: Dispatch, dispatch_fn: Callable, collect_fn: Callable) -> None:
    if dispatch_mode not in DISPATCH_MODE_FN_REGISTRY:
        raise KeyError(f"dispatch mode {dispatch_mode} is not registered")
    DISPATCH_MODE_FN_REGISTRY[dispatch_mode] = {"dispatch_fn": dispatch_fn, "collect_fn": collect_fn}


def resolve_dispatch_fns(dispatch_mode) -> dict[str, Callable]:
    """The dispatch/collect pair of a registered mode or of an inline custom-mode dict."""
    if isinstance(dispatch_mode, dict):
        return {"dispatch_fn": dispatch_mode["dispatch_fn"], "collect_fn": dispatch_mode["collect_fn"]}
    return get_predefined_dispatch_fn(dispatch_mode)


def _check_dispatch_mode(dispatch_mode) -> None:
    if isinstance(dispatch_mode, dict):
        missing = {"dispatch_fn", "collect_fn"} - set(dispatch_mode)
        if missing:
            raise ValueError(f"a custom dispatch mode needs keys 'dispatch_fn' and 'collect_fn'; missing {sorted(missing)}")
        return
    if dispatch_mode not in Dispatch or dispatch_mode not in DISPATCH_MODE_FN_REGISTRY:
        raise ValueError(f"dispatch_mode must be one of {Dispatch.names()} or a custom dict, got {dispatch_mode!r}")


def _check_execute_mode(execute_mode) -> None:
    if execute_mode not in Execute:
        raise ValueError(f"execute_mode must be one of {Execute.names()}, got {execute_mode!r}")


# --------------------------------------------------------------------------------------------------
# The decorator and its worker-side wrapper
# --------------------------------------------------------------------------------------------------


def register(dispatch_mode=Dispatch.ALL_TO_ALL, execute_mode=Execute.ALL, blocking: bool = True,
             materialize_futures: bool = True):
    """Declare how a worker method is dispatched to ranks, executed and collected.

    The decorator only records this metadata on the function (under `MAGIC_ATTR`); the method itself
    is unchanged. Worker groups of every backend read it when they are built (see
    `hflow.single_controller.base.worker_group`). `Dispatch.RANK_ZERO` implies `Execute.RANK_ZERO`;
    `ONE_TO_ALL` with `Execute.RANK_ZERO` gives rank 0 the arguments as they are.
    `materialize_futures=False` hands `DataProtoFuture` arguments to the method unresolved.
    """
    _check_dispatch_mode(dispatch_mode)
    _check_execute_mode(execute_mode)
    if dispatch_mode is Dispatch.RANK_ZERO:
        execute_mode = Execute.RANK_ZERO
    if dispatch_mode is Dispatch.ONE_TO_ALL and execute_mode is Execute.RANK_ZERO:
        # "Same arguments to every executing rank" with one executing rank: pass them through unreplicated.
        dispatch_mode = Dispatch.ALL_TO_ALL
    attrs = {"dispatch_mode": dispatch_mode, "execute_mode": execute_mode, "blocking": blocking,
             "materialize_futures": materialize_futures}

    def decorator(func):
        setattr(func, MAGIC_ATTR, attrs)
        return func

    return decorator


def padding_rows_per_rank(length: int, world_size: int) -> list[int]:
    """How many of each rank's rows are padding when `length` rows are padded to a multiple of world_size."""
    padded = -(-length // world_size) * world_size
    chunk = padded // world_size
    return [max(0, min((i + 1) * chunk, padded) - max(i * chunk, length)) for i in range(world_size)]


def prepare_inputs(args, kwargs, materialize_futures: bool):
    """Worker side: resolve futures into this rank's chunk and read how many of its rows are padding."""
    shard = kwargs.pop(SHARD_KWARG, None)
    pad_rows = shard["pad_rows"] if shard else 0
    in_rows = None

    def resolve(value):
        nonlocal pad_rows, in_rows
        if isinstance(value, DataProtoFuture) and materialize_futures:
            if shard is None:
                return value.get()
            full = value.get()
            padded, _ = pad_dataproto_to_divisor(full, shard["world_size"])
            pad_rows = padding_rows_per_rank(len(full), shard["world_size"])[shard["rank"]]
            value = padded.chunk(shard["world_size"])[shard["rank"]]
        if isinstance(value, DataProto) and in_rows is None:
            in_rows = len(value)
        return value

    args = tuple(resolve(arg) for arg in args)
    kwargs = {key: resolve(value) for key, value in kwargs.items()}
    return args, kwargs, pad_rows, in_rows


def strip_padding(output, pad_rows: int, in_rows: int | None):
    """Drop the outputs of padding rows: the last `pad_rows` inputs, times the method's repeat factor."""
    if not pad_rows or not isinstance(output, DataProto) or not in_rows:
        return output
    out_rows = len(output)
    if out_rows == 0 or out_rows % in_rows:
        return output  # not row-aligned with the input (e.g. metrics only): nothing to strip
    keep = out_rows - pad_rows * (out_rows // in_rows)
    return output[:keep]


def _named_arguments(args, kwargs):
    yield from ((f"#{i}", arg) for i, arg in enumerate(args))
    yield from ((repr(key), value) for key, value in kwargs.items())


def _describe(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of length {len(value)}"
    return f"a {type(value).__name__}"
