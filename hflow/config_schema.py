"""The configuration's generic machinery: typed defaults from dataclasses, merging, validation, and the
small rules every section uses (`check_choice`, `check_positive`).

Each config section's typed dataclass lives with the code that owns the section, beside its check
(`hflow.utils.dataset.config`, `hflow.workers.config`, `hflow.workers.rollout.config`, `hflow.agent.config`,
`hflow.workers.critic.config`, `hflow.reward.config`, `hflow.algorithms.config`,
`hflow.trainer.ppo.health_config`); `hflow.trainer.config` assembles them into the roots of the stages
(`PPOTrainerConfig`, `SFTTrainerConfig`, `RMTrainerConfig`) and offers `default_config()`,
`default_section(...)` and `validate_config(...)` over them. `config/*.yaml` mirror the dataclasses key for
key and default for default, with a comment on each key (`tests/test_config_schema.py` checks both).

`main_ppo` composes the YAML with Hydra and passes it through `validate` once, so a typo in a key or a
value of the wrong type stops the run with a `ConfigError` naming the key, and every later reader may rely
on every key being present (plain attribute access, no `.get(key, default)`).

Keys whose default is another key (`${...}`) keep the interpolation in the dataclass too (`ref`).
Free-form maps (`override_config`, `engine_kwargs.vllm`, `reward_kwargs`, ...) are dicts that accept any key.

This module sits at the bottom of the house: it imports only `hflow.utils.errors`.
"""

from __future__ import annotations

import difflib
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from hflow.utils.errors import ConfigError

__all__ = [
    "ConfigError",
    "WORLD_KEYS",
    "check_choice",
    "check_override_key",
    "check_positive",
    "defaults",
    "ref",
    "validate",
]

# How messages name the number of ranks.
WORLD_KEYS = "trainer.n_gpus_per_node x trainer.nnodes"


def ref(key: str) -> Any:
    """A default that is the value of another key (an OmegaConf interpolation)."""
    return "${" + key + "}"


def defaults(schema: type) -> DictConfig:
    """`schema` (a dataclass) at its defaults: typed, every key present, unknown keys refused."""
    return OmegaConf.structured(schema)


def validate(config: DictConfig | dict, schema: type) -> DictConfig:
    """`config` checked against `schema`: a typed copy with every key, or a `ConfigError` naming the first
    key that is unknown or holds a value of the wrong type. Interpolations stay unresolved."""
    try:
        return OmegaConf.merge(defaults(schema), config)
    except ConfigKeyError as err:
        raise _unknown_key(str(err.full_key), schema) from None
    except OmegaConfBaseException as err:
        reason = str(err.msg).splitlines()[0] if err.msg else type(err).__name__
        raise ConfigError(f"{err.full_key}: {reason}; give it a value of the type the key takes") from None


def check_override_key(full_key: str, schema: type) -> None:
    """`full_key` of a command-line `key=value` is a key of the `schema`.

    Hydra refuses an unknown key itself, before hflow sees the configuration, with a message that
    names neither the key that was meant nor the keys that exist; this check comes first and does.
    """
    node: Any = defaults(schema)
    parts = full_key.split(".")
    for depth, part in enumerate(parts):
        if not isinstance(node, DictConfig):
            return  # below a list or a null section: Hydra and validate judge it
        if part not in node:
            if OmegaConf.get_type(node) is dict:  # a free-form map (reward_kwargs, override_config, ...)
                raise ConfigError(f"{full_key} is not set yet, so it cannot be overridden; add it with a "
                                  f"leading +: +{full_key}=...")
            raise _unknown_key(".".join(parts[:depth + 1]), schema)
        node = node[part]


def _unknown_key(full_key: str, schema: type) -> ConfigError:
    """The error for a key that `schema` lacks: the closest key of its section, and all of them."""
    parent, _, key = full_key.rpartition(".")
    section = OmegaConf.select(defaults(schema), parent) if parent else defaults(schema)
    known = list(section.keys()) if isinstance(section, DictConfig) else []
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean {parent + '.' if parent else ''}{close[0]}? " if close else ""
    return ConfigError(f"{full_key} is not a configuration key; {hint}the keys of "
                       f"{parent or 'the top level'} are: {', '.join(known)}")


def check_choice(value: Any, choices: Any, key: str) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not one of {list(choices)}")


def check_positive(value: Any, key: str) -> None:
    if value is None or int(value) <= 0:
        raise ConfigError(f"{key} must be a positive integer, got {value}")
