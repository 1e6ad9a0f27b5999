"""A console that shows the user's own run.

The libraries under hflow (vLLM, torch, Ray) print messages that repeat on every step or weight sync, or
that are about choices hflow makes for them (eager mode on CPU, an in-process engine, thread pinning) or
about the machine (tcmalloc, Triton, NUMA): a user can do nothing about them, and they bury the lines
that matter. `install_library_filter()` drops exactly those messages -- each one is listed below -- and
library deprecation warnings; everything else, in particular warnings about the user's own settings and
anything hflow itself logs, stays.

`HFLOW_SHOW_LIBRARY_WARNINGS=1` turns the filter off (driver and workers alike).

The driver installs the filter in `main_ppo.main()`; every worker process installs it when its `Worker`
is built, and starts with `library_noise_env()` in its environment (C++ warnings are only silenced by
an environment variable read when torch loads).
"""

from __future__ import annotations

import logging
import os
import re
import warnings

__all__ = ["SHOW_ENV", "LIBRARY_NOISE", "install_library_filter", "library_noise_env", "show_library_warnings"]

SHOW_ENV = "HFLOW_SHOW_LIBRARY_WARNINGS"

# logger name -> messages dropped from it (regular expressions matched at the start of the message).
LIBRARY_NOISE: dict[str, tuple[str, ...]] = {
    # Every weight sync, once per layer: rotary embeddings have no weights to reload (their cos/sin
    # cache is rebuilt by vLLM). A failure to load any other layer's weights is still shown.
    "vllm.model_executor.model_loader.reload.layerwise": (r"RotaryEmbedding: Failed to load weights",),
    # Every step: hflow restores thread counts around generation; and the machine's preload libraries.
    "vllm.v1.worker.cpu_worker": (r"CPU backend doesn't allow to use `torch.set_num_threads`",
                                  r"\S+ is not found in LD_PRELOAD"),
    # Consequences of hflow's engine set-up (in-process engine, seeded sampling, eager mode on CPU,
    # no chunked prefill: hflow itself checks that max_num_batched_tokens covers the context).
    "vllm.engine.arg_utils": (r"The global random seed is set to",
                              r"This model does not officially support disabling chunked prefill"),
    "vllm.config.vllm": (r"Enforce eager set", r"Inductor compilation was disabled",
                         r"Model Runner V2 requires Triton"),
    # The second: on CPUs with AVX512-BF16, vLLM resets the SSM (mamba) cache dtype for every engine it
    # configures, whether or not the model has SSM layers; nothing a user sets changes it.
    "vllm.platforms.cpu": (r"Triton is not installed", r"Reset SSM cache type to float32"),
    "vllm.triton_utils.importing": (r"Triton is installed, but doesn't include CPU backend",),
    # The multi-turn engine adds token-id prompts (TokensPrompt) itself: about hflow's call, once per process.
    "vllm.v1.engine.input_processor": (r"Passing raw prompts to InputProcessor is deprecated",),
    "ray._private.authentication.authentication_token_setup": (r"Token authentication is enabled for this Ray",),
}

# Read by torch's C++ logging when it loads, so only a process's starting environment can carry it:
# vLLM's CPU kernels warn about NUMA memory binding from C++ on every worker.
_WORKER_ENV = {"TORCH_CPP_LOG_LEVEL": "ERROR"}

# Deprecation warnings raised anywhere but in hflow itself or the user's own files (loaded as
# `hflow_user_*` modules, or run as __main__) are for the libraries' authors, not for the user.
_NOT_OURS = r"(?!hflow\b|hflow_user_|__main__)"


def show_library_warnings() -> bool:
    return os.environ.get(SHOW_ENV, "").lower() in ("1", "true", "yes")


class _DropMessages(logging.Filter):
    def __init__(self, patterns: tuple[str, ...]):
        super().__init__()
        self.pattern = re.compile("|".join(f"(?:{p})" for p in patterns))

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record is not ours to judge: let it through
            return True
        return self.pattern.match(message) is None


_installed = False


def install_library_filter() -> None:
    """Drop the library noise in this process (idempotent; does nothing under HFLOW_SHOW_LIBRARY_WARNINGS=1).

    Filters sit on the named loggers themselves, so they hold whether or not the library has been
    imported (or has configured its handlers) yet.
    """
    global _installed
    if _installed or show_library_warnings():
        return
    _installed = True
    for name, patterns in LIBRARY_NOISE.items():
        logging.getLogger(name).addFilter(_DropMessages(patterns))
    for category in (DeprecationWarning, PendingDeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category, module=_NOT_OURS)


def library_noise_env() -> dict[str, str]:
    """Environment variables a worker process starts with: the filter's switch, and C++ log levels."""
    if show_library_warnings():
        return {SHOW_ENV: "1"}
    return dict(_WORKER_ENV)
