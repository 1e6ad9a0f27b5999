"""Model FLOPs of a decoder-only transformer, and MFU (model FLOPs utilisation).

MFU = (FLOPs the model needs for the work done) / (wall time x the device's peak bf16 FLOP/s). Only
useful work counts: tokens that are padding, recomputation for gradient checkpointing and the
masked-out half of causal attention are not model FLOPs.

Derivation (dense transformer: Llama, Qwen2, Mistral ... with grouped-query attention and a gated MLP)
------------------------------------------------------------------------------------------------------
A matrix product (m x k) @ (k x n) costs 2mkn FLOPs (a multiply and an add). A linear layer with P
weights applied to one token therefore costs 2P FLOPs forward, and 4P backward (the gradient with
respect to its input, 2P, and to its weights, 2P): 6P per token for forward + backward.

Per decoder layer the weights that multiply every token are

    P_layer = h*(n_h*d) + 2*h*(n_kv*d) + (n_h*d)*h  +  3*h*i
              q_proj      k_proj, v_proj  o_proj       gate, up, down (gated MLP)

(h hidden size, n_h query heads, n_kv key/value heads, d head size, i MLP size). The LM head has
V*h weights; it multiplies only the positions whose logits are computed (hflow's actor computes them
for response tokens only), and the input embedding is a lookup, not a product: 0 FLOPs, even when
its weights are tied to the LM head. Norms, rotary embeddings, activations, residual adds and the
softmax are elementwise: under 1 % of the total, left out (as PaLM and Megatron do).

Attention itself multiplies activations with activations. For one sequence of s tokens, per layer
and per query head, Q K^T is (s x d) @ (d x s): 2*s^2*d FLOPs, and scores @ V another 2*s^2*d, so the
forward costs 4*s^2*(n_h*d) per layer (grouped-query attention shares K and V between heads but
every query head still scores every key). A causal mask needs only the half at or below the
diagonal, which is what causal kernels compute: 2*s^2*(n_h*d). Forward + backward is 3x the forward:

    training FLOPs = 6 * L * P_layer * T  +  6 * V * h * T_head  +  c * L * (n_h*d) * sum_seq s^2
    forward FLOPs  = training FLOPs / 3                     (log-probs, values, reference)

with L layers, T the (non-padding) tokens, T_head the positions whose logits are computed, and
c = 6 for causal attention (the default here) or 12 counting the whole s x s square, which is the
"12 x layers x hidden x seq^2" term of verl's and Megatron's counters (n_h*d = h for most models).
For a Qwen2.5-1.5B-shaped model the attention term (c=6) adds about 3 % to the rest at 1024-token
sequences, and about 45 % at 16k-token sequences (90 % with c=12).

Peak FLOP/s: on a GPU, the dense bf16 tensor-core peak (no 2:4 sparsity) of the device, from NVIDIA's
data sheets, by device name; an unknown GPU gives None, and no MFU is reported then. On a CPU (where hflow
trains in fp32) no data sheet applies: the peak is measured, once per machine, as the best rate of a
large fp32 matmul with the process's torch threads (`cpu_peak_flops`), and cached on disk under
``<cache root>/peak-flops`` (``$HFLOW_CACHE``, default ``~/.cache/hflow``), keyed by CPU model, core
count, torch threads and torch version, with the load average it was taken at: a process that finds the
machine quieter measures again and keeps the higher rate (a busy machine makes the rate read low, and the
MFU high). A CPU's MFU therefore says how far the update is from what this machine's own matmul reaches,
not from a vendor's figure.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "PEAK_BF16_FLOPS",
    "TransformerShape",
    "actor_update_mfu",
    "cpu_peak_flops",
    "device_peak_flops",
    "forward_flops",
    "mfu",
    "peak_bf16_flops",
    "training_flops",
]

# (name, dense bf16 FLOP/s), matched in order as whole words against torch.cuda.get_device_name()
# (case-insensitive): the more specific names come first ("H100 PCIe" before "H100"), and "A100"
# does not match "RTX A1000".
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989e12),
    ("H200 NVL", 835e12),
    ("H200", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM (e.g. "NVIDIA H100 80GB HBM3")
    ("H800", 989e12),
    ("H20", 148e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("A40", 150e12),
    ("A6000", 155e12),
)


def peak_bf16_flops(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s of a device by its name (`torch.cuda.get_device_name()`), else None."""
    for fragment, flops in PEAK_BF16_FLOPS:
        if re.search(rf"(?<![0-9a-z]){re.escape(fragment.lower())}(?![0-9a-z])", device_name.lower()):
            return flops
    return None


def device_peak_flops() -> float | None:
    """Peak FLOP/s of this process's device: a GPU's dense bf16 peak from the table (None for a GPU not
    in it), a CPU's fp32 matmul peak as measured and cached by `cpu_peak_flops`."""
    from hflow.utils import device

    if not device.is_cuda():
        return cpu_peak_flops()
    import torch

    return peak_bf16_flops(torch.cuda.get_device_name(device.get_device()))


# ---------------------------------------------------------------------------------- CPU peak, measured

MATMUL_SIZE = 1024  # (n x n) @ (n x n): 2.1 GFLOP, tens of ms on one core of a recent server CPU
MATMUL_BUDGET_S = 0.3  # repetitions stop once this much has passed (at least 2 are timed)


def measure_matmul_flops(size: int = MATMUL_SIZE, budget_s: float = MATMUL_BUDGET_S, max_reps: int = 8) -> float:
    """The best FLOP/s of an fp32 (size x size) matmul on the CPU with this process's torch threads: one
    untimed warm-up, then repetitions until `budget_s` has passed (2 to `max_reps` of them)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=generator) for _ in range(2))
    torch.mm(a, b)
    best, started = math.inf, time.perf_counter()
    for rep in range(max_reps):
        begin = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - begin)
        if rep >= 1 and time.perf_counter() - started > budget_s:
            break
    return 2 * size**3 / best


def cpu_identity() -> dict[str, Any]:
    """What a CPU peak measurement depends on, and so its cache key: CPU model, cores, torch threads and
    torch version."""
    import torch

    model = platform.processor()
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": model, "cores": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__}


_CPU_PEAKS: dict[str, float] = {}  # by cache file: each process reads (or measures) once
QUIETER_BY = 1.0  # a stored rate is measured again when the load average has since fallen by more than this


def load_average() -> float:
    """The 1-minute load average (0 where the system has none): how busy the CPU was at a measurement."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def cpu_peak_flops(cache_dir: str | Path | None = None, measure: Callable[[], float] | None = None) -> float:
    """This machine's peak fp32 FLOP/s with this process's torch threads (`measure` defaults to
    `measure_matmul_flops`): measured on the first call on a machine, then read from
    ``<cache root>/peak-flops/cpu-<key>.json`` (cache root: `cache_dir`, default
    `hflow.utils.cache.default_cache_root()`).

    Other processes busy on the CPU make a measurement read low, so the file records the load average it
    was taken at, and a later process that finds the machine quieter by more than `QUIETER_BY` measures
    again and keeps the higher rate. A file that cannot be read, or does not hold a positive rate for
    this key, is measured again and rewritten; a cache that cannot be written is left alone."""
    from hflow.utils.cache import default_cache_root

    identity = cpu_identity()
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    path = root / "peak-flops" / f"cpu-{key}.json"
    if str(path) in _CPU_PEAKS:
        return _CPU_PEAKS[str(path)]
    stored, load = _read_peak(path, identity), load_average()
    if stored is not None and load + QUIETER_BY >= stored[1]:
        flops = stored[0]
    else:
        flops = float((measure or measure_matmul_flops)())
        if stored is not None:
            flops = max(flops, stored[0])
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # the ranks of one machine may race
            partial.write_text(json.dumps({**identity, "flops": flops, "load_average": load,
                                           "matmul_size": MATMUL_SIZE}) + "\n")
            os.replace(partial, path)
        except OSError:
            pass
    _CPU_PEAKS[str(path)] = flops
    return flops


def _read_peak(path: Path, identity: dict[str, Any]) -> tuple[float, float] | None:
    """(rate, load average at its measurement) of a cache file for `identity`; None when the file is
    missing or unreadable, is for another key, or holds no positive rate."""
    try:
        stored = json.loads(path.read_text())
        flops, load = float(stored["flops"]), float(stored.get("load_average", 0.0))
        same = all(stored.get(key) == value for key, value in identity.items())
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    return (flops, load) if same and math.isfinite(flops) and flops > 0 and math.isfinite(load) else None


@dataclass(frozen=True)
class TransformerShape:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def from_hf_config(cls, config: Any) -> TransformerShape:
        """From a Hugging Face config (an object or a dict) of a Llama/Qwen2-style model (a vision-language
        model's: its language model's; the vision tower's FLOPs are not counted)."""
        if not isinstance(config, Mapping) and hasattr(config, "vision_config"):
            config = config.get_text_config()
        get = config.get if isinstance(config, Mapping) else lambda key, default=None: getattr(config, key, default)
        hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
        return cls(
            hidden_size=hidden,
            num_layers=int(get("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(get("num_key_value_heads") or heads),
            head_dim=int(get("head_dim") or hidden // heads),
            intermediate_size=int(get("intermediate_size")),
            vocab_size=int(get("vocab_size")),
        )

    @property
    def layer_matmul_params(self) -> int:
        """P_layer: the weights of one decoder layer that multiply every token."""
        h, d = self.hidden_size, self.head_dim
        attention = h * self.num_heads * d + 2 * h * self.num_kv_heads * d + self.num_heads * d * h
        return attention + 3 * h * self.intermediate_size


def training_flops(
    shape: TransformerShape | Any,
    seqlens: Iterable[int],
    lm_head_tokens: int | None = None,
    causal: bool = True,
) -> float:
    """Forward + backward model FLOPs for sequences of `seqlens` non-padding tokens.

    `lm_head_tokens`: positions whose logits are computed (default: every token). `causal=False`
    counts the whole attention square (verl's and Megatron's convention).
    """
    if not isinstance(shape, TransformerShape):
        shape = TransformerShape.from_hf_config(shape)
    lengths = [int(s) for s in seqlens]
    tokens = sum(lengths)
    head_tokens = tokens if lm_head_tokens is None else int(lm_head_tokens)
    layers = shape.num_layers * shape.layer_matmul_params * tokens
    lm_head = shape.vocab_size * shape.hidden_size * head_tokens
    attention = (6 if causal else 12) * shape.num_layers * shape.num_heads * shape.head_dim * sum(s * s for s in lengths)
    return float(6 * (layers + lm_head) + attention)


def forward_flops(shape: TransformerShape | Any, seqlens: Iterable[int], lm_head_tokens: int | None = None,
                  causal: bool = True) -> float:
    """Forward-only model FLOPs (log-prob, value and reference passes): a third of `training_flops`."""
    return training_flops(shape, seqlens, lm_head_tokens, causal) / 3


def mfu(flops: float, seconds: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation in [0, 1] (None when the peak is unknown or the time is not positive)."""
    if peak_flops is None or seconds <= 0:
        return None
    return flops / (seconds * peak_flops)


def actor_update_mfu(hf_config: Any, attention_mask, response_mask, seconds: float, ppo_epochs: int = 1,
                     peak_flops: float | None = None) -> float | None:
    """MFU of one rank's PPO update: `ppo_epochs` forward + backward passes over the rank's batch
    (`attention_mask` (B, T), `response_mask` (B, L): the tokens that count and the positions that get
    logits) in `seconds`. Each rank measures its own share, so the mean over ranks is the group's MFU.
    `peak_flops` defaults to `device_peak_flops()`; None where that is unknown (an unlisted GPU)."""
    seqlens = attention_mask.sum(-1).tolist()
    flops = training_flops(hf_config, seqlens, lm_head_tokens=int(response_mask.sum())) * ppo_epochs
    return mfu(flops, seconds, device_peak_flops() if peak_flops is None else peak_flops)
