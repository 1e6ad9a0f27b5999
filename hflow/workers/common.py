"""Small helpers every kind of worker uses: its tokenizer, its memory metrics."""

from __future__ import annotations

from hflow.utils import device

__all__ = ["load_tokenizer", "memory_metrics"]


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """The tokenizer at `path`, with a pad token (the EOS token where the model ships without one)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token_id is None:  # many chat models ship without one
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def memory_metrics() -> dict[str, float]:
    """The peak device memory this process has allocated (GiB), as the `perf/` metric."""
    return {"perf/max_memory_allocated_gb": device.max_memory_allocated_gib()}
