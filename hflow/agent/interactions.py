"""Simulated users: verl's interaction interface and its YAML file, unchanged.

An interaction answers an assistant turn that calls no tool with a user message, and may end the
episode and score the turn. Its methods are verl's (all ``async``)::

    start_interaction(instance_id, **interaction_kwargs) -> instance_id
    generate_response(instance_id, messages, **interaction_kwargs) -> (should_terminate, content, score, extra)
    calculate_score(instance_id, **kwargs) -> float        (the interaction's own; the loop does not call it)
    finalize_interaction(instance_id, **kwargs) -> None    (called once per episode, whatever ended it)

The file (``multi_turn.interaction_config_path``), as verl writes it::

    interaction:
      - name: gsm8k                                        # optional: else from the class name
        class_name: my_package.my_module.Gsm8kInteraction  # or path/to/file.py:Gsm8kInteraction
        config: {}

A row picks one with ``extra_info.interaction_kwargs.name`` (required when the file has several); the
rest of ``interaction_kwargs`` goes to every call. The user message enters the trajectory as the chat
template renders it (loss mask 0); the score sits on the last sampled token of the turn it answers;
``max_user_turns`` counts these messages with the tool and environment ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from uuid import uuid4

from hflow.agent.env import load_class, read_yaml_list
from hflow.utils.errors import ConfigError, UserError

__all__ = ["BaseInteraction", "InteractionTable", "load_interactions"]

_METHODS = ("start_interaction", "generate_response", "finalize_interaction")


class BaseInteraction:
    """verl's base interaction: one object serves every episode, keyed by instance id."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.name: str = config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        return instance_id or uuid4().hex

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs: Any) -> tuple[bool, str, float, dict[str, Any]]:
        raise NotImplementedError(f"{type(self).__name__}.generate_response")

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        return None


class InteractionTable:
    """The interactions by name; `for_row` picks a row's from its ``interaction_kwargs``."""

    def __init__(self, interactions: dict[str, Any], path: str = "") -> None:
        self.by_name = interactions
        self.path = path

    def for_row(self, interaction_kwargs: Mapping[str, Any] | None, where: str) -> Any | None:
        if not interaction_kwargs:
            return None
        name = interaction_kwargs.get("name")
        if name is None and len(self.by_name) == 1:
            return next(iter(self.by_name.values()))
        if name not in self.by_name:
            raise UserError(f"{where}: extra_info.interaction_kwargs.name={name!r} names no interaction of "
                            f"{self.path} (it has {', '.join(self.by_name)}); fix the row or the file")
        return self.by_name[name]


def load_interactions(path: str) -> InteractionTable:
    """verl's interaction file (module docstring): each entry built once, ``cls(config=config)`` with
    ``config["name"]`` set, as verl does. Problems are `ConfigError`s naming the entry."""
    entries, path = read_yaml_list(path, "interaction", "interaction config")
    interactions: dict[str, Any] = {}
    for index, entry in enumerate(entries):
        where = f"interaction config {path}: interaction[{index}]"
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{where} must be a mapping with name, class_name and config")
        unknown = sorted(set(entry) - {"name", "class_name", "config"})
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {unknown}; an interaction has name, class_name, config")
        cls = load_class(entry.get("class_name"), path, f"{where}.class_name")
        missing = [m for m in _METHODS if not callable(getattr(cls, m, None))]
        if missing:
            raise ConfigError(f"{where}.class_name: {cls.__name__} lacks {', '.join(missing)}; an interaction "
                              "implements verl's interface (hflow.agent.interactions.BaseInteraction)")
        name = entry.get("name")
        if name is None:  # verl's rule: the class name without "Interaction", lower case
            simple = str(entry["class_name"]).replace(":", ".").split(".")[-1]
            name = (simple[: -len("Interaction")] if simple.endswith("Interaction") else simple).lower()
        if name in interactions:
            raise ConfigError(f"{where}: the name {name!r} is taken by an earlier entry; give each its own name")
        config = entry.get("config") or {}
        if not isinstance(config, Mapping):
            raise ConfigError(f"{where}.config must be a mapping, got {type(config).__name__}")
        config = {**config, "name": name}
        try:
            interactions[name] = cls(config=config)
        except Exception as exc:  # noqa: BLE001 - reported with the entry it came from
            raise ConfigError(f"{where}: {cls.__name__}(config=...) failed with {type(exc).__name__}: {exc}") from exc
    return InteractionTable(interactions, path)
