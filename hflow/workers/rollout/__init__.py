"""Rollout engines: turn a batch of prompts into sampled responses (see `base` for the contract).

`vLLMRollout` is imported on first use, so the HF rollout and the contract helpers do not pay for
importing vLLM (about 5 s).
"""

from typing import Any

from hflow.workers.rollout.base import BaseRollout
from hflow.workers.rollout.hf_rollout import HFRollout

__all__ = ["BaseRollout", "HFRollout", "vLLMRollout"]


def __getattr__(name: str) -> Any:
    if name == "vLLMRollout":
        from hflow.workers.rollout.vllm_rollout import vLLMRollout

        return vLLMRollout
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
