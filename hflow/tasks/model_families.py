"""The model families hflow is tested on: one tiny config per family, built from its transformers config.

`FAMILIES` is the one table the model matrix (tests/workers/test_model_matrix.py, and
`python -m bench.model_matrix`, which writes its README table) reads. Each entry names the transformers
`model_type`, the config keys that make it that family (Llama 3's rope scaling, Gemma's soft-capping and
sliding window, an MoE's experts), and, where the installed stack cannot run it, the reason. Shapes are
tiny (2-4 layers, hidden 128, head size 32: a size vLLM's CPU attention supports) and every model is
drawn from a seed with the built-in tokenizer, so the same arguments give the same folder, offline.

    from hflow.tasks.model_families import build_family
    folder = build_family("qwen3_moe", "/tmp/qwen3-moe-tiny")
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from hflow.tasks.tiny_models import build_tokenizer

__all__ = ["CHECKS", "FAMILIES", "ModelFamily", "build_family", "supported_families"]

# What the matrix checks for every family (tests/workers/test_model_matrix.py, one test each):
CHECKS = {
    "packed": "remove-padding (packed) log-probs equal the padded forward's",
    "fsdp2": "FSDP2 wraps each decoder layer and the root; the wrapped model's log-probs are the plain one's",
    "parity": "vLLM's sampling log-probs equal the trainer's (packed forward) within 1e-4, fp32",
    "reload": "hflow's weight stream reloads changed weights into the engine exactly",
    "grpo": "two in-process GRPO steps (sample, score, advantages, FSDP2 update, stream the weights back)",
}

# Shared by every family: head size 32 (hidden 128 / 4 heads), 2 KV heads (grouped-query attention).
_SHAPE = {
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "max_position_embeddings": 1024,
    "initializer_range": 0.02,
}

# A window shorter than the matrix's sequences (prompts of >= 128 tokens), so a sliding-window layer
# attends to a strict subset of its causal context and a path that ignores the window shows.
SLIDING_WINDOW = 64


@dataclass(frozen=True)
class ModelFamily:
    """One row of the matrix: how to build the tiny model, and what the stack can do with it."""

    name: str  # the matrix's row label
    model_type: str  # transformers' `model_type` (AutoConfig.for_model)
    config: dict[str, Any] = field(default_factory=dict)  # the family's own keys, over `_SHAPE`
    moe: bool = False  # routed experts
    # check -> why the installed transformers / vLLM CPU cannot run it (the matrix's checks: CHECKS)
    unsupported: dict[str, str] = field(default_factory=dict)

    def hf_config(self, vocab_size: int, special_ids: dict[str, int]) -> Any:
        return AutoConfig.for_model(self.model_type, vocab_size=vocab_size, dtype="float32",
                                    **{**_SHAPE, **self.config}, **special_ids)


_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 256}

# Why the hybrid linear-attention family (Qwen3-Next; Qwen3.5 uses the same gated delta net) is not trained here.
_VLLM_GDN_BF16 = ("vLLM 0.32's CPU gated-delta-net (linear attention) runs in bf16 only "
                  "(AssertionError: 'CPU GDN attention requires BF16'): no fp32 engine for exact checks")
_PACKED_LINEAR_ATTENTION = ("transformers 5.19's torch gated-delta-rule and causal conv1d ignore packed sequence "
                            "bounds (cu_seq_lens): packed sequences would leak into each other, so hflow refuses "
                            "to pack linear-attention models (use_remove_padding=false)")

FAMILIES: dict[str, ModelFamily] = {f.name: f for f in (
    ModelFamily("qwen2", "qwen2"),
    ModelFamily("qwen3", "qwen3"),
    ModelFamily("qwen3_moe", "qwen3_moe", moe=True,
                config={"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                        "decoder_sparse_step": 1, "norm_topk_prob": True}),
    ModelFamily("qwen2_moe", "qwen2_moe", moe=True,
                config={"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                        "shared_expert_intermediate_size": 128, "decoder_sparse_step": 1}),
    ModelFamily("llama3", "llama", config={"rope_parameters": _LLAMA3_ROPE}),
    ModelFamily("mistral", "mistral", config={"sliding_window": None}),
    ModelFamily("gemma2", "gemma2",
                # Gemma 2's real cap (50) leaves a tiny random model's scores (~0.1) untouched: larger weights
                # and a cap of 5 make a path that drops the soft-capping show (log-probs 1.3 apart).
                config={"sliding_window": SLIDING_WINDOW, "query_pre_attn_scalar": 32,
                        "attn_logit_softcapping": 5.0, "final_logit_softcapping": 30.0, "initializer_range": 0.1,
                        "hidden_activation": "gelu_pytorch_tanh"}),
    ModelFamily("gemma3", "gemma3_text",
                config={"sliding_window": SLIDING_WINDOW, "query_pre_attn_scalar": 32,
                        "layer_types": ["sliding_attention", "full_attention"]}),
    ModelFamily("qwen3_next", "qwen3_next", moe=True, unsupported={
                    "packed": _PACKED_LINEAR_ATTENTION, "parity": _VLLM_GDN_BF16, "reload": _VLLM_GDN_BF16,
                    "grpo": _VLLM_GDN_BF16},
                config={"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                        "shared_expert_intermediate_size": 128, "decoder_sparse_step": 1,
                        "layer_types": ["linear_attention", "full_attention"],
                        "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                        "linear_key_head_dim": 32, "linear_value_head_dim": 32}),
)}


def supported_families(check: str) -> list[str]:
    """The families whose `check` (one of CHECKS) the installed stack can run."""
    return [name for name, family in FAMILIES.items() if check not in family.unsupported]


def build_family(name: str, save_dir: str | Path, seed: int = 0) -> Path:
    """Write family `name`'s tiny model (fp32 safetensors drawn from `seed`, without touching the caller's
    RNG), its configs and the built-in tokenizer into one folder that HF and vLLM load. Returns it."""
    if name not in FAMILIES:
        raise ValueError(f"model family {name!r} is unknown; choose one of {sorted(FAMILIES)}")
    family = FAMILIES[name]
    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(save_dir, model_max_length=_SHAPE["max_position_embeddings"])
    special = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
               "pad_token_id": tokenizer.pad_token_id}
    config = family.hf_config(len(tokenizer), special)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(**special)
    model.save_pretrained(str(save_dir))
    return save_dir
