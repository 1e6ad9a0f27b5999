"""The CUDA path on one GPU: device choice, attention kernel, FSDP2 in bf16 on a 1-rank mesh (log-probs,
update, HF generation) and the log-prob/entropy kernels. Marked `gpu`: CI (no GPU) deselects them and
scripts/gpu_check.sh runs them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from hflow.trainer.config import default_section
from hflow.protocol import DataProto
from hflow.utils import device
from hflow.utils.flops_counter import device_peak_flops
from hflow.workers.fsdp import apply_fsdp2, build_optimizer, default_attn_implementation, load_causal_lm
from hflow.utils.packing import SDPA_VARLEN
from hflow.utils.torch_functional import compute_position_id_with_mask, logprobs_from_logits
from hflow.workers.config import resolved_copy

pytestmark = pytest.mark.gpu

PROMPT, RESPONSE = 12, 10


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from hflow.tasks.tiny_models import build_causal_lm

    return build_causal_lm(tmp_path_factory.mktemp("tiny"), preset="tiny", arch="qwen2", seed=0)


def actor_config(**overrides):
    """The actor section as a worker of one rank normalises it (with `ppo_mini_batch_size_per_rank`)."""
    config = resolved_copy(default_section("actor_rollout_ref.actor"))
    for key, value in {"ppo_mini_batch_size_per_rank": 8, "ppo_micro_batch_size_per_gpu": 4, "shuffle": False,
                       **overrides}.items():
        OmegaConf.update(config, key, value)
    return config


def make_batch(n: int, vocab: int) -> DataProto:
    gen = torch.Generator().manual_seed(0)
    prompt_lens = torch.randint(3, PROMPT + 1, (n,), generator=gen)
    response_lens = torch.randint(2, RESPONSE + 1, (n,), generator=gen)
    prompt_mask = (torch.arange(PROMPT) >= PROMPT - prompt_lens[:, None]).long()
    response_mask = (torch.arange(RESPONSE) < response_lens[:, None]).long()
    responses = torch.randint(5, vocab, (n, RESPONSE), generator=gen) * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], dim=-1)
    return DataProto.from_dict({
        "input_ids": torch.cat([torch.randint(5, vocab, (n, PROMPT), generator=gen) * prompt_mask, responses], -1),
        "responses": responses,
        "attention_mask": attention_mask,
        "position_ids": compute_position_id_with_mask(attention_mask),
        "response_mask": response_mask,
        "advantages": torch.randn(n, RESPONSE, generator=gen) * response_mask,
    }, meta_info={"temperature": 1.0, "micro_batch_size": 4})


def test_device_helper_chooses_cuda():
    assert device.is_cuda()
    assert device.get_device().type == "cuda"
    assert "nccl" in device.dist_backend()
    has_bf16 = device.cuda_capability() >= device.BF16_CAPABILITY
    assert device.compute_dtype() == (torch.bfloat16 if has_bf16 else torch.float32)
    assert device.rollout_dtype() == (torch.bfloat16 if has_bf16 else torch.float16)
    assert device.total_memory_bytes() == torch.cuda.get_device_properties(0).total_memory


def test_peak_flops_known_for_datacenter_gpus():
    name = torch.cuda.get_device_name(0)
    if not any(known in name for known in ("H100", "H200", "A100")):
        pytest.skip(f"{name}: not one of the GPUs this check asserts a peak for")
    assert device_peak_flops() is not None


def test_chosen_attention_loads_and_matches_sdpa(model_dir):
    choice = default_attn_implementation()
    assert choice in (SDPA_VARLEN, "flash_attention_2")
    ids = torch.randint(5, 400, (2, 24), device="cuda")
    outputs = {}
    for impl in {choice, "sdpa"}:  # SDPA_VARLEN on padded inputs is transformers' sdpa
        model = load_causal_lm(str(model_dir), dtype=torch.bfloat16, attn_implementation=impl).cuda()
        with torch.no_grad():
            outputs[impl] = model(input_ids=ids).logits.float()
        assert torch.isfinite(outputs[impl]).all()
    assert (outputs[choice] - outputs["sdpa"]).abs().max() < 0.1


def test_fsdp2_bf16_log_probs_and_update(world_of_one, model_dir):
    reference = load_causal_lm(str(model_dir), dtype=torch.float32).cuda()
    model = load_causal_lm(str(model_dir), dtype=torch.float32)
    apply_fsdp2(model, world_of_one)  # bf16 compute, fp32 master weights and reduction
    assert next(model.parameters()).device.type == "cuda"
    from hflow.workers.actor import DataParallelPPOActor

    config = actor_config(**{"optim.lr": 1e-3})
    optimizer = build_optimizer(model.parameters(), config.optim)
    actor = DataParallelPPOActor(config, model, optimizer)
    data = make_batch(8, reference.config.vocab_size).to(device.get_device())
    log_probs, entropy = actor.compute_log_prob(data, calculate_entropy=True)
    with torch.no_grad():
        logits = reference(input_ids=data.batch["input_ids"], attention_mask=data.batch["attention_mask"],
                           position_ids=data.batch["position_ids"]).logits[:, PROMPT - 1 : -1].float()
    expected = torch.log_softmax(logits, -1).gather(-1, data.batch["responses"].unsqueeze(-1)).squeeze(-1)
    mask = data.batch["response_mask"].bool()
    assert (log_probs - expected)[mask].abs().max() < 0.1  # bf16 forward vs fp32
    assert torch.isfinite(entropy[mask]).all()

    # one GPU: a plain module of fp32 master weights, computing with bf16 copies (`fsdp.passes`)
    from hflow.workers.fsdp.passes import compute_dtype_of

    assert compute_dtype_of(model) == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in model.parameters())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    data.batch["old_log_probs"] = log_probs
    metrics = actor.update_policy(data)
    assert all(torch.isfinite(torch.tensor(v)).all() for v in metrics["actor/grad_norm"])
    assert isinstance(optimizer.defaults["fused"], bool) and optimizer.defaults["fused"]  # CUDA: fused AdamW
    changed = sum(not torch.equal(before[n], p) for n, p in model.named_parameters())
    assert changed == len(before)


def test_hf_rollout_on_fsdp2_module(world_of_one, model_dir):
    from transformers import AutoTokenizer

    from hflow.workers.rollout import HFRollout

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = load_causal_lm(str(model_dir), dtype=torch.float32)
    apply_fsdp2(model, world_of_one)
    encoded = tokenizer(["What is 2 + 3?", "Hello"], return_tensors="pt", padding=True)
    attention_mask = encoded["attention_mask"]
    prompts = DataProto.from_dict({
        "input_ids": encoded["input_ids"], "attention_mask": attention_mask,
        "position_ids": compute_position_id_with_mask(attention_mask),
    }, meta_info={"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id})
    config = default_section("actor_rollout_ref.rollout", response_length=8, n=2)
    out = HFRollout(model, config).generate_sequences(prompts.to(device.get_device()))
    assert out.batch["responses"].shape == (4, 8)
    mask = out.batch["attention_mask"][:, -8:].bool()
    assert torch.isfinite(out.batch["rollout_log_probs"][mask]).all()
    assert (out.batch["rollout_log_probs"][mask] <= 0).all()


def test_log_prob_and_entropy_kernels_in_bf16():
    from hflow.workers.actor import dp_actor

    entropy_fns = [fn for name, fn in vars(dp_actor).items()
                   if "entropy" in name and getattr(fn, "__module__", "") == "hflow.utils.torch_functional"]
    assert entropy_fns, "dp_actor calls no entropy function of torch_functional"
    logits = torch.randn(4, 64, 32000, device="cuda", dtype=torch.bfloat16) * 3
    labels = torch.randint(0, 32000, (4, 64), device="cuda")
    reference = torch.log_softmax(logits.float(), -1)
    got = logprobs_from_logits(logits, labels)
    assert (got - reference.gather(-1, labels.unsqueeze(-1)).squeeze(-1)).abs().max() < 1e-3
    expected_entropy = -(reference.exp() * reference).sum(-1)
    assert (entropy_fns[0](logits).float() - expected_entropy).abs().max() < 2e-2
