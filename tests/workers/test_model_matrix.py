"""The model matrix: every family of `hflow.tasks.model_families.FAMILIES` through hflow's real paths.

Per family (a tiny model built from its transformers config, the built-in tokenizer), one test per check
of `CHECKS`: the packed (remove-padding) forward equals the padded one; FSDP2 wraps it layer by layer and
computes the same log-probs; the vLLM CPU engine's sampling log-probs equal the trainer's; hflow's weight
stream reloads changed weights into the engine exactly; two in-process GRPO steps train it. A check the
installed stack cannot run for a family is a strict xfail carrying the family table's reason, so it turns
red the day it starts to work. `python -m bench.model_matrix` runs this file and writes the README table.

The family fixture is module-scoped and parametrized indirectly: pytest runs a family's tests together,
so each family's model folder and engine are built once (one engine alive at a time).
"""

from __future__ import annotations

import dataclasses
import gc
import threading
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from hflow.algorithms.core_algos import compute_grpo_outcome_advantage
from hflow.protocol import DataProto
from hflow.single_controller.base.worker import get_free_port
from hflow.tasks.model_families import CHECKS, FAMILIES, build_family
from hflow.trainer.config import default_config
from hflow.utils.torch_functional import compute_position_id_with_mask
from hflow.workers.actor import DataParallelPPOActor
from hflow.workers.config import resolved_copy
from hflow.workers.fsdp import apply_fsdp2, full_param_shapes, iter_full_params, load_causal_lm
from hflow.workers.fsdp.sharding import decoder_layers
from hflow.workers.weight_sync import StreamedWeights, WeightGroup, manifest_of, send_weights

PACKED_ATOL = 1e-5  # packed vs padded, the remove-padding tests' tolerance
PARITY_TOL = 1e-4  # vLLM vs the trainer, fp32: the rollout tests' tolerance
TEMPERATURE = 0.8
# Prompts of >= 128 tokens (the CPU prefix-cache block size: a stale cache after a reload shows) and
# longer than the Gemma families' sliding window (a path that ignores the window shows).
PROMPT_LENGTH, RESPONSE_LENGTH, SAMPLES = 192, 16, 4
CONTEXT = "The quick brown fox jumps over the lazy dog. " * 8
QUESTIONS = ["What is 17 plus 25?", "Tom has 3 apples and buys 4 more. How many apples does he have?"]


# The fast tier checks the built-in model's family and one MoE family; the rest of the matrix is slow
# (an engine and a model per family: about 5 of the file's 6 minutes).
FAST_FAMILIES = ("qwen2", "qwen3_moe")


def family_params(check: str) -> list:
    """Every family for `check`; those the stack cannot run are strict xfails with the table's reason."""
    params = []
    for name, family in FAMILIES.items():
        marks = [pytest.mark.xfail(strict=True, reason=family.unsupported[check])] if check in family.unsupported else []
        params.append(pytest.param(name, marks=marks + ([] if name in FAST_FAMILIES else [pytest.mark.slow])))
    return params


def test_every_check_has_its_test():
    """The README table's columns are this file's tests: a check without a test would be an empty column."""
    assert set(CHECKS) == {name.removeprefix("test_matrix_") for name in globals() if name.startswith("test_matrix_")}


# ---- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def family(request, tmp_path_factory) -> tuple[str, Path]:
    name = request.param
    return name, build_family(name, tmp_path_factory.mktemp(name))


@pytest.fixture()
def mesh(world):
    """A one-rank mesh on the module's gloo world (re-made if an engine's teardown took the world down:
    an in-process engine shares the default process group and destroys it with its own)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from tests.ranks import free_port

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    return init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))


@pytest.fixture(scope="module")
def engine(world, family):
    """The family's in-process vLLM engine (fp32), built once and torn down before the next family's."""
    from transformers import AutoConfig, AutoTokenizer

    from hflow.workers.rollout.vllm_rollout import vLLMRollout

    name, path = family
    config = default_config().actor_rollout_ref.rollout
    settings = {"n": SAMPLES, "temperature": TEMPERATURE, "prompt_length": PROMPT_LENGTH,
                "response_length": RESPONSE_LENGTH, "dtype": "float32", "enforce_eager": True,
                "kv_cache_memory_bytes": 32 * 2**20, "gpu_memory_utilization": 0.5, "seed": 0,
                "load_format": "auto"}  # the folder's weights: parity needs no reload
    for key, value in settings.items():
        OmegaConf.update(config, key, value, merge=True)
    rollout = vLLMRollout(str(path), config, AutoTokenizer.from_pretrained(path), AutoConfig.from_pretrained(path))
    yield rollout
    del rollout
    gc.collect()


# ---- helpers ------------------------------------------------------------------------------------


def make_actor(model: torch.nn.Module, remove_padding: bool, lr: float = 0.0) -> DataParallelPPOActor:
    config = resolved_copy(default_config().actor_rollout_ref.actor)
    settings = {"use_remove_padding": remove_padding, "ppo_mini_batch_size_per_rank": len(QUESTIONS) * SAMPLES,
                "ppo_micro_batch_size_per_gpu": 4, "shuffle": False, "grad_clip": 1.0}
    for key, value in settings.items():
        OmegaConf.update(config, key, value)
    return DataParallelPPOActor(config, model, torch.optim.AdamW(model.parameters(), lr=lr) if lr else None)


def padded_batch(path: Path) -> DataProto:
    """Left-padded prompts of very different lengths (10 to 150 tokens) with right-padded random responses,
    as the trainer sees a rollout."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    gen = torch.Generator().manual_seed(0)
    prompt_lens, response_lens = [150, 10, 70, 33], [16, 3, 9, 1]
    rows = len(prompt_lens)
    text = tokenizer(CONTEXT * 2)["input_ids"]
    prompt_mask = (torch.arange(PROMPT_LENGTH) >= PROMPT_LENGTH - torch.tensor(prompt_lens)[:, None]).long()
    response_mask = (torch.arange(RESPONSE_LENGTH) < torch.tensor(response_lens)[:, None]).long()
    prompts = torch.full((rows, PROMPT_LENGTH), tokenizer.pad_token_id)
    for row, length in enumerate(prompt_lens):
        prompts[row, PROMPT_LENGTH - length:] = torch.tensor(text[row:row + length])
    responses = torch.randint(5, len(tokenizer), (rows, RESPONSE_LENGTH), generator=gen)
    responses = torch.where(response_mask.bool(), responses, tokenizer.pad_token_id)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=-1)
    return DataProto.from_dict(
        {"input_ids": torch.cat([prompts, responses], dim=-1), "responses": responses,
         "attention_mask": attention_mask, "position_ids": compute_position_id_with_mask(attention_mask),
         "response_mask": response_mask},
        meta_info={"temperature": TEMPERATURE, "micro_batch_size": 4},
    )


def chat_prompts(path: Path) -> DataProto:
    """The questions, chat-formatted after a long context, left-padded to PROMPT_LENGTH."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    rows = [tokenizer.apply_chat_template([{"role": "user", "content": CONTEXT + q}], add_generation_prompt=True,
                                          return_dict=True)["input_ids"] for q in QUESTIONS]
    input_ids = torch.full((len(rows), PROMPT_LENGTH), tokenizer.pad_token_id)
    attention_mask = torch.zeros_like(input_ids)
    for i, row in enumerate(rows):
        assert 128 <= len(row) <= PROMPT_LENGTH
        input_ids[i, PROMPT_LENGTH - len(row):] = torch.tensor(row)
        attention_mask[i, PROMPT_LENGTH - len(row):] = 1
    return DataProto.from_dict(
        {"input_ids": input_ids, "attention_mask": attention_mask,
         "position_ids": compute_position_id_with_mask(attention_mask)},
        meta_info={"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id},
    )


def trainer_log_probs(actor: DataParallelPPOActor, output: DataProto, temperature: float = TEMPERATURE) -> torch.Tensor:
    output.meta_info.update(temperature=temperature, micro_batch_size=4)
    return actor.compute_log_prob(output)[0]


def max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return (a - b).abs()[mask.bool()].max().item()


def stream_into(rollout, model: torch.nn.Module) -> int:
    """Send `model`'s full weights through hflow's weight stream (a sender thread, the training pool's rank 0)
    into the engine (this thread, a rollout rank), as `trainer.placement=split` does. Returns the tensors sent."""
    shapes = full_param_shapes(model)
    manifest = dataclasses.replace(manifest_of(shapes, torch.float32), bucket_bytes=2**20)
    port, errors, sent = get_free_port(), [], []

    def sender():
        try:
            group = WeightGroup("127.0.0.1", port, rank=0, world_size=2, timeout_s=60)
            sent.append(send_weights(group, manifest, iter_full_params(model)))
        except Exception as err:  # noqa: BLE001 - raised below
            errors.append(err)

    thread = threading.Thread(target=sender)
    thread.start()
    group = WeightGroup("127.0.0.1", port, rank=1, world_size=2, timeout_s=60)
    rollout.update_weights(StreamedWeights(group, manifest))
    thread.join(timeout=60)
    assert not errors, errors
    return len(shapes)


@torch.no_grad()
def perturb_(model: torch.nn.Module, seed: int, scale: float = 0.05) -> None:
    """Move every weight by seeded noise, as training would (a stale or partial reload then shows)."""
    generator = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=generator) * scale)


# ---- the checks ---------------------------------------------------------------------------------


@pytest.mark.parametrize("family", family_params("packed"), indirect=True)
def test_matrix_packed(family):
    name, path = family
    data = padded_batch(path)
    model = load_causal_lm(str(path))
    padded = make_actor(model, remove_padding=False).compute_log_prob(data, calculate_entropy=True)
    packed = make_actor(model, remove_padding=True).compute_log_prob(data, calculate_entropy=True)
    mask = data.batch["response_mask"]
    for ours, reference in zip(packed, padded):
        torch.testing.assert_close(ours, reference * mask, atol=PACKED_ATOL, rtol=0)


@pytest.mark.parametrize("family", family_params("fsdp2"), indirect=True)
def test_matrix_fsdp2(family, mesh):
    from torch.distributed.fsdp import FSDPModule

    name, path = family
    data = padded_batch(path)
    plain = make_actor(load_causal_lm(str(path)), remove_padding=False).compute_log_prob(data)[0]
    model = apply_fsdp2(load_causal_lm(str(path)), mesh, fsdp_on_one_rank=True)
    layers = decoder_layers(model)
    assert len(layers) == model.config.num_hidden_layers
    assert all(isinstance(m, FSDPModule) for m in [*layers, model])
    assert {type(p).__name__ for p in model.parameters()} == {"DTensor"}  # experts and all: nothing left out
    wrapped = make_actor(model, remove_padding=False).compute_log_prob(data)[0]
    torch.testing.assert_close(wrapped, plain, atol=PACKED_ATOL, rtol=0)


@pytest.mark.parametrize("family", family_params("parity"), indirect=True)
def test_matrix_parity(family, engine):
    """The engine loaded the folder's weights, the trainer loads the same: their log-probs at T on sampled
    responses to long prompts agree. (After a weight update: the reload check.)"""
    name, path = family
    model = load_causal_lm(str(path))
    output = engine.generate_sequences(chat_prompts(path))
    mask = output.batch["attention_mask"][:, PROMPT_LENGTH:]
    diff = max_diff(output.batch["rollout_log_probs"], trainer_log_probs(make_actor(model, True), output), mask)
    print(f"{name}: max |vLLM - trainer| log-prob {diff:.2e}")
    assert diff < PARITY_TOL


@pytest.mark.parametrize("family", family_params("reload"), indirect=True)
def test_matrix_reload(family, engine):
    """A reload of the folder's own weights leaves the engine bitwise as it started (an MoE's experts are
    re-packed: `rollout.cpu_experts`). Through the stream, every tensor arrives: the engine then scores
    exactly as after a direct reload of the same weights (bitwise), and as the trainer does; against the
    weights before, it is far off."""
    name, path = family
    model = load_causal_lm(str(path))
    prompts = chat_prompts(path)
    prompts.meta_info["do_sample"] = False  # greedy: the same responses for the same weights
    fresh = engine.generate_sequences(prompts)  # the folder's weights: no earlier check updates the engine
    engine.update_weights(iter_full_params(model))
    before = engine.generate_sequences(prompts)
    assert torch.equal(before.batch["responses"], fresh.batch["responses"])
    assert torch.equal(before.batch["rollout_log_probs"], fresh.batch["rollout_log_probs"])
    perturb_(model, seed=2)
    engine.update_weights(iter_full_params(model))
    direct = engine.generate_sequences(prompts)
    engine.update_weights(iter_full_params(load_causal_lm(str(path))))  # back to the old weights
    assert stream_into(engine, model) == len(full_param_shapes(model)) > 0
    streamed = engine.generate_sequences(prompts)
    assert torch.equal(streamed.batch["responses"], direct.batch["responses"])
    assert torch.equal(streamed.batch["rollout_log_probs"], direct.batch["rollout_log_probs"])
    mask = streamed.batch["attention_mask"][:, PROMPT_LENGTH:]
    actor = make_actor(model, remove_padding=True)  # greedy log-probs are those of the untempered distribution
    assert max_diff(streamed.batch["rollout_log_probs"], trainer_log_probs(actor, streamed, 1.0), mask) < PARITY_TOL
    assert max_diff(before.batch["rollout_log_probs"], trainer_log_probs(actor, before, 1.0),
                    before.batch["attention_mask"][:, PROMPT_LENGTH:]) > 0.1


@pytest.mark.parametrize("family", family_params("grpo"), indirect=True)
def test_matrix_grpo(family, engine, mesh):
    """Two GRPO steps as the trainer runs them, in one process: sample n per prompt, score (a rule: the
    share of even token ids), group-normalised advantages, one AdamW step of the FSDP2-wrapped actor, the
    new weights streamed into the engine. The weights move, the loss and gradient are finite."""
    name, path = family
    model = apply_fsdp2(load_causal_lm(str(path)), mesh, fsdp_on_one_rank=True)
    actor = make_actor(model, remove_padding=True, lr=1e-3)
    engine.update_weights(iter_full_params(model))
    start = {n: t.clone() for n, t in iter_full_params(model)}
    for step in range(2):
        batch = engine.generate_sequences(chat_prompts(path))
        mask = batch.batch["attention_mask"][:, PROMPT_LENGTH:]
        batch.batch["response_mask"] = mask
        share = ((batch.batch["responses"] % 2 == 0) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        rewards = torch.zeros(mask.shape)
        rewards[torch.arange(len(share)), mask.sum(-1) - 1] = share
        group = torch.arange(len(QUESTIONS)).repeat_interleave(SAMPLES)
        batch.batch["advantages"], _ = compute_grpo_outcome_advantage(rewards, mask, group)
        batch.batch["old_log_probs"] = trainer_log_probs(actor, batch)
        metrics = actor.update_policy(batch)
        assert all(torch.isfinite(torch.tensor(metrics[k])).all() for k in ("actor/pg_loss", "actor/grad_norm"))
        stream_into(engine, model)
    moved = max((t - start[n]).abs().max().item() for n, t in iter_full_params(model))
    assert moved > 1e-4, moved


@pytest.mark.parametrize("family", ["qwen3_next"], indirect=True)
def test_packing_refuses_linear_attention_whose_rows_would_leak(family, monkeypatch):
    """The reason in the table is real: hflow refuses to pack a hybrid linear-attention model, naming the key;
    with the refusal switched off, its packed log-probs are not the padded ones."""
    from hflow.utils import packing

    name, path = family
    data = padded_batch(path)
    model = load_causal_lm(str(path))
    with pytest.raises(ValueError, match="linear_attention layers carry state.*use_remove_padding=false"):
        make_actor(model, remove_padding=True).compute_log_prob(data)
    monkeypatch.setattr(packing, "packing_unsupported", lambda model: None)
    packed = make_actor(model, remove_padding=True).compute_log_prob(data)[0]
    padded = make_actor(model, remove_padding=False).compute_log_prob(data)[0]
    assert (packed - padded * data.batch["response_mask"]).abs().max() > 1e-3


@pytest.mark.parametrize("family", [name for name, family in FAMILIES.items() if family.moe], indirect=True)
def test_weights_leave_the_trainer_in_the_checkpoint_layout(family, mesh):
    """transformers 5 holds an MoE layer's experts fused; what hflow sends to vLLM, streams and exports is the
    checkpoint's per-expert layout: the folder's names, shapes and values, from the FSDP2-wrapped model too."""
    from safetensors.torch import load_file

    name, path = family
    on_disk = load_file(str(path / "model.safetensors"))
    assert any(".experts.0." in key for key in on_disk)
    model = apply_fsdp2(load_causal_lm(str(path)), mesh, fsdp_on_one_rank=True)
    sent = dict(iter_full_params(model))
    assert sent.keys() == on_disk.keys()
    assert all(torch.equal(sent[key], on_disk[key]) for key in on_disk)
    assert [(n, tuple(s)) for n, s, _ in full_param_shapes(model)] == [(n, tuple(t.shape)) for n, t in sent.items()]
