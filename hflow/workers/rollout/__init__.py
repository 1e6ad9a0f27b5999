"""Rollout engines: turn a batch of prompts into sampled responses (see `base` for the contract).

The engines are imported on first use: the section's config (`hflow.workers.rollout.config`), which the
trainer's preflight reads before anything loads, does not pay for importing them, and the HF rollout and
the contract helpers do not pay for importing vLLM (about 5 s).
"""

import importlib
from typing import Any

__all__ = ["BaseRollout", "HFRollout", "vLLMRollout"]

_MODULES = {"BaseRollout": "base", "HFRollout": "hf_rollout", "vLLMRollout": "vllm_rollout"}


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return getattr(importlib.import_module(f"{__name__}.{_MODULES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
