"""The one place in hflow that knows which hardware it runs on.

Every other module asks this helper for the device, the torch.distributed backend and the Ray
resource a worker needs, so the same code runs on an 8-GPU node (cuda / NCCL / "GPU") and on a CPU
machine (cpu / gloo / "CPU") without branching on the hardware anywhere else.

`HFLOW_DEVICE=cpu` forces the CPU path on a machine that has GPUs (useful for debugging);
`HFLOW_DEVICE=cuda` fails loudly if no GPU is visible instead of silently falling back.
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch

_ENV_KEY = "HFLOW_DEVICE"


@lru_cache(maxsize=1)
def _detect() -> str:
    forced = os.environ.get(_ENV_KEY, "").strip().lower()
    if forced not in ("", "cpu", "cuda"):
        raise ValueError(f"{_ENV_KEY}={forced!r} is not a device hflow knows; use 'cpu' or 'cuda' (or unset it)")
    if forced == "cpu":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    if forced == "cuda":
        raise RuntimeError(f"{_ENV_KEY}=cuda but torch sees no CUDA device; unset it to run on the CPU")
    return "cpu"


def device_name() -> str:
    """'cuda' or 'cpu': the accelerator type this process trains and generates on."""
    return _detect()


def is_cuda() -> bool:
    return device_name() == "cuda"


def cluster_has_gpus(cluster_resources: dict[str, float]) -> bool:
    """Whether workers of a cluster with these resources (Ray's view) should hold GPUs.

    The cluster, not the driver, decides: the driver may sit on a head node without a GPU.
    `HFLOW_DEVICE=cpu` still forces CPU workers.
    """
    forced = os.environ.get(_ENV_KEY, "").strip().lower()
    return forced != "cpu" and cluster_resources.get("GPU", 0) > 0


def visible_device_count() -> int:
    """How many devices this process can address: its GPUs, or 1 (the host) on CPU. `LOCAL_RANK`
    indexes into these and must stay below this count."""
    return torch.cuda.device_count() if is_cuda() else 1


def local_device_index() -> int:
    """Index of this process's GPU among the visible ones: `LOCAL_RANK` (see
    `hflow.single_controller.base.worker` for the contract). Ray gives each worker one GPU through
    CUDA_VISIBLE_DEVICES, so it is 0 there; under torchrun every process sees all GPUs and
    LOCAL_RANK picks one. A value past the visible devices is an error, not a silent wrap-around."""
    if not is_cuda():
        return 0
    index = int(os.environ.get("LOCAL_RANK", "0"))
    if not 0 <= index < visible_device_count():
        raise RuntimeError(
            f"LOCAL_RANK={index} but this process sees {visible_device_count()} GPU(s) "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); LOCAL_RANK is the index "
            "of this process's device among the visible ones"
        )
    return index


def get_device() -> torch.device:
    """The torch device of this process (cuda:i or cpu)."""
    if is_cuda():
        return torch.device("cuda", local_device_index())
    return torch.device("cpu")


def set_device() -> torch.device:
    """Bind this process to its device (a no-op on CPU) and return it."""
    device = get_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def dist_backend() -> str:
    """The torch.distributed backend for collectives between workers.

    On GPU, NCCL for device tensors and gloo for host tensors: object collectives, checkpoint
    metadata and host-offloaded state then never go through NCCL."""
    return "cpu:gloo,cuda:nccl" if is_cuda() else "gloo"


def ray_resource() -> str:
    """The Ray resource one worker process holds: a whole GPU, or a CPU on CPU-only machines."""
    return "GPU" if is_cuda() else "CPU"


# The first compute capability with bf16 arithmetic (Ampere); older GPUs (V100 7.0, T4 7.5) have none.
BF16_CAPABILITY = (8, 0)


def cuda_capability() -> tuple[int, int] | None:
    """(major, minor) compute capability of this process's GPU; None on CPU."""
    return tuple(torch.cuda.get_device_capability(get_device())) if is_cuda() else None


def total_memory_bytes() -> int | None:
    """Memory of this process's GPU in bytes; None on CPU (host memory is not one device's budget)."""
    return int(torch.cuda.get_device_properties(get_device()).total_memory) if is_cuda() else None


def compute_dtype_for(cuda: bool, capability: tuple[int, int] | None) -> torch.dtype:
    """The dtype forward passes compute in on such a device: bf16 on GPUs that have it (compute
    capability 8.0 on); fp32 on older GPUs, where fp16 with fp32 master weights would need a loss
    scaler that hflow does not have; fp32 on CPU (exact, and fast enough)."""
    has_bf16 = cuda and capability is not None and tuple(capability) >= BF16_CAPABILITY
    return torch.bfloat16 if has_bf16 else torch.float32


def rollout_dtype_for(cuda: bool, capability: tuple[int, int] | None) -> torch.dtype:
    """vLLM's dtype on such a device: the compute dtype, except fp16 on GPUs without bf16 (generation
    has no backward, so no loss scaler; vLLM itself falls back to fp16 for bf16 checkpoints there)."""
    dtype = compute_dtype_for(cuda, capability)
    return torch.float16 if cuda and dtype == torch.float32 else dtype


def compute_dtype() -> torch.dtype:
    """Default dtype for forward passes on this process's device (`compute_dtype_for`)."""
    return compute_dtype_for(is_cuda(), cuda_capability())


def rollout_dtype() -> torch.dtype:
    """Default dtype of the rollout engine and the weight stream on this device (`rollout_dtype_for`)."""
    return rollout_dtype_for(is_cuda(), cuda_capability())


OPTIMIZER_KERNELS = ("auto", "fused", "foreach")


def optimizer_kernel(param_device: torch.device | str, setting: str = "auto") -> str:
    """How AdamW runs over parameters on `param_device`: `setting` when it names one, else 'fused' where they
    live on a GPU (one kernel for the whole step, DTensor shards included) and 'foreach' elsewhere (the host:
    CPU runs, host-offloaded shards)."""
    if setting not in OPTIMIZER_KERNELS:
        raise ValueError(f"optimizer kernel {setting!r}: use one of {OPTIMIZER_KERNELS}")
    if setting != "auto":
        return setting
    return "fused" if torch.device(param_device).type == "cuda" else "foreach"


# Rows of logits are turned into log-probabilities and entropies in blocks of about this many elements. On
# CPU 16 MiB of fp32: blocks of 32 MiB and more measured up to 3x slower, as glibc maps buffers that large
# afresh every time. On a GPU 1 GiB of fp32 (e.g. 1,766 rows of a 152k vocabulary): a 3k-token micro-batch
# in two blocks instead of 114, each block a few launches (the H100 evidence: 27-row blocks cost ~1,500
# launches and ~65 ms of idle GPU per update); the temporaries stay far below one micro-batch's activations.
LOGIT_BLOCK_ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 28}


def logit_block_elements(setting: int | None = None) -> int:
    """Elements per block of the blocked log-prob / entropy passes: `setting`, else this device's size."""
    return int(setting) if setting else LOGIT_BLOCK_ELEMENTS[device_name()]


def synchronize() -> None:
    if is_cuda():
        torch.cuda.synchronize()


def empty_cache() -> None:
    """Give cached accelerator memory back (between phases that take turns on the device)."""
    if is_cuda():
        torch.cuda.empty_cache()


def memory_allocated_gib() -> float:
    """Memory held by tensors on this process's device, in GiB (process RSS on CPU)."""
    if is_cuda():
        return torch.cuda.memory_allocated() / 2**30
    return _rss_bytes() / 2**30


def max_memory_allocated_gib() -> float:
    if is_cuda():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
