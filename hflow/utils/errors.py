"""Errors the user fixes: in their configuration, their data or their reward function.

`main_ppo` ends a run that raises one of these with its message alone -- no traceback, since the
fault is not in the code -- so each message must name the file, key or sample and say what to change.
Each is also the built-in type that callers have always caught (ValueError, FileNotFoundError).
"""

from __future__ import annotations

__all__ = ["ConfigError", "DataError", "DataFileNotFoundError", "UserError"]


class UserError(Exception):
    """A problem in the user's configuration, data or reward function; the message says what to change."""


class ConfigError(UserError, ValueError):
    """An impossible or invalid configuration; the message names the keys to change (`hflow.config_schema`
    re-exports it, beside the rules that raise it)."""


class DataError(UserError, ValueError):
    """A data file that cannot be used; the message names the file."""


class DataFileNotFoundError(DataError, FileNotFoundError):
    """A data file that the configuration names and that does not exist; the message names the key."""
