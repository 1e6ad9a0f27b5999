"""Reward managers by name, so ``reward_model.reward_manager=<name>`` picks one (and users can add theirs)."""

from __future__ import annotations

from collections.abc import Callable

from hflow.utils.errors import ConfigError

__all__ = ["REWARD_MANAGERS", "get_reward_manager_cls", "register"]

REWARD_MANAGERS: dict[str, type] = {}


def register(name: str) -> Callable[[type], type]:
    """Class decorator: make the class available as ``reward_model.reward_manager=<name>``."""

    def decorator(cls: type) -> type:
        existing = REWARD_MANAGERS.get(name)
        if existing is not None and existing is not cls:
            raise ValueError(
                f"reward manager name {name!r} is already taken by {existing.__module__}.{existing.__qualname__}; "
                f"register {cls.__qualname__} under another name"
            )
        REWARD_MANAGERS[name] = cls
        return cls

    return decorator


def get_reward_manager_cls(name: str) -> type:
    """The class registered under `name`."""
    if name not in REWARD_MANAGERS:
        raise ConfigError(
            f"reward_model.reward_manager={name!r} is not a known reward manager; known: {sorted(REWARD_MANAGERS)}"
        )
    return REWARD_MANAGERS[name]
