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

Peak FLOP/s: dense bf16 tensor-core peak (no 2:4 sparsity) of the device, from NVIDIA's data sheets,
by device name; an unknown device gives None, and no MFU is reported then.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "PEAK_BF16_FLOPS",
    "TransformerShape",
    "actor_update_mfu",
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
    """Peak bf16 FLOP/s of this process's device; None on CPU or for a GPU not in the table."""
    from hflow.utils import device

    if not device.is_cuda():
        return None
    import torch

    return peak_bf16_flops(torch.cuda.get_device_name(device.get_device()))


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
        """From a Hugging Face config (an object or a dict) of a Llama/Qwen2-style model."""
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
    None where the device's peak is unknown (CPU, an unlisted GPU)."""
    seqlens = attention_mask.sum(-1).tolist()  # counted everywhere, so that CPU runs exercise it too
    flops = training_flops(hf_config, seqlens, lm_head_tokens=int(response_mask.sum())) * ppo_epochs
    return mfu(flops, seconds, device_peak_flops() if peak_flops is None else peak_flops)
