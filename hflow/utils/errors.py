"""Errors the user fixes: in their configuration, their data or their reward function.

`main_ppo` ends a run that raises one of these with its message alone -- no traceback, since the
fault is not in the code -- so each message must name the file, key or sample and say what to change.
"""

from __future__ import annotations

__all__ = ["DataError", "UserError"]


class UserError(Exception):
    """A problem in the user's configuration, data or reward function; the message says what to change."""


class DataError(UserError, ValueError):
    """A data file that cannot be used; the message names the file."""
