"""Where hflow keeps what it builds or measures once per machine: built-in tasks and models, the CPU's
measured peak FLOP rate. ``$HFLOW_CACHE``, else ``$XDG_CACHE_HOME/hflow``, else ``~/.cache/hflow``."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CACHE_ENV", "default_cache_root"]

CACHE_ENV = "HFLOW_CACHE"


def default_cache_root() -> Path:
    """``$HFLOW_CACHE``, else ``$XDG_CACHE_HOME/hflow``, else ``~/.cache/hflow``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "hflow"
