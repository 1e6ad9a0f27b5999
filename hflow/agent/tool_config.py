"""Tools from a YAML file (verl's layout), and the built-in tools by name.

::

    tools:
      - class_name: hflow.agent.tools.CalculatorTool   # a BaseTool subclass by dotted path,
        config: {}                                      # or a built-in: calculator, python
        tool_schema: {type: function, function: {name: calculator, description: ..., parameters: {...}}}
      - function: my_tools.py:word_count                # or a plain function (sync or async) in a file;
        tool_schema: {...}                              # a relative path is read from the YAML's folder

A built-in may leave out ``tool_schema`` (it has a default). A function's keyword arguments must fit its
schema: each schema property is a parameter of the function, and each function parameter without a
default is a schema property. Every problem raises `ConfigError` naming the file, the tool's index and
the key, and what to change.
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Iterable, Mapping
from typing import Any

import yaml

from hflow.agent.tools import BaseTool, CalculatorTool, FunctionTool, PythonTool
from hflow.utils.errors import ConfigError, UserError
from hflow.utils.user_code import FileFunction

__all__ = ["BUILTIN_TOOLS", "builtin_tools", "load_tools", "tool_schemas"]

# Short names for `class_name`.
BUILTIN_TOOLS: dict[str, type[BaseTool]] = {"calculator": CalculatorTool, "python": PythonTool}
_ENTRY_KEYS = ("class_name", "function", "config", "tool_schema")


def load_tools(path: str) -> dict[str, BaseTool]:
    """The tools of the YAML file `path`, by name, in the file's order."""
    path = os.path.abspath(os.path.expanduser(str(path)))
    if not os.path.isfile(path):
        raise ConfigError(f"tool config {path}: no such file; point the tool config path at a YAML file with a "
                          "'tools:' list")
    try:
        with open(path, encoding="utf-8") as f:
            document = yaml.safe_load(f)
    except yaml.YAMLError as exc:
        raise ConfigError(f"tool config {path}: not valid YAML: {exc}") from None
    entries = document.get("tools") if isinstance(document, Mapping) else None
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"tool config {path}: 'tools' must be a non-empty list of tools (each with class_name "
                          f"or function, config and tool_schema), got {_describe(entries if entries is not None else document)}")
    tools: dict[str, BaseTool] = {}
    where_defined: dict[str, int] = {}
    for index, entry in enumerate(entries):
        tool = _load_entry(entry, path, index)
        if tool.name in tools:
            raise ConfigError(
                f"tool config {path}: tools[{index}].tool_schema.function.name={tool.name!r} is also the name of "
                f"tools[{where_defined[tool.name]}]; give each tool its own name")
        tools[tool.name] = tool
        where_defined[tool.name] = index
    return tools


def builtin_tools(names: Iterable[str] = ("calculator",)) -> dict[str, BaseTool]:
    """The built-in tools `names` with their default schemas and settings, by name."""
    tools: dict[str, BaseTool] = {}
    for name in names:
        if name not in BUILTIN_TOOLS:
            raise ConfigError(f"no built-in tool named {name!r}; the built-in tools are {', '.join(BUILTIN_TOOLS)}")
        tools[name] = BUILTIN_TOOLS[name]({}, None)
    return tools


def tool_schemas(tools: Mapping[str, BaseTool] | Iterable[BaseTool]) -> list[dict]:
    """The tools' OpenAI function schemas, in order: the chat template's ``tools=`` argument."""
    values = tools.values() if isinstance(tools, Mapping) else tools
    return [_plain(tool.tool_schema) for tool in values]


def _load_entry(entry: Any, path: str, index: int) -> BaseTool:
    where = f"tool config {path}: tools[{index}]"
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{where}: each tool must be a mapping with class_name or function, got {_describe(entry)}")
    unknown = [key for key in entry if key not in _ENTRY_KEYS]
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; a tool has {', '.join(_ENTRY_KEYS)}")
    if ("class_name" in entry) == ("function" in entry):
        raise ConfigError(f"{where}: give exactly one of class_name (a BaseTool class, or one of "
                          f"{', '.join(BUILTIN_TOOLS)}) and function (file.py:name)")
    config = entry.get("config")
    if config is None:
        config = {}
    if not isinstance(config, Mapping):
        raise ConfigError(f"{where}.config must be a mapping (or left out), got {_describe(config)}")
    config = _plain(config)
    kind = config.pop("type", "native")  # verl's files mark each tool "native" (or "mcp", a server's tools)
    if kind != "native":
        raise ConfigError(f"{where}.config.type={kind!r}: hflow runs native tools only (a class or a function); "
                          "drop the key or set it to native")
    if "class_name" in entry:
        cls = _tool_class(entry["class_name"], where)
        schema = entry.get("tool_schema")
        if schema is None and cls.default_schema() is None:
            raise ConfigError(f"{where}.tool_schema is missing; {cls.__name__} has no default schema: give "
                              "{type: function, function: {name, description, parameters}}")
        schema = cls.default_schema() if schema is None else _check_schema(schema, where)
        try:
            return cls(config, schema)
        except Exception as exc:  # noqa: BLE001 - reported with the entry it came from
            raise ConfigError(f"{where}: {entry['class_name']}(config, tool_schema) failed with "
                              f"{type(exc).__name__}: {exc}; fix {where}.config or .tool_schema") from exc
    if "tool_schema" not in entry:
        raise ConfigError(f"{where}.tool_schema is missing; a function tool needs "
                          "{type: function, function: {name, description, parameters}}")
    schema = _check_schema(entry["tool_schema"], where)
    fn = _load_function(entry["function"], path, index)
    _check_signature(fn, schema, where)
    return FunctionTool(config, schema, fn)


def _tool_class(class_name: Any, where: str) -> type[BaseTool]:
    if not isinstance(class_name, str) or not class_name:
        raise ConfigError(f"{where}.class_name must be a dotted class path or one of {', '.join(BUILTIN_TOOLS)}, "
                          f"got {_describe(class_name)}")
    if class_name in BUILTIN_TOOLS:
        return BUILTIN_TOOLS[class_name]
    module_name, _, attribute = class_name.rpartition(".")
    if not module_name:
        raise ConfigError(f"{where}.class_name={class_name!r}: not a built-in tool ({', '.join(BUILTIN_TOOLS)}) "
                          "nor a dotted path like package.module.MyTool")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any failure to import is the configuration's to fix
        raise ConfigError(f"{where}.class_name={class_name!r}: importing {module_name} failed with "
                          f"{type(exc).__name__}: {exc}; fix the module or the path") from exc
    cls = getattr(module, attribute, None)
    if cls is None:
        raise ConfigError(f"{where}.class_name={class_name!r}: module {module_name} has no {attribute!r}")
    if not (isinstance(cls, type) and issubclass(cls, BaseTool)):
        raise ConfigError(f"{where}.class_name={class_name!r} is not a subclass of hflow.agent.tools.BaseTool")
    if cls is FunctionTool:
        raise ConfigError(f"{where}.class_name: for a function tool, write function: file.py:name instead")
    return cls


def _check_schema(schema: Any, where: str) -> dict:
    function = schema.get("function") if isinstance(schema, Mapping) else None
    if not isinstance(function, Mapping):
        raise ConfigError(f"{where}.tool_schema must be {{type: function, function: {{name, description, "
                          f"parameters}}}}, got {_describe(schema)}")
    if schema.get("type", "function") != "function":
        raise ConfigError(f"{where}.tool_schema.type must be 'function', got {schema['type']!r}")
    name = function.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{where}.tool_schema.function.name is missing; name the tool (the model calls it by name)")
    parameters = function.get("parameters")
    if parameters is not None and not (isinstance(parameters, Mapping) and parameters.get("type", "object") == "object"
                                       and isinstance(parameters.get("properties", {}), Mapping)):
        raise ConfigError(f"{where}.tool_schema.function.parameters must be a JSON schema "
                          f"{{type: object, properties: {{...}}, required: [...]}}, got {_describe(parameters)}")
    return {"type": "function", **_plain(schema)}


def _load_function(spec: Any, config_path: str, index: int) -> FileFunction:
    where = f"tool config {config_path}: tools[{index}]"
    file, _, name = spec.rpartition(":") if isinstance(spec, str) else ("", "", "")
    if not file or not name:
        raise ConfigError(f"{where}.function must be 'path/to/file.py:function_name', got {_describe(spec)}")
    path = os.path.join(os.path.dirname(config_path), os.path.expanduser(file))
    if not os.path.isfile(path):
        raise ConfigError(f"{where}.function={spec!r}: {os.path.normpath(path)} does not exist (a relative path "
                          "is read from the tool config's folder)")
    try:
        return FileFunction(path, name, config_key=f"tools[{index}]", spec_key=f"tools[{index}].function")
    except UserError as exc:  # the file fails to import, or does not define the function (its message says which)
        raise ConfigError(f"tool config {config_path}: {exc}") from exc


def _check_signature(fn: FileFunction, schema: dict, where: str) -> None:
    function = fn.function
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return  # a builtin or extension function without a signature: checked when called
    parameters = (schema["function"].get("parameters") or {}).get("properties") or {}
    keyword = {p.name: p for p in signature.parameters.values()
               if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    fn_name = getattr(function, "__qualname__", fn.name)
    not_taken = [key for key in parameters if key not in keyword and not takes_any]
    if not_taken:
        raise ConfigError(f"{where}: the schema's parameter(s) {', '.join(map(repr, not_taken))} are not keyword "
                          f"arguments of {fn_name}{signature}; rename them in its "
                          "tool_schema.function.parameters.properties or add them to the function")
    unfilled = [p.name for p in signature.parameters.values() if p.default is p.empty and p.name not in parameters
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if unfilled:
        raise ConfigError(f"{where}: {fn_name}{signature} requires {', '.join(map(repr, unfilled))}, which its "
                          "tool_schema.function.parameters.properties does not list; add them to the schema or "
                          "give them defaults in the function")


def _plain(value: Any) -> Any:
    """A copy of `value` made of plain dicts and lists (YAML or OmegaConf containers in, JSON-like out)."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 80 else text[:80] + '...'}"
