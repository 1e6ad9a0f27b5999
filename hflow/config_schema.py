"""The configuration's generic machinery: typed defaults from dataclasses, merging, validation, and the
small rules every section uses: `check_choice`, and the range vocabulary (`check_positive` for counts,
`check_positive_number`, `check_non_negative`, `check_fraction`, `check_scale`, `check_lower_upper`),
each raising a `ConfigError` that names the key, its value and the range; `ConfigErrors` collects the
errors of independent checks so that one command reports all of them at once.

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
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from hflow.utils.errors import ConfigError, UserError

__all__ = [
    "ConfigError",
    "ConfigErrors",
    "WORLD_KEYS",
    "check_choice",
    "check_fraction",
    "check_lower_upper",
    "check_non_negative",
    "check_override_key",
    "check_positive",
    "check_positive_number",
    "check_scale",
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


# ---- ranges ---------------------------------------------------------------------------------------
# Each takes the value and its full key; `null_ok`: null is a meaning of its own (off, no limit, derived),
# named in `hint`, which ends the message (e.g. "null: no limit").


def _out_of_range(key: str, value: Any, wanted: str, hint: str, null_ok: bool) -> ConfigError:
    return ConfigError(f"{key} must be {wanted}{' or null' if null_ok else ''}{f' ({hint})' if hint else ''}, "
                       f"got {value}")


def _number(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def check_positive(value: Any, key: str) -> None:
    """A count: an integer >= 1."""
    if value is None or int(value) <= 0:
        raise ConfigError(f"{key} must be a positive integer, got {value}")


def check_positive_number(value: Any, key: str, hint: str = "", null_ok: bool = False) -> None:
    """A number > 0 (a time, a limit, a threshold)."""
    if value is None and null_ok:
        return
    number = _number(value)
    if number is None or not number > 0:
        raise _out_of_range(key, value, "> 0", hint, null_ok)


def check_non_negative(value: Any, key: str, hint: str = "", null_ok: bool = False) -> None:
    """A number >= 0 (a count where 0 means none, a coefficient)."""
    if value is None and null_ok:
        return
    number = _number(value)
    if number is None or not number >= 0:
        raise _out_of_range(key, value, ">= 0", hint, null_ok)


def check_fraction(value: Any, key: str, hint: str = "", null_ok: bool = False, zero_ok: bool = True) -> None:
    """A share: in [0, 1] (`zero_ok=False`: in (0, 1])."""
    if value is None and null_ok:
        return
    number = _number(value)
    low_ok = number is not None and (number >= 0 if zero_ok else number > 0)
    if not (low_ok and number <= 1):
        raise _out_of_range(key, value, f"a fraction in {'[' if zero_ok else '('}0, 1]", hint, null_ok)


def check_scale(value: Any, key: str, hint: str = "", at_most_one: bool = False) -> None:
    """A factor that multiplies a setting: > 0 (`at_most_one`: one that only shrinks it, in (0, 1])."""
    number = _number(value)
    if number is None or not number > 0 or (at_most_one and number > 1):
        wanted = "a factor in (0, 1]" if at_most_one else "a factor > 0"
        raise ConfigError(f"{key} must be {wanted}{' (' + hint + ')' if hint else ''}, got {value}")


def check_lower_upper(lower: Any, upper: Any, lower_key: str, upper_key: str) -> None:
    """Two bounds of one range: lower < upper."""
    if not float(lower) < float(upper):
        raise ConfigError(f"{lower_key}={lower} must be < {upper_key}={upper}")


# ---- several errors at once ----------------------------------------------------------------------


class ConfigErrors:
    """The errors of independent checks, reported together: `run(check, ...)` (or `with errors.catch():`)
    records a check's `ConfigError` (or other `UserError`: a data file, a reward file) and goes on;
    `raise_any()` raises one `ConfigError` with every message, numbered (one error: that error itself,
    unchanged). A check that needs an earlier one to have passed runs only where `run` returned True."""

    def __init__(self) -> None:
        self.errors: list[UserError] = []

    def run(self, check: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
        with self.catch() as caught:
            check(*args, **kwargs)
        return not caught

    @contextmanager
    def catch(self) -> Iterator[list[UserError]]:
        caught: list[UserError] = []
        try:
            yield caught
        except UserError as err:
            caught.append(err)
            self.add(err)

    def add(self, err: UserError) -> None:
        for one in getattr(err, "errors", None) or [err]:  # a combined error adds its parts
            self._add_one(one)

    def _add_one(self, err: UserError) -> None:
        if all(str(err) != str(seen) for seen in self.errors):  # a rule applied twice is reported once
            self.errors.append(err)

    def raise_any(self) -> None:
        if len(self.errors) == 1:
            raise self.errors[0]
        if self.errors:
            raise combined_error(self.errors)


def combined_error(errors: list[Any]) -> ConfigError:
    """One `ConfigError` for several: "N problems ..." and one numbered line per error (their own lines
    indented under it)."""
    lines = [f"{len(errors)} problems in the configuration; fix each of them:"]
    for number, err in enumerate(errors, 1):
        lines.append(f"  {number}. " + str(err).replace("\n", "\n     "))
    combined = ConfigError("\n".join(lines))
    combined.errors = list(errors)
    return combined
