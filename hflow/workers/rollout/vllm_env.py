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

import logging
import os
from typing import Any

__all__ = ["VLLM_ENV", "MODEL_RUNNER", "apply_vllm_env", "check_model_runner"]

logger = logging.getLogger(__name__)

VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_V2_MODEL_RUNNER": "0"}
MODEL_RUNNER = "V1"  # what VLLM_USE_V2_MODEL_RUNNER=0 selects; the engine's runner is checked against it
_replaced: dict[str, str] = {}  # the environment's own values that `apply_vllm_env` replaced
_runner_logged = False


def apply_vllm_env() -> dict[str, str]:
    """Set `VLLM_ENV` in this process; returns the values it replaced (the user's, if they differ)."""
    replaced = {key: os.environ[key] for key, value in VLLM_ENV.items() if os.environ.get(key, value) != value}
    _replaced.update(replaced)
    os.environ.update(VLLM_ENV)
    return replaced


def check_model_runner(llm: Any) -> Any:
    """`llm`, whose workers' model runner (V1 on every device) is said once per process in the log; an engine
    that runs another (an `engine_kwargs.vllm` feature that needs V2) is refused, since router replay's
    capture, the sleep levels and the reloads were proved on V1 only. `llm.hflow_model_runner` names it."""
    global _runner_logged
    names = set(llm.collective_rpc(_model_runner_name))
    if not all(name.startswith("V1 ") for name in names):
        raise RuntimeError(f"vLLM built its engine on {sorted(names)}, not the {MODEL_RUNNER} model runner hflow "
                           f"chose (VLLM_USE_V2_MODEL_RUNNER={VLLM_ENV['VLLM_USE_V2_MODEL_RUNNER']}, "
                           "hflow.workers.rollout.vllm_env); remove the engine_kwargs.vllm setting that needs V2")
    described = ", ".join(sorted(names))
    if not _runner_logged:
        _runner_logged = True
        replaced = "".join(f"; replaced the environment's {k}={v}" for k, v in _replaced.items())
        logger.info("vLLM model runner: %s, chosen by hflow (%s)%s", described,
                    " ".join(f"{k}={v}" for k, v in VLLM_ENV.items()), replaced)
    llm.hflow_model_runner = described
    return llm


def _model_runner_name(worker: Any) -> str:
    """'V1 <class>' or 'V2 <class>' for one engine worker (runs inside the engine)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1Runner

    runner = worker.model_runner
    return f"{'V1' if isinstance(runner, V1Runner) else 'V2'} {type(runner).__module__}.{type(runner).__name__}"
