"""PPO critics: value estimates of response states and the value-function update.

Imported on first use, so that the section's config (`hflow.workers.critic.config`), which the trainer's
preflight reads before anything loads, does not pay for importing torch's FSDP and transformers.
"""

import importlib
from typing import Any

__all__ = ["BasePPOCritic", "DataParallelPPOCritic"]

_MODULES = {"BasePPOCritic": "base", "DataParallelPPOCritic": "dp_critic"}


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return getattr(importlib.import_module(f"{__name__}.{_MODULES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
