"""Environments: stateful episodes the model acts in, one instance per episode.

An environment is a class with ``reset(row) -> first observation`` and ``step(action) -> (observation,
reward, done, info)`` (and optionally ``close()``), each a plain or an ``async`` method. The agent loop
builds a fresh instance for every episode (``cls(config)``), resets it with the row (``data_source``,
``extra_info``, ``agent_name``), steps it with each assistant turn that calls no tool, and closes it when
the episode ends, whatever ends it (an answer, a limit, an error, a timeout, or the rollout stopping).

Its observations enter the trajectory as user messages rendered by the chat template (loss mask 0), its
rewards sit on the last sampled token of the turn they judge. ``done`` ends the episode (its
observation, if any, is not shown). An environment that raises, runs past ``multi_turn.env_timeout_s``
or returns something malformed ends its episode with a named reason (``env_error``, ``env_timeout``,
``env_malformed``), counted in ``agent/ended/*``; the rollout goes on.

The environments come from a YAML file (``multi_turn.env_config_path``)::

    envs:
      - name: counter                      # what a row's agent_name selects
        class_name: my_envs.py:CounterEnv  # a class in a file (relative to the YAML's folder) or package.module.Class
        config: {limit: 5}                 # passed to the constructor
        data_sources: [counter_game]       # rows of these data sources use it (a row's agent_name wins)
"""

from __future__ import annotations

import importlib
import inspect
import os
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from hflow.utils.errors import ConfigError, UserError
from hflow.utils.user_code import LOADED_FILES, exec_file

# `agent_name`s of verl's built-in agent loops (a verl data set names them): hflow's loop is both.
VERL_AGENT_LOOPS = ("tool_agent", "single_turn_agent")

__all__ = ["BaseEnv", "EnvSpec", "EnvTable", "load_class", "load_envs", "read_yaml_list"]


class BaseEnv(ABC):
    """An episode's world. Subclasses keep whatever state they need on `self`: one instance per episode."""

    def __init__(self, config: dict | None = None) -> None:
        self.config: dict = dict(config or {})

    @abstractmethod
    def reset(self, row: Mapping[str, Any]) -> str | None:
        """Start the episode for `row` (``data_source``, ``extra_info``, ``agent_name``). Returns the first
        observation (shown as a user message before the first turn) or None (the prompt is enough)."""

    @abstractmethod
    def step(self, action: str) -> tuple[str | None, float, bool, dict]:
        """The model's turn (its text) -> (observation, reward for this turn, done, info)."""

    def close(self) -> None:
        """Release what the episode held; called once, whatever ended it."""


@dataclass
class EnvSpec:
    """One entry of the environment file."""

    name: str
    cls: type
    config: dict = field(default_factory=dict)
    data_sources: list[str] = field(default_factory=list)

    def make(self) -> Any:
        return self.cls(dict(self.config))


class EnvTable:
    """The environments by name, and which one a row uses: its ``agent_name`` when it names one, else
    its ``data_source``'s, else none."""

    def __init__(self, specs: list[EnvSpec], path: str = "") -> None:
        self.path = path
        self.by_name = {spec.name: spec for spec in specs}
        self.by_source = {source: spec for spec in specs for source in spec.data_sources}

    def for_row(self, row: Mapping[str, Any], where: str) -> EnvSpec | None:
        name = row.get("agent_name")
        if name in VERL_AGENT_LOOPS:  # a verl data set's own loops: the loop hflow runs anyway
            name = None
        if name is not None and name in self.by_name:
            return self.by_name[name]
        if name is not None and not self.by_source.get(row.get("data_source")):
            raise UserError(f"{where}: agent_name={name!r} names no environment of {self.path} (it has "
                            f"{', '.join(self.by_name) or 'none'}); fix the row or add the environment")
        return self.by_source.get(row.get("data_source"))


def load_envs(path: str) -> EnvTable:
    """The environment file `path` (module docstring); every problem is a `ConfigError` naming the entry."""
    entries, path = read_yaml_list(path, "envs", "environment config")
    specs: list[EnvSpec] = []
    taken: dict[str, int] = {}
    sources: dict[str, int] = {}
    for index, entry in enumerate(entries):
        where = f"environment config {path}: envs[{index}]"
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{where} must be a mapping with name, class_name, config, data_sources")
        unknown = sorted(set(entry) - {"name", "class_name", "config", "data_sources"})
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {unknown}; an environment has name, class_name, config, "
                              "data_sources")
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}.name is missing; name the environment (a row's agent_name selects it)")
        if name in taken:
            raise ConfigError(f"{where}.name={name!r} is also envs[{taken[name]}]'s; give each its own name")
        taken[name] = index
        cls = load_class(entry.get("class_name"), path, f"{where}.class_name")
        for method in ("reset", "step"):
            if not callable(getattr(cls, method, None)):
                raise ConfigError(f"{where}.class_name: {cls.__name__} has no {method}() method; an environment "
                                  "has reset(row) and step(action) (see hflow.agent.env.BaseEnv)")
        config = entry.get("config") or {}
        if not isinstance(config, Mapping):
            raise ConfigError(f"{where}.config must be a mapping, got {type(config).__name__}")
        data_sources = entry.get("data_sources") or []
        if isinstance(data_sources, str) or not all(isinstance(s, str) for s in data_sources):
            raise ConfigError(f"{where}.data_sources must be a list of data_source names, got {data_sources!r}")
        for source in data_sources:
            if source in sources:
                raise ConfigError(f"{where}.data_sources: {source!r} is also in envs[{sources[source]}]; a data "
                                  "source has one environment")
            sources[source] = index
        spec = EnvSpec(name, cls, dict(config), list(data_sources))
        try:
            probe = spec.make()
        except Exception as exc:  # noqa: BLE001 - reported with the entry it came from
            raise ConfigError(f"{where}: {cls.__name__}(config) failed with {type(exc).__name__}: {exc}; fix "
                              f"{where}.config") from exc
        close = getattr(probe, "close", None)
        if callable(close) and not inspect.iscoroutinefunction(close):
            close()
        specs.append(spec)
    return EnvTable(specs, path)


def read_yaml_list(path: str, key: str, what: str) -> tuple[list, str]:
    """The non-empty list under `key` of the YAML file `path` (and the absolute path)."""
    path = os.path.abspath(os.path.expanduser(str(path)))
    if not os.path.isfile(path):
        raise ConfigError(f"{what} {path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            document = yaml.safe_load(f)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} {path}: not valid YAML: {exc}") from None
    entries = document.get(key) if isinstance(document, Mapping) else None
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{what} {path}: '{key}' must be a non-empty list, got {entries!r}")
    return entries, path


def load_class(spec: Any, config_path: str, key: str) -> type:
    """A class named ``path/to/file.py:Class`` (a relative path from the YAML's folder) or
    ``package.module.Class``; a `ConfigError` naming `key` otherwise."""
    if not isinstance(spec, str) or not spec:
        raise ConfigError(f"{key} is missing; give file.py:ClassName or package.module.ClassName")
    if ":" in spec:
        file, _, name = spec.rpartition(":")
        file = os.path.normpath(os.path.join(os.path.dirname(config_path), os.path.expanduser(file)))
        if not os.path.isfile(file):
            raise ConfigError(f"{key}={spec!r}: {file} does not exist (a relative path is read from the YAML's folder)")
        try:
            module = LOADED_FILES.get(file) or exec_file(file, key, spec_key=key)
        except UserError as exc:
            raise ConfigError(str(exc)) from exc
    else:
        module_name, _, name = spec.rpartition(".")
        if not module_name:
            raise ConfigError(f"{key}={spec!r}: give file.py:ClassName or package.module.ClassName")
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # noqa: BLE001 - any failure to import is the configuration's to fix
            hint = ("; verl's own classes are not part of hflow: point class_name at your class, and have it "
                    "subclass hflow's base (hflow.agent.interactions.BaseInteraction / hflow.agent.tools.BaseTool)"
                    if module_name.split(".")[0] == "verl" else "")
            raise ConfigError(f"{key}={spec!r}: importing {module_name} failed with {type(exc).__name__}: {exc}"
                              f"{hint}") from exc
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        raise ConfigError(f"{key}={spec!r}: {getattr(module, '__file__', module)} defines no class {name!r}")
    return cls
