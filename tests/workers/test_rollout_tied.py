"""A model whose LM head is tied to its input embedding (SmolLM2, Qwen2.5-0.5B..3B) through the FSDP ->
vLLM weight sync. Its own module: the engine it builds tears down the process group when it is freed,
so it must not share a world with test_rollout.py's engine."""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.workers.test_rollout import (
    LONG_CONTEXT,
    PARITY_TOL,
    PROMPT_LENGTH,
    QUESTIONS,
    TEMPERATURE,
    hf_log_probs,
    make_prompts,
    max_masked_diff,
    perturb_,
    push,
    rollout_config,
)


@pytest.mark.usefixtures("world")
def test_tied_embedding_model_follows_every_sync(tmp_path, tiny_tokenizer):
    """SmolLM2, Qwen2.5-0.5B..3B tie lm_head to the embedding; vLLM skips lm_head.weight on load, so
    the head must be re-tied after each sync or the sampler keeps its first (here random) head."""
    from hflow.tasks.tiny_models import build_causal_lm
    from hflow.workers.rollout.vllm_rollout import vLLMRollout

    model_dir = build_causal_lm(tmp_path / "tied", preset="tiny", arch="qwen2", seed=3, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    tied = vLLMRollout(str(model_dir), rollout_config(), tiny_tokenizer, AutoConfig.from_pretrained(model_dir))
    assert tied.tied_embeddings
    prompts = make_prompts(tiny_tokenizer, QUESTIONS[:2], context=LONG_CONTEXT)
    generator = torch.Generator().manual_seed(5)
    try:
        for _ in range(2):  # the first sync replaces dummy weights, the second trained ones
            perturb_(model, generator)
            push(tied, model)
            out = tied.generate_sequences(prompts)
            mask = out.batch["attention_mask"][:, PROMPT_LENGTH:]
            diff = max_masked_diff(out.batch["rollout_log_probs"], hf_log_probs(model, out, TEMPERATURE), mask)
            assert diff < PARITY_TOL
    finally:
        del tied
        gc.collect()
