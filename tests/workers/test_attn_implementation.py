"""default_attn_implementation: flash_attention_2 only where flash-attn really works, else SDPA.

A flash-attn built for another torch is installed but its compiled extension does not import
("undefined symbol"); before, finding the package was enough and model loading crashed. These tests
put fake `flash_attn` packages (broken, old, working) on sys.path and pretend to be on CUDA, on CPU.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from hflow.utils import device
from hflow.workers.fsdp import models
from hflow.workers.fsdp import default_attn_implementation, load_causal_lm
from hflow.utils.packing import SDPA_VARLEN

BROKEN_EXTENSION = (
    'raise ImportError("flash_attn_2_cuda.cpython-311-x86_64-linux-gnu.so: undefined symbol: '
    '_ZN3c104cuda9SetDeviceEab")\n'
)
WORKING_EXTENSION = "VERSION = 'fake'\n"
# Like the real package: importing flash_attn imports the compiled extension.
PACKAGE_INIT = (
    "import flash_attn_2_cuda\n"
    "def flash_attn_func(q, k, v, causal=False, **kwargs):\n"
    "    return q.clone()\n"
)


def _install_fake(root: Path, extension_source: str, version: str = "2.8.3") -> None:
    (root / "flash_attn").mkdir()
    (root / "flash_attn" / "__init__.py").write_text(PACKAGE_INIT)
    (root / "flash_attn_2_cuda.py").write_text(extension_source)
    info = root / f"flash_attn-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: flash-attn\nVersion: {version}\n")


@pytest.fixture
def fake_flash_attn(tmp_path, monkeypatch):
    """Returns a function that installs a fake flash-attn into tmp_path (on sys.path for this test)."""
    for name in ("flash_attn", "flash_attn_2_cuda"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(models, "_ATTN_CHOICES_LOGGED", set())

    def install(extension_source: str, version: str = "2.8.3") -> None:
        _install_fake(tmp_path, extension_source, version)

    yield install
    for name in ("flash_attn", "flash_attn_2_cuda"):
        sys.modules.pop(name, None)


def test_cpu_is_sdpa_even_with_a_working_flash_attn(fake_flash_attn):
    fake_flash_attn(WORKING_EXTENSION)
    assert default_attn_implementation(cuda=False) == SDPA_VARLEN
    if not device.is_cuda():
        assert default_attn_implementation() == SDPA_VARLEN


def test_cuda_without_flash_attn_is_sdpa(fake_flash_attn, monkeypatch, caplog):
    find_spec = importlib.util.find_spec  # hide a real flash-attn, if this machine has one
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, package=None: None if name == "flash_attn" else find_spec(name, package))
    with caplog.at_level(logging.INFO, logger=models.logger.name):
        assert default_attn_implementation(cuda=True) == SDPA_VARLEN
    assert "not installed" in caplog.text


def test_broken_build_falls_back_to_sdpa_with_one_warning(fake_flash_attn, caplog):
    fake_flash_attn(BROKEN_EXTENSION)
    with caplog.at_level(logging.INFO, logger=models.logger.name):
        assert default_attn_implementation(cuda=True) == SDPA_VARLEN
        assert default_attn_implementation(cuda=True) == SDPA_VARLEN
    records = [r for r in caplog.records if "attention implementation" in r.getMessage()]
    assert len(records) == 1, "the reason is logged once, not at every model load"
    assert records[0].levelno == logging.WARNING
    message = records[0].getMessage()
    assert "undefined symbol" in message and torch.__version__ in message


def test_too_old_flash_attn_is_sdpa(fake_flash_attn, caplog):
    fake_flash_attn(WORKING_EXTENSION, version="2.0.4")
    with caplog.at_level(logging.INFO, logger=models.logger.name):
        assert default_attn_implementation(cuda=True) == SDPA_VARLEN
    assert "older than 2.3.3" in caplog.text


def test_working_flash_attn_is_chosen_on_cuda(fake_flash_attn, monkeypatch):
    """The device helper's answer is what counts when no argument is given."""
    fake_flash_attn(WORKING_EXTENSION)
    monkeypatch.setattr(device, "is_cuda", lambda: True)
    monkeypatch.setattr(device, "get_device", lambda: torch.device("cpu"))  # the fake runs anywhere
    assert default_attn_implementation() == "flash_attention_2"


def test_model_loads_with_a_broken_flash_attn_on_cuda(fake_flash_attn, monkeypatch, tmp_path):
    fake_flash_attn(BROKEN_EXTENSION)
    monkeypatch.setattr(device, "is_cuda", lambda: True)
    config = Qwen2Config(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=64, max_position_embeddings=32)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path / "model")
    model = load_causal_lm(str(tmp_path / "model"))
    assert model.config._attn_implementation == SDPA_VARLEN
    out = model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert out.shape == (1, 3, 64)
