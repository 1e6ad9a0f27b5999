"""Session-wide tiny model: built once into a temporary folder (about 0.5 s), never downloaded."""

import os
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


@pytest.fixture(scope="module")
def world():
    """A gloo world of one, initialised before a module's in-process vLLM engines (which would otherwise
    create their own); vLLM's groups and the default one are cleaned up after the module."""
    import torch.distributed as dist

    from tests.ranks import free_port

    environ = dict(os.environ)  # vLLM's engines set variables (VLLM_DIST_IDENT, ...) that later tests' runs inherit
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()
    os.environ.clear()
    os.environ.update(environ)
