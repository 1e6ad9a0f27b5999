"""The machine the GPU check ran on, for the report's header: device and its memory, NVIDIA driver, Python,
torch and its CUDA build, transformers, flash-attn, the attention implementation hflow picks, the peak bf16
FLOP/s that MFU is measured against, and the hflow commit (marked when the checkout has uncommitted changes),
so that a result can be told apart from one taken elsewhere."""

from __future__ import annotations

import os
import platform
import subprocess

from .common import REPO, GiB


def _smi(query: str) -> str:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60).stdout.strip()
        return out.splitlines()[0] if out else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _git_commit() -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=30).stdout.strip()
        return (commit + (" + uncommitted changes" if dirty else "")) if commit else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment() -> dict[str, str]:
    import torch
    import transformers

    from hflow.utils import device
    from hflow.utils.flops_counter import device_peak_flops
    from hflow.workers.fsdp import default_attn_implementation

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "CUDA (torch build)": str(torch.version.cuda),
        "transformers": transformers.__version__,
        "hflow commit": _git_commit(),
        "attention implementation": default_attn_implementation(),
    }
    if device.is_cuda():
        peak = device_peak_flops()
        env = {
            "device": f"{torch.cuda.get_device_name(0)} ({torch.cuda.device_count()} visible)",
            "GPU memory": f"{torch.cuda.get_device_properties(0).total_memory / GiB:.1f} GiB",
            "NVIDIA driver": _smi("driver_version"),
            **env,
            "peak bf16 (hflow.utils.flops_counter)": f"{peak / 1e12:.0f} TFLOP/s" if peak else "unknown: no MFU",
        }
    else:
        env = {"device": f"CPU ({os.cpu_count()} cores): --smoke-cpu, numbers are meaningless", **env}
    try:
        from importlib import metadata

        env["flash-attn"] = metadata.version("flash-attn")
    except Exception:  # noqa: BLE001
        env["flash-attn"] = "not installed"
    return env

