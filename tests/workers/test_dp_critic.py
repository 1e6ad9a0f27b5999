"""DataParallelPPOCritic: values on the response window under the response mask, and a value update
that learns and does not depend on micro-batching."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig, OmegaConf
from transformers import Qwen2Config, Qwen2ForCausalLM

from hflow.config_schema import default_config
from hflow.protocol import DataProto
from hflow.workers.fsdp import build_optimizer, load_value_model
from hflow.workers.seqlen_balancing import rearrange_micro_batches
from hflow.utils.torch_functional import compute_position_id_with_mask
from hflow.workers.critic import DataParallelPPOCritic
from hflow.workers.config import resolved_copy

PROMPT_LEN, RESPONSE_LEN, VOCAB = 6, 5, 100


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A causal-LM folder, as the critic gets it (the policy's weights; the value head is new)."""
    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=64,
    )
    path = tmp_path_factory.mktemp("qwen2-critic")
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def make_batch(n: int, seed: int = 0) -> DataProto:
    """Prompts of 2..P tokens (left-padded), responses of 2..L tokens (right-padded), and a response
    mask with a hole inside each response (a multi-turn observation token), so that the response mask
    and the attention mask differ."""
    gen = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(2, PROMPT_LEN + 1, (n,), generator=gen)
    response_lens = torch.randint(2, RESPONSE_LEN + 1, (n,), generator=gen)
    prompt_mask = (torch.arange(PROMPT_LEN) >= PROMPT_LEN - prompt_lens[:, None]).long()
    attended = (torch.arange(RESPONSE_LEN) < response_lens[:, None]).long()
    response_mask = attended.clone()
    response_mask[:, 1] = 0
    prompts = torch.randint(1, VOCAB, (n, PROMPT_LEN), generator=gen) * prompt_mask
    responses = torch.randint(1, VOCAB, (n, RESPONSE_LEN), generator=gen) * attended
    attention_mask = torch.cat([prompt_mask, attended], dim=-1)
    tensors = {
        "input_ids": torch.cat([prompts, responses], dim=-1),
        "responses": responses,
        "attention_mask": attention_mask,
        "position_ids": compute_position_id_with_mask(attention_mask),
        "response_mask": response_mask,
        "returns": torch.randn(n, RESPONSE_LEN, generator=gen) * response_mask,
    }
    return DataProto.from_dict(tensors, meta_info={"micro_batch_size": 3})


def critic_config(**overrides) -> DictConfig:
    """`critic` at the schema's defaults as the worker normalises it (with the derived
    `ppo_mini_batch_size_per_rank`, in sequences), with this module's settings and `overrides`."""
    config = resolved_copy(default_config().critic)
    settings = {"ppo_mini_batch_size_per_rank": 8, "ppo_micro_batch_size_per_gpu": 8, "shuffle": False, "grad_clip": 1e6}
    for key, value in {**settings, **overrides}.items():
        OmegaConf.update(config, key, value)
    return config


def load_critic_model(model_dir: Path):
    """A random (seeded) value head rather than the default zero one: values, and the backbone's
    gradients, are non-zero from the first step, so these tests see every mistake."""
    return load_value_model(str(model_dir), value_head_init="normal")


def make_critic(model_dir: Path, lr: float = 0.1, **overrides) -> DataParallelPPOCritic:
    """With plain SGD (the update is proportional to the gradient, so any mis-scaling shows)."""
    model = load_critic_model(model_dir)
    return DataParallelPPOCritic(critic_config(**overrides), model, torch.optim.SGD(model.parameters(), lr=lr))


def test_values_are_the_response_window_under_the_response_mask(model_dir: Path):
    critic = make_critic(model_dir)
    data = make_batch(6)
    values = critic.compute_values(data)

    b = data.batch
    with torch.no_grad():
        full = critic.critic_module(
            input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]
        ).logits[..., 0]
    expected = full[:, -RESPONSE_LEN - 1 : -1] * b["response_mask"]
    torch.testing.assert_close(values, expected, atol=1e-6, rtol=0)
    assert torch.all(values[b["response_mask"] == 0] == 0)
    assert torch.all(values[b["response_mask"] == 1] != 0)


def test_dynamic_bsz_values_keep_row_order(model_dir: Path):
    critic = make_critic(model_dir)
    data = make_batch(8, seed=2)
    budget = 2 * (PROMPT_LEN + RESPONSE_LEN)
    _, groups = rearrange_micro_batches(data.batch, budget)
    assert [i for g in groups for i in g] != list(range(8)), "the balancing must reorder rows for this test"
    fixed = critic.compute_values(data)
    data.meta_info.update(use_dynamic_bsz=True, max_token_len=budget)
    torch.testing.assert_close(critic.compute_values(data), fixed, atol=1e-5, rtol=0)


def test_value_loss_falls_on_a_fixed_batch(model_dir: Path):
    config = critic_config(ppo_mini_batch_size_per_rank=4, ppo_micro_batch_size_per_gpu=2, grad_clip=1.0)
    model = load_critic_model(model_dir)
    critic = DataParallelPPOCritic(config, model, build_optimizer(model.parameters(), OmegaConf.merge(config.optim, {"lr": 3e-3})))
    data = make_batch(8, seed=3)
    losses = []
    for _ in range(6):
        data.batch["values"] = critic.compute_values(data)  # fresh old values each round, as in PPO
        metrics = critic.update_critic(data)
        losses.append(sum(metrics["critic/vf_loss"]) / len(metrics["critic/vf_loss"]))
        assert set(metrics) == {"critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm"}
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_update_does_not_depend_on_micro_batching(model_dir: Path, loss_agg_mode: str):
    data = make_batch(8, seed=4)
    noise = torch.randn(8, RESPONSE_LEN, generator=torch.Generator().manual_seed(0))
    data.batch["values"] = make_critic(model_dir).compute_values(data) + noise  # some beyond the clip range
    results = []
    for overrides in (
        {"ppo_micro_batch_size_per_gpu": 8},
        {"ppo_micro_batch_size_per_gpu": 2},
        {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 25},
    ):
        critic = make_critic(model_dir, loss_agg_mode=loss_agg_mode, **overrides)
        metrics = critic.update_critic(data)
        results.append((critic.critic_module.state_dict(), metrics))
    (reference, ref_metrics), *others = results
    assert ref_metrics["critic/vf_clipfrac"][0] > 0
    initial = load_critic_model(model_dir).state_dict()
    assert max((reference[k] - initial[k]).abs().max().item() for k in initial) > 1e-3
    for params, metrics in others:
        for key in reference:
            torch.testing.assert_close(params[key], reference[key], atol=1e-5, rtol=0, msg=key)
        for key in ref_metrics:
            assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-5, abs=1e-7), key
