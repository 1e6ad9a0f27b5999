"""Step and validation metrics: names and formulas as verl logs them (on real DataProtos)."""

import math

import numpy as np
import pytest
import torch

from hflow.protocol import DataProto
from hflow.trainer.ppo.metric_utils import (
    bootstrap_metric,
    calc_maj_val,
    compute_data_metrics,
    compute_throughout_metrics,
    compute_timing_metrics,
    format_validation_metrics,
    process_validation_metrics,
    reduce_metrics,
)


def test_reduce_metrics():
    reduced = reduce_metrics(
        {
            "loss": [1.0, 2.0, 3.0],
            "accuracy": [0.0, 0.5, 1.0],
            "empty": [],
            "single": [7.0],
            "perf/max_memory_allocated_gb": [1.0, 4.0, 2.0],
            "timing_s/gen_min": [3.0, 1.0],
            "admin_terminated": [1.0, 3.0],  # "min" inside a word is not the min rule
        }
    )
    assert reduced["loss"] == 2.0
    assert reduced["accuracy"] == 0.5
    assert math.isnan(reduced["empty"])
    assert reduced["single"] == 7.0
    assert reduced["perf/max_memory_allocated_gb"] == 4.0
    assert reduced["timing_s/gen_min"] == 1.0
    assert reduced["admin_terminated"] == 2.0


def make_batch(use_critic=True):
    """Two samples: prompts of 2 and 3 tokens (P=3), responses of 2 and 3 tokens (L=3)."""
    attention_mask = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    response_mask = attention_mask[:, 3:]
    scores = torch.tensor([[0.0, 3.0, 0.0], [0.0, 0.0, 7.0]])
    tensors = {
        "responses": torch.ones(2, 3, dtype=torch.long),
        "attention_mask": attention_mask,
        "token_level_scores": scores,
        "token_level_rewards": torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 4.0]]),
        "advantages": torch.tensor([[0.5, -0.5, 9.0], [1.0, 2.0, 3.0]]),  # 9.0 is masked out
        "returns": torch.tensor([[1.0, 2.0, 0.0], [3.0, 4.0, 5.0]]),
        "response_mask": response_mask,
    }
    if use_critic:
        tensors["values"] = torch.tensor([[1.0, 1.0, 100.0], [2.0, 3.0, 4.0]])
    return DataProto.from_dict(tensors)


def test_compute_data_metrics():
    metrics = compute_data_metrics(make_batch(), use_critic=True)

    assert metrics["critic/score/mean"] == 5.0
    assert (metrics["critic/score/max"], metrics["critic/score/min"]) == (7.0, 3.0)
    assert metrics["critic/rewards/mean"] == 2.5
    assert metrics["critic/advantages/max"] == 3.0  # the masked-out 9.0 is not counted
    assert metrics["critic/advantages/mean"] == pytest.approx((0.5 - 0.5 + 1 + 2 + 3) / 5)
    assert metrics["critic/returns/mean"] == pytest.approx(3.0)
    assert metrics["critic/values/max"] == 4.0
    returns, values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]), torch.tensor([1.0, 1.0, 2.0, 3.0, 4.0])
    expected_ev = 1 - torch.var(returns - values) / (torch.var(returns) + 1e-5)
    assert metrics["critic/vf_explained_var"] == pytest.approx(expected_ev.item())
    assert metrics["response_length/mean"] == 2.5
    assert (metrics["response_length/max"], metrics["response_length/min"]) == (3.0, 2.0)
    assert metrics["response_length/clip_ratio"] == 0.5
    assert metrics["prompt_length/mean"] == 2.5
    assert metrics["prompt_length/clip_ratio"] == 0.5


def test_compute_data_metrics_without_critic():
    metrics = compute_data_metrics(make_batch(use_critic=False), use_critic=False)
    assert "critic/score/mean" in metrics and "critic/advantages/mean" in metrics
    assert not any(key.startswith("critic/values") for key in metrics)
    assert "critic/vf_explained_var" not in metrics


def test_response_mask_falls_back_to_attention_mask():
    batch = make_batch()
    batch.pop(batch_keys=["response_mask"])
    assert compute_data_metrics(batch)["response_length/mean"] == 2.5


def test_compute_timing_metrics():
    # 6 response tokens and 6 prompt tokens.
    attention_mask = torch.tensor([[1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 0]])
    batch = DataProto.from_dict({"responses": torch.ones(3, 3, dtype=torch.long), "attention_mask": attention_mask})
    timing_raw = {"gen": 0.5, "ref": 0.3, "values": 0.2, "reward": 0.1}
    metrics = compute_timing_metrics(batch, timing_raw)
    assert metrics["timing_s/gen"] == 0.5 and metrics["timing_s/reward"] == 0.1
    assert metrics["timing_per_token_ms/gen"] == pytest.approx(0.5 * 1000 / 6)
    assert metrics["timing_per_token_ms/ref"] == pytest.approx(0.3 * 1000 / 12)
    assert metrics["timing_per_token_ms/values"] == pytest.approx(0.2 * 1000 / 12)
    assert "timing_per_token_ms/reward" not in metrics


def test_compute_throughout_metrics():
    batch = DataProto.from_dict(
        {"attention_mask": torch.ones(3, 4, dtype=torch.long)}, meta_info={"global_token_num": [100, 200, 300]}
    )
    metrics = compute_throughout_metrics(batch, {"step": 2.0}, n_gpus=1)
    assert metrics["perf/total_num_tokens"] == 600
    assert metrics["perf/time_per_step"] == 2.0
    assert metrics["perf/throughput"] == 300
    assert compute_throughout_metrics(batch, {"step": 2.0}, n_gpus=2)["perf/throughput"] == 150
    # Without global_token_num: the same count from the attention mask.
    plain = DataProto.from_dict({"attention_mask": torch.ones(3, 4, dtype=torch.long)})
    assert compute_throughout_metrics(plain, {"step": 1.0}, n_gpus=1)["perf/total_num_tokens"] == 12


def test_bootstrap_metric():
    results = bootstrap_metric([1, 2, 3, 4, 5], subset_size=3, reduce_fns=[np.mean, np.max], n_bootstrap=100, seed=42)
    assert len(results) == 2
    (mean_of_means, _), (mean_of_max, _) = results
    assert abs(mean_of_means - 3.0) < 0.3
    assert 3.5 < mean_of_max < 5.0
    assert results == bootstrap_metric([1, 2, 3, 4, 5], 3, [np.mean, np.max], n_bootstrap=100, seed=42)
    with pytest.raises(ValueError):
        bootstrap_metric([], 3, [np.mean])


def test_calc_maj_val():
    data = [{"pred": "A", "val": 0.9}, {"pred": "B", "val": 0.8}, {"pred": "A", "val": 0.7}]
    assert calc_maj_val(data, vote_key="pred", val_key="val") == 0.9
    tie = [{"pred": "A", "val": 0.9}, {"pred": "B", "val": 0.8}]
    assert calc_maj_val(tie, vote_key="pred", val_key="val") in (0.9, 0.8)


def test_process_validation_metrics():
    result = process_validation_metrics(
        data_sources=["source1", "source1", "source2"],
        sample_inputs=["prompt1", "prompt1", "prompt2"],
        infos_dict={"score": [0.8, 0.9, 0.7], "label": ["x", "y", "z"]},
    )
    assert result["source1"]["score"]["mean@2"] == pytest.approx(0.85)
    assert result["source1"]["score"]["std@2"] == pytest.approx(0.05)
    assert "best@2/mean" in result["source1"]["score"] and "worst@2/std" in result["source1"]["score"]
    assert result["source2"]["score"] == {"mean@1": 0.7}
    assert "label" not in result["source1"]  # strings are not averaged


def test_process_validation_metrics_majority_and_prompt_averaging():
    result = process_validation_metrics(
        data_sources=["s"] * 6,
        sample_inputs=["p1"] * 3 + ["p2"] * 3,
        infos_dict={"reward": [1.0, 0.0, 1.0, 0.0, 0.0, 0.0], "pred": ["7", "8", "7", "1", "2", "2"]},
    )
    metrics = result["s"]["reward"]
    assert metrics["mean@3"] == pytest.approx((2 / 3 + 0) / 2)
    assert {"maj@2/mean", "maj@2/std", "maj@3/mean", "best@3/mean", "worst@3/mean"} <= set(metrics)
    assert "pred" not in result["s"]


def test_format_validation_metrics():
    processed = process_validation_metrics(["gsm8k", "gsm8k"], ["p1", "p2"], {"reward": [1.0, 0.0], "acc": [1, 0]})
    flat = format_validation_metrics(processed)
    assert flat["val-core/gsm8k/acc/mean@1"] == 0.5
    assert flat["val-aux/gsm8k/reward/mean@1"] == 0.5

    greedy = format_validation_metrics(process_validation_metrics(["a"], ["p"], {"reward": [1.0]}))
    assert greedy == {"val-core/a/reward/mean@1": 1.0}

    sampled = format_validation_metrics(
        process_validation_metrics(["a"] * 4, ["p"] * 4, {"reward": [1.0, 0.0, 0.0, 1.0]})
    )
    assert sampled["val-core/a/reward/mean@4"] == 0.5
    assert "val-core/a/reward/best@4/mean" in sampled
    assert "val-aux/a/reward/best@2/mean" in sampled and "val-aux/a/reward/std@4" in sampled
