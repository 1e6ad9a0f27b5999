"""The environment hflow's in-process vLLM engines run in, decided here once (no vLLM import).

- `VLLM_ENABLE_V1_MULTIPROCESSING=0`: the engine runs in the worker's own process, which is what lets
  weights be handed over as tensors (a multiprocess engine only accepts a path).
- `VLLM_USE_V2_MODEL_RUNNER=0`: vLLM 0.32 picks its Model Runner V2 on CUDA whenever Triton imports
  (`VllmConfig.use_v2_model_runner`), while its CPU build runs the V1 runner (`CPUModelRunner` derives from
  V1's `GPUModelRunner`). hflow pins V1 on every device, so the GPU runs the runner the CPU tests run: the
  sleep levels and `reload_weights` are the worker's and V1's own, the processed log-probs are V1's
  sampler, and router replay's capture (`routing_capture`) reads V1's batch layout, which V2 does not have.

vLLM reads some of these once, and caches every one after its first engine starts (`enable_envs_cache`), so
they are set before vLLM is imported: in each worker's environment (`hflow.trainer.main_ppo`) and by the
rollout module itself, before its own import of vLLM.
"""

from __future__ import annotations

import os

__all__ = ["VLLM_ENV", "MODEL_RUNNER", "apply_vllm_env"]

VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_V2_MODEL_RUNNER": "0"}
MODEL_RUNNER = "V1"  # what VLLM_USE_V2_MODEL_RUNNER=0 selects; the engine's runner is checked against it


def apply_vllm_env() -> dict[str, str]:
    """Set `VLLM_ENV` in this process; returns the values it replaced (the user's, if they differ)."""
    replaced = {key: os.environ[key] for key, value in VLLM_ENV.items() if os.environ.get(key, value) != value}
    os.environ.update(VLLM_ENV)
    return replaced
