"""Session-wide tiny model: built once into a temporary folder (about 0.5 s), never downloaded."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen2 'tiny' preset folder (weights, configs, tokenizer) that HF and vLLM both load."""
    from hflow.tasks.tiny_models import build_causal_lm

    return build_causal_lm(tmp_path_factory.mktemp("qwen2-tiny"), preset="tiny", arch="qwen2", seed=0)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)
