"""flops_counter: the documented formula against hand counts and against torch's own FLOP counter; the
CPU's peak, measured once per machine and cached."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import Qwen2Config, Qwen2ForCausalLM

from hflow.utils import device, flops_counter
from hflow.utils.flops_counter import (
    TransformerShape,
    actor_update_mfu,
    cpu_peak_flops,
    device_peak_flops,
    forward_flops,
    mfu,
    peak_bf16_flops,
    training_flops,
)

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=96, vocab_size=128, max_position_embeddings=64, tie_word_embeddings=False)

QWEN_1_5B = Qwen2Config(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                        intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True)


def test_shape_counts_the_linear_weights_of_a_real_layer():
    config = Qwen2Config(**TINY)
    model = Qwen2ForCausalLM(config)
    layer = model.model.layers[0]
    weights = sum(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))
    assert TransformerShape.from_hf_config(config).layer_matmul_params == weights
    # and from a config dict (config.json)
    assert TransformerShape.from_hf_config(config.to_dict()) == TransformerShape.from_hf_config(config)


def test_qwen2_5_1_5b_shape():
    shape = TransformerShape.from_hf_config(QWEN_1_5B)
    assert shape.head_dim == 128 and shape.num_kv_heads == 2
    # 28 layers x 46.8M + a 233M LM head: the 1.54B parameters of Qwen2.5-1.5B (its tied embedding
    # counted once)
    total = shape.num_layers * shape.layer_matmul_params + shape.vocab_size * shape.hidden_size
    assert 1.53e9 < total < 1.55e9


def test_formula_by_hand():
    shape = TransformerShape(hidden_size=8, num_layers=3, num_heads=2, num_kv_heads=1, head_dim=4,
                             intermediate_size=16, vocab_size=10)
    p_layer = 8 * 8 + 2 * 8 * 4 + 8 * 8 + 3 * 8 * 16
    assert shape.layer_matmul_params == p_layer
    seqlens = [5, 3]
    dense = 6 * (3 * p_layer * 8 + 10 * 8 * 8)
    assert training_flops(shape, seqlens, causal=False) == dense + 12 * 3 * 8 * (25 + 9)
    assert training_flops(shape, seqlens) == dense + 6 * 3 * 8 * (25 + 9)  # causal: half the square
    # logits for 2 positions only
    assert training_flops(shape, seqlens, lm_head_tokens=2, causal=False) == dense - 6 * 10 * 8 * 6 + 12 * 3 * 8 * 34
    assert forward_flops(shape, seqlens) == pytest.approx(training_flops(shape, seqlens) / 3)


@pytest.mark.parametrize("backward", [False, True])
def test_formula_matches_torch_flop_counter(backward):
    """Eager attention computes the whole s x s square with two matmuls: torch's counter of matmul FLOPs
    must then agree with the formula's non-causal count, forward alone and forward + backward."""
    torch.manual_seed(0)
    model = Qwen2ForCausalLM._from_config(Qwen2Config(**TINY), attn_implementation="eager")
    seq = 24
    input_ids = torch.randint(0, TINY["vocab_size"], (2, seq))
    counter = FlopCounterMode(display=False)
    with counter:
        logits = model(input_ids=input_ids).logits
        if backward:
            logits.float().sum().backward()
    expected = (training_flops if backward else forward_flops)(model.config, [seq, seq], causal=False)
    assert counter.get_total_flops() == pytest.approx(expected, rel=1e-9)


def test_peak_table():
    assert peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_bf16_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_bf16_flops("NVIDIA H200") == 989e12
    assert peak_bf16_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_bf16_flops("NVIDIA RTX A1000") is None  # not an A100
    assert peak_bf16_flops("Tesla V100-SXM2-16GB") is None
    assert mfu(1e15, 2.0, None) is None
    assert mfu(989e12, 2.0, 989e12) == pytest.approx(0.5)


def test_actor_update_mfu():
    attention_mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    response_mask = torch.tensor([[1, 1], [1, 0]])
    flops = training_flops(QWEN_1_5B, [4, 4], lm_head_tokens=3)
    got = actor_update_mfu(QWEN_1_5B, attention_mask, response_mask, seconds=0.5, ppo_epochs=2, peak_flops=1e15)
    assert got == pytest.approx(2 * flops / (0.5 * 1e15))
    if not device.is_cuda():  # a CPU's peak is its measured matmul rate (cached)
        assert device_peak_flops() == cpu_peak_flops() > 0
        assert actor_update_mfu(QWEN_1_5B, attention_mask, response_mask, seconds=0.5) == pytest.approx(
            flops / (0.5 * cpu_peak_flops()))


class CountingMeasure:
    def __init__(self, flops: float):
        self.flops, self.calls = flops, 0

    def __call__(self) -> float:
        self.calls += 1
        return self.flops


@pytest.fixture
def fresh_process(monkeypatch):
    """As in a new process: nothing remembered in memory, only what the cache files hold; a load average of
    2 unless a test sets another."""
    monkeypatch.setattr(flops_counter, "_CPU_PEAKS", {})
    monkeypatch.setattr(flops_counter, "load_average", lambda: 2.0)
    return flops_counter._CPU_PEAKS


def test_cpu_peak_is_measured_once_per_machine_and_read_from_the_cache_after(tmp_path, fresh_process):
    first = CountingMeasure(5e10)
    assert cpu_peak_flops(tmp_path, measure=first) == 5e10 and first.calls == 1
    [path] = (tmp_path / "peak-flops").iterdir()
    assert json.loads(path.read_text()) == {**flops_counter.cpu_identity(), "flops": 5e10, "load_average": 2.0,
                                            "matmul_size": flops_counter.MATMUL_SIZE}
    fresh_process.clear()  # a later process on this machine reads the file, and measures nothing
    later = CountingMeasure(7e10)
    assert cpu_peak_flops(tmp_path, measure=later) == 5e10 and later.calls == 0


def test_a_quieter_machine_measures_again_and_keeps_the_higher_rate(tmp_path, fresh_process, monkeypatch):
    monkeypatch.setattr(flops_counter, "load_average", lambda: 6.0)  # measured while others were busy
    cpu_peak_flops(tmp_path, measure=CountingMeasure(2e10))
    [path] = (tmp_path / "peak-flops").iterdir()
    fresh_process.clear()
    monkeypatch.setattr(flops_counter, "load_average", lambda: 5.5)  # about as busy: the file stands
    assert cpu_peak_flops(tmp_path, measure=(same := CountingMeasure(9e10))) == 2e10 and same.calls == 0
    fresh_process.clear()
    monkeypatch.setattr(flops_counter, "load_average", lambda: 1.0)  # quieter: measured again, the higher kept
    assert cpu_peak_flops(tmp_path, measure=(quiet := CountingMeasure(6e10))) == 6e10 and quiet.calls == 1
    assert json.loads(path.read_text())["load_average"] == 1.0
    fresh_process.clear()
    assert cpu_peak_flops(tmp_path, measure=(lower := CountingMeasure(1e10))) == 6e10 and lower.calls == 0
    # a new measurement that comes out lower does not replace the stored rate
    fresh_process.clear()
    monkeypatch.setattr(flops_counter, "load_average", lambda: 6.0)
    cpu_peak_flops(tmp_path / "other", measure=CountingMeasure(5e10))
    fresh_process.clear()
    monkeypatch.setattr(flops_counter, "load_average", lambda: 1.0)
    assert cpu_peak_flops(tmp_path / "other", measure=(noisy := CountingMeasure(3e10))) == 5e10 and noisy.calls == 1


def test_another_thread_count_is_another_cache_entry(tmp_path, fresh_process):
    threads = torch.get_num_threads()
    cpu_peak_flops(tmp_path, measure=CountingMeasure(5e10))
    try:
        torch.set_num_threads(threads + 1)
        other = CountingMeasure(9e10)
        assert cpu_peak_flops(tmp_path, measure=other) == 9e10 and other.calls == 1
    finally:
        torch.set_num_threads(threads)
    assert len(list((tmp_path / "peak-flops").iterdir())) == 2


@pytest.mark.parametrize("content", ["{not json", "", "[1, 2]", '{"flops": -1}', '{"flops": "fast"}'])
def test_a_corrupt_cache_file_is_measured_again_and_rewritten(tmp_path, fresh_process, content):
    cpu_peak_flops(tmp_path, measure=CountingMeasure(5e10))
    [path] = (tmp_path / "peak-flops").iterdir()
    stored = json.loads(path.read_text())
    path.write_text(content if "flops" not in content else json.dumps({**stored, **json.loads(content)}))
    fresh_process.clear()
    again = CountingMeasure(6e10)
    assert cpu_peak_flops(tmp_path, measure=again) == 6e10 and again.calls == 1
    assert json.loads(path.read_text())["flops"] == 6e10


def test_the_matmul_measurement_is_the_best_rate_within_its_budget(monkeypatch):
    # the clock read at: start; rep 1 begin, end; rep 2 begin, end, budget check; rep 3 begin, end, check
    ticks = iter([0.0, 0.0, 0.3, 0.3, 0.4, 0.4, 0.4, 0.6, 0.6])  # reps of 0.3 s, 0.1 s, 0.2 s
    monkeypatch.setattr(flops_counter.time, "perf_counter", lambda: next(ticks))
    calls = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: calls.append(a.shape) or real_mm(a, b))
    rate = flops_counter.measure_matmul_flops(size=64, budget_s=0.5)
    # the warm-up and 3 timed reps: the third ends 0.6 s after the start, past the budget
    assert calls == [(64, 64)] * 4 and rate == pytest.approx(2 * 64**3 / 0.1)
