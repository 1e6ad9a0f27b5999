"""Tools the model calls during a multi-turn rollout, and the one safe way to run a call.

A tool is a `BaseTool` (verl's interface, async): ``create`` an instance for a call (with the row's
``create_kwargs``), ``execute`` it with the model's arguments (and the row's ``execute_kwargs``), and
``release`` it. Built in: `CalculatorTool` (``calculator``, exact arithmetic) and `PythonTool`
(``python``, code run in `hflow.sandbox`); `FunctionTool` wraps a plain Python function.

`run_tool_call` runs one parsed call and never raises: an unknown tool, arguments that do not fit the
tool's schema, a tool that raises or one that runs past its deadline each become a `ToolOutcome` whose
text starts with ``Error:`` (the model reads it and can do better) and whose `error` names the kind.

Blocking work runs in threads of this module's own pool, never on the event loop: so many samples'
calls run at once, and a call abandoned at its deadline cannot starve the loop's default executor.
A thread cannot be stopped, so a sync function that never returns keeps its thread; code that may
hang or is untrusted belongs in the sandbox, which stops it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import functools
import inspect
import json
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hflow.agent.calculator import evaluate
from hflow.agent.parsers import ToolCall, json_type

__all__ = [
    "BaseTool",
    "CalculatorTool",
    "FunctionTool",
    "PythonTool",
    "ToolError",
    "ToolOutcome",
    "create_instance",
    "finished_within",
    "malformed_outcome",
    "run_in_thread",
    "run_tool_call",
    "use_tool_threads",
    "validate_arguments",
]

# Threads for blocking tool work (sync functions, the sandbox): calls wait on I/O or on a child
# process, so there are many more than cores.
_POOL_THREADS = 64
# After the deadline the call is cancelled; its `release` (in a finally) gets this long before the
# outcome is returned without waiting for it.
_CANCEL_GRACE_S = 1.0
# How much of an exception's message an error outcome quotes.
_MESSAGE_CHARS = 1000

_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


class ToolError(Exception):
    """Raised by a tool that cannot do the call with these arguments (division by zero, say).

    `run_tool_call` shows the model ``Error: <message>`` (no exception type) with kind "bad_arguments".
    """


def _function_schema(name: str, description: str, parameter: str, parameter_description: str) -> dict:
    """An OpenAI function schema with one required string parameter."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {parameter: {"type": "string", "description": parameter_description}},
                "required": [parameter],
            },
        },
    }


def use_tool_threads(count: int) -> None:
    """Size the pool that sync tools and the sandbox run in (a rollout sets `multi_turn.max_concurrent_tools`):
    that many blocking calls wait side by side. Calls already running finish in the old pool."""
    global _pool
    with _pool_lock:
        if _pool is not None and _pool._max_workers == count:
            return
        old, _pool = _pool, concurrent.futures.ThreadPoolExecutor(count, thread_name_prefix="hflow-tool")
    if old is not None:
        old.shutdown(wait=False)


async def run_in_thread(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` in a thread of the tool pool, awaited without blocking the event loop."""
    if _pool is None:
        use_tool_threads(_POOL_THREADS)
    return await asyncio.get_running_loop().run_in_executor(_pool, functools.partial(fn, *args, **kwargs))


class BaseTool(ABC):
    """A tool: an OpenAI function schema and async create / execute / calc_reward / release.

    `tool_schema` is ``{"type": "function", "function": {"name", "description", "parameters"}}``;
    `config` is the tool's own settings. A subclass that sets `DEFAULT_SCHEMA` may be built without one.
    `create` keeps the row's create kwargs in ``self.instances[instance_id]`` until `release`.
    The agent loop creates one instance per tool and episode (with the row's create_kwargs), runs every
    call of the episode on it (so a tool can keep state across turns), and at the episode's end asks its
    `calc_reward` and `release`s it, whatever ended the episode: verl's lifecycle.
    """

    DEFAULT_SCHEMA: dict | None = None

    def __init__(self, config: dict | None = None, tool_schema: dict | None = None) -> None:
        if tool_schema is None:
            tool_schema = self.default_schema()
            if tool_schema is None:
                raise ValueError(f"{type(self).__name__} has no default schema: pass tool_schema")
        function = tool_schema.get("function") if isinstance(tool_schema, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(
                f"{type(self).__name__}: tool_schema must be {{'type': 'function', 'function': {{'name': ..., "
                f"'description': ..., 'parameters': {{...}}}}}}, got {tool_schema!r}")
        self.config: dict = dict(config or {})
        self.tool_schema: dict = dict(tool_schema)
        self.instances: dict[str, dict] = {}

    @classmethod
    def default_schema(cls) -> dict | None:
        """The schema the tool has when the configuration gives none (None: it must give one)."""
        return copy.deepcopy(cls.DEFAULT_SCHEMA)

    @property
    def name(self) -> str:
        return self.tool_schema["function"]["name"]

    @property
    def parameters(self) -> dict:
        """The JSON schema of the arguments (an object schema; ``{}`` when the schema has none)."""
        return self.tool_schema["function"].get("parameters") or {}

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """Start an instance for one call; `kwargs` are the row's create_kwargs. Returns its id."""
        instance_id = instance_id or uuid.uuid4().hex
        self.instances[instance_id] = dict(kwargs)
        return instance_id

    @abstractmethod
    async def execute(self, instance_id: str, parameters: dict, **kwargs: Any) -> tuple[str, float, dict]:
        """Run the call: (text the model sees, step reward, metrics); `kwargs` are the row's execute_kwargs."""

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self.instances.pop(instance_id, None)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class FunctionTool(BaseTool):
    """A plain Python function as a tool: its keyword arguments are the schema's parameters.

    The function gets the model's arguments, then the row's create_kwargs and execute_kwargs (these
    win, so the model cannot override what the data set fixes: give such parameters defaults and leave
    them out of the schema). Sync functions run in a thread; async ones are awaited. It returns the
    text the model sees; anything else is sent as JSON (or ``str()`` when it is not JSON).
    """

    def __init__(self, config: dict | None, tool_schema: dict, fn: Callable[..., Any]) -> None:
        super().__init__(config, tool_schema)
        if not callable(fn):
            raise TypeError(f"FunctionTool {self.name!r}: fn must be callable, got {fn!r}")
        self.fn = fn

    async def execute(self, instance_id: str, parameters: dict, **kwargs: Any) -> tuple[str, float, dict]:
        call_kwargs = {**parameters, **self.instances.get(instance_id, {}), **kwargs}
        target = getattr(self.fn, "function", self.fn)  # a FileFunction: the function it holds
        if inspect.iscoroutinefunction(target):
            result = await self.fn(**call_kwargs)
        else:
            result = await run_in_thread(self.fn, **call_kwargs)
            if inspect.isawaitable(result):
                result = await result
        return _as_text(result), 0.0, {}


class CalculatorTool(BaseTool):
    """``calculator``: the exact value of an arithmetic expression (`hflow.agent.calculator.evaluate`)."""

    DEFAULT_SCHEMA = _function_schema(
        "calculator",
        "Evaluate an arithmetic expression exactly. Supports + - * / // % ** (or ^) and parentheses; "
        "returns an integer, a decimal, or a fraction a/b.",
        "expression", "The expression, e.g. (37 * 86) / 4")

    async def execute(self, instance_id: str, parameters: dict, **kwargs: Any) -> tuple[str, float, dict]:
        try:
            return evaluate(parameters["expression"]), 0.0, {}
        except ValueError as exc:
            raise ToolError(str(exc)) from None


class PythonTool(BaseTool):
    """``python``: runs the code in `hflow.sandbox` (a fresh process with limits), in a thread.

    `config`: ``max_output_chars`` (default 2000) bounds the text the model sees; every other key
    (backend, url, limits, ...) is the sandbox's configuration, given to ``make_sandbox``. The text is
    the program's stdout, then its stderr, its exit code when not 0 and the limit it hit, if any.
    """

    DEFAULT_SCHEMA = _function_schema(
        "python",
        "Run a Python program in a sandbox (no network, no files kept) and return what it prints. "
        "Use print() to see values.",
        "code", "The complete Python program")

    def __init__(self, config: dict | None = None, tool_schema: dict | None = None) -> None:
        super().__init__(config, tool_schema)
        from hflow.sandbox import make_sandbox  # imported here: the other tools do not need it

        self.max_output_chars = int(self.config.get("max_output_chars", 2000))
        if self.max_output_chars < 1:
            raise ValueError(f"python tool: max_output_chars must be >= 1, got {self.max_output_chars}")
        self.sandbox = make_sandbox({k: v for k, v in self.config.items() if k != "max_output_chars"} or None)

    async def execute(self, instance_id: str, parameters: dict, **kwargs: Any) -> tuple[str, float, dict]:
        result = await run_in_thread(self.sandbox.run, parameters["code"])
        if result.status == "sandbox_error":  # the sandbox failed, not the program: the tool's fault
            raise RuntimeError(f"the sandbox failed: {result.stderr.strip()[-_MESSAGE_CHARS:]}")
        notes = []
        if result.limit_hit:
            notes.append(f"[stopped: {result.limit_hit} limit hit]")
        elif result.exit_code not in (0, None):
            notes.append(f"[exit code {result.exit_code}]")
        stdout, stderr = _share(result.stdout, result.stderr, self.max_output_chars)
        text = stdout
        for piece in ([f"[stderr]\n{stderr}"] if stderr else []) + notes:
            text += ("" if not text or text.endswith("\n") else "\n") + piece
        text = text or "(no output)"
        metrics = {"sandbox_s": float(result.duration_s or 0.0), "limit_hit": float(bool(result.limit_hit))}
        return text, 0.0, metrics


@dataclass
class ToolOutcome:
    """What one call came to: `text` is the tool message the model sees; `error` the kind of failure."""

    text: str
    error: str | None  # None | "malformed" | "unknown_tool" | "bad_arguments" | "raised" | "timeout"
    seconds: float
    reward: float = 0.0
    metrics: dict = field(default_factory=dict)


def malformed_outcome(message: str) -> ToolOutcome:
    """The outcome sent back for a block the parser could not read (`ParsedTurn.malformed`)."""
    return ToolOutcome(text=_error_text(message), error="malformed", seconds=0.0)


async def run_tool_call(
    tools: Mapping[str, BaseTool],
    call: ToolCall,
    *,
    tools_kwargs: Mapping | None = None,
    timeout_s: float = 30.0,
    instances: Mapping[str, str] | None = None,
) -> ToolOutcome:
    """Run `call` with its tool within `timeout_s`: on the episode's instance of the tool when `instances`
    (tool name -> instance id) has one, so the tool keeps its state across the episode's calls; else on
    an instance of its own (create, execute, release always).

    `tools_kwargs` is the row's ``extra_info.tools_kwargs``: ``{name: {"create_kwargs": {...},
    "execute_kwargs": {...}}}``. Never raises (but a cancellation of the caller propagates).
    """
    start = time.perf_counter()

    def outcome(text: str, error: str | None, reward: float = 0.0, metrics: dict | None = None) -> ToolOutcome:
        return ToolOutcome(text, error, time.perf_counter() - start, reward, metrics or {})

    try:
        return await _run_call(tools, call, tools_kwargs, timeout_s, outcome, instances or {})
    except Exception as exc:  # noqa: BLE001 - a bad tools_kwargs row or schema: still an outcome, never a raise
        return outcome(_error_text(f"{type(exc).__name__}: {_clip(str(exc), _MESSAGE_CHARS)}"), "raised")


async def _run_call(tools: Mapping[str, BaseTool], call: ToolCall, tools_kwargs: Mapping | None, timeout_s: float,
                    outcome: Callable[..., ToolOutcome], instances: Mapping[str, str]) -> ToolOutcome:
    tool = tools.get(call.name)
    if tool is None:
        available = ", ".join(tools) or "none"
        return outcome(_error_text(f"unknown tool {call.name!r}; the available tools are: {available}"), "unknown_tool")
    problems = validate_arguments(tool.parameters, call.arguments)
    if problems:
        return outcome(_error_text(f"bad arguments for {call.name}: {'; '.join(problems)}"), "bad_arguments")
    row = (tools_kwargs or {}).get(call.name) or {}
    if call.name in instances:
        task = asyncio.ensure_future(_execute(tool, instances[call.name], dict(call.arguments),
                                              row.get("execute_kwargs") or {}))
    else:
        task = asyncio.ensure_future(_create_execute_release(
            tool, dict(call.arguments), row.get("create_kwargs") or {}, row.get("execute_kwargs") or {}))
    if not await finished_within(task, timeout_s):
        return outcome(_error_text(f"the call to {call.name} timed out after {timeout_s:g} s"), "timeout")
    try:
        text, reward, metrics = task.result()
    except ToolError as exc:
        return outcome(_error_text(_clip(str(exc), _MESSAGE_CHARS)), "bad_arguments")
    except asyncio.CancelledError:  # the tool cancelled itself
        return outcome(_error_text(f"the call to {call.name} was cancelled"), "raised")
    except Exception as exc:  # noqa: BLE001 - any failure of the tool is reported to the model
        return outcome(_error_text(f"{type(exc).__name__}: {_clip(str(exc), _MESSAGE_CHARS)}"), "raised")
    return outcome(text, None, reward, metrics)


async def create_instance(tool: BaseTool, create_kwargs: Mapping) -> str:
    """A new instance of `tool` for the row's `create_kwargs`; its id. verl's tools return
    ``(instance_id, response)`` from ``create``; hflow's the id alone: both are taken."""
    created = await tool.create(uuid.uuid4().hex, **create_kwargs)
    instance_id = created[0] if isinstance(created, tuple) else created
    if not isinstance(instance_id, str):
        raise TypeError(f"{type(tool).__name__}.create returned {created!r}, not an instance id (str)")
    return instance_id


async def _create_execute_release(tool: BaseTool, arguments: dict, create_kwargs: Mapping,
                                  execute_kwargs: Mapping) -> tuple[str, float, dict]:
    instance_id = await create_instance(tool, create_kwargs)
    try:
        return await _execute(tool, instance_id, arguments, execute_kwargs)
    finally:
        await tool.release(instance_id)


async def _execute(tool: BaseTool, instance_id: str, arguments: dict, execute_kwargs: Mapping) -> tuple[str, float, dict]:
    result = await tool.execute(instance_id, arguments, **execute_kwargs)
    if isinstance(result, tuple) and len(result) == 3:
        text, reward, metrics = result
        text = getattr(text, "text", text)  # verl's ToolResponse carries its text in .text
        return _as_text("" if text is None else text), float(reward or 0.0), dict(metrics or {})
    raise TypeError(f"{type(tool).__name__}.execute returned {type(result).__name__}, "
                    "not a tuple (text, reward, metrics)")


async def finished_within(task: asyncio.Future, timeout_s: float) -> bool:
    """Whether `task` (a call into user code) finished within `timeout_s`. If not it is cancelled, its
    cleanup (a tool's release in its finally) gets a short grace, and it is abandoned, never awaited again;
    a cancellation of the caller cancels it too."""
    try:
        await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if task.done():
        return True
    task.cancel()
    await asyncio.wait({task}, timeout=_CANCEL_GRACE_S)
    task.add_done_callback(_retrieve)
    return False


def _retrieve(task: asyncio.Future) -> None:
    """Done callback of an abandoned call: consume its result, so asyncio does not log it as lost."""
    if not task.cancelled():
        task.exception()


def validate_arguments(schema: dict, arguments: dict) -> list[str]:
    """What is wrong with `arguments` for `schema` (an object JSON schema, or a whole tool schema); [] when fine.

    Checks required keys, unknown keys when ``additionalProperties`` is false, the JSON types (string,
    number, integer, boolean, array, object, null; a list of types means any of them) and ``enum``,
    inside arrays (``items``) and nested objects too. An integer must be a JSON integer (3, not 3.0).
    """
    if isinstance(schema, Mapping) and isinstance(schema.get("function"), Mapping):
        schema = schema["function"].get("parameters") or {}
    if not isinstance(arguments, Mapping):
        return [f"the arguments must be a JSON object, not {json_type(arguments)}"]
    problems: list[str] = []
    _check_object(schema or {}, arguments, "", problems)
    return problems


_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, Mapping),
    "null": lambda v: v is None,
}


def _check_object(schema: Mapping, value: Mapping, path: str, problems: list[str]) -> None:
    properties = schema.get("properties") or {}
    for key in schema.get("required") or []:
        if key not in value:
            problems.append(f"missing required argument {path}{key!r}")
    if schema.get("additionalProperties") is False:
        unknown = [key for key in value if key not in properties]
        if unknown:
            expected = ", ".join(properties) or "none"
            problems.append(f"unknown argument(s) {', '.join(map(repr, unknown))} (expected: {expected})")
    for key, item in value.items():
        if isinstance(properties.get(key), Mapping):
            _check_value(properties[key], item, f"{path}{key!r}", problems)


def _check_value(schema: Mapping, value: Any, where: str, problems: list[str]) -> None:
    types = schema.get("type")
    types = [types] if isinstance(types, str) else list(types or [])
    known = [t for t in types if t in _JSON_TYPES]
    if known and not any(_JSON_TYPES[t](value) for t in known):
        problems.append(f"argument {where} must be {' or '.join(known)}, not {json_type(value)} ({_clip(repr(value), 80)})")
        return
    if "enum" in schema and value not in schema["enum"]:
        problems.append(f"argument {where} must be one of {schema['enum']!r}, not {_clip(repr(value), 80)}")
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for index, item in enumerate(value):
            _check_value(schema["items"], item, f"{where}[{index}]", problems)
    elif isinstance(value, Mapping) and ("properties" in schema or "required" in schema):
        _check_object(schema, value, f"{where}.", problems)


def _share(stdout: str, stderr: str, budget: int) -> tuple[str, str]:
    """stdout and stderr clipped to `budget` characters together (each gets at least half when both are long)."""
    stdout, stderr = stdout or "", stderr or ""
    stderr_budget = min(len(stderr), max(budget // 2, budget - len(stdout)))
    return _clip(stdout, budget - stderr_budget), _clip(stderr, stderr_budget)


def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}\n... [{len(text) - limit} more characters cut]"


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def _error_text(message: str) -> str:
    return message if message.startswith("Error:") else f"Error: {message}"
