"""hflow.workers.fsdp: model loading (policy and value model), FSDP2 wrapping, full-parameter export, gradient
clipping, offloading, optimizer and LR schedule.

FSDP2 runs here on a process group of one (in this process, on this machine's device); the two-rank
gather and the global gradient norm are covered by `tests/workers/test_dp_actor.py`, whose two-rank
run exports its parameters with `iter_full_params` and compares them with a one-process run. On one rank,
with nothing to cast, `apply_fsdp2` leaves the model plain: the tests of FSDP2's own behaviour here ask it
to wrap anyway (`apply_fsdp2` below); the tests of that choice call `fsdp.apply_fsdp2`.
"""

from __future__ import annotations

import json
import math
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

from hflow.trainer.config import default_config
from hflow.utils import device
from hflow.workers import fsdp
from hflow.workers.fsdp import (
    build_device_mesh,
    build_lr_scheduler,
    build_optimizer,
    clip_grad_norm_and_step,
    default_attn_implementation,
    enable_gradient_checkpointing,
    fsdp_clip_grad_norm,
    gather_once_fits,
    iter_full_params,
    load_causal_lm,
    load_fsdp_model_to_device,
    load_optimizer,
    load_reward_model,
    load_value_model,
    no_grad_pass,
    offload_fsdp_model_to_cpu,
    offload_optimizer,
    rank0_broadcast_device,
    reshard_fsdp_model,
    weights_from_rank0,
)
from tests.ranks import free_port, spawn_ranks


def apply_fsdp2(model, mesh, **kwargs):
    """FSDP2 even on the one-rank mesh of these tests (see the module's docstring)."""
    return fsdp.apply_fsdp2(model, mesh, fsdp_on_one_rank=True, **kwargs)


SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)


def save_model(path: Path, arch: str = "qwen2", tie_word_embeddings: bool = False) -> Path:
    torch.manual_seed(0)
    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[arch]
    config = config_cls(vocab_size=100, max_position_embeddings=64, tie_word_embeddings=tie_word_embeddings, **SHAPE)
    model_cls(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_model(tmp_path_factory.mktemp("qwen2"))


@pytest.fixture(scope="module")
def mesh(world_of_one):
    return world_of_one


def inputs(batch: int = 3, seq: int = 7) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (batch, seq), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return {
        k: v.to(device.get_device())
        for k, v in dict(input_ids=ids, attention_mask=mask, position_ids=position_ids).items()
    }


# ------------------------------------------------------------------ loading


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_value_model_is_the_policy_backbone_with_a_deterministic_scalar_head(tmp_path: Path, arch: str):
    path = save_model(tmp_path, arch)
    policy = load_causal_lm(str(path)).state_dict()
    critic = load_value_model(str(path))
    state = critic.state_dict()
    assert {k for k in state if not k.startswith("model.")} == {"score.weight", "score.bias"}
    assert state["score.weight"].shape == (1, SHAPE["hidden_size"])
    for key in (k for k in state if k.startswith("model.")):
        assert torch.equal(state[key], policy[key]), key
    # the same head on every load (every rank, every run), and no dropout: train-mode values repeat
    torch.manual_seed(123)
    assert torch.equal(load_value_model(str(path)).score.weight, critic.score.weight)
    critic.train()
    x = {k: v.cpu() for k, v in inputs().items()}
    values = critic(**x).logits
    assert values.shape == (3, 7, 1)
    assert torch.equal(values, critic(**x).logits)


def test_load_causal_lm_applies_overrides_dtype_and_attention(model_dir: Path):
    model = load_causal_lm(str(model_dir), dtype="bf16", override_config={"rope_theta": 5000.0})
    assert model.config.rope_theta == 5000.0 or model.config.rope_parameters["rope_theta"] == 5000.0
    assert next(model.parameters()).dtype == torch.bfloat16
    assert model.config._attn_implementation == default_attn_implementation()
    # lm_head is a causal LM's, not a value head
    assert model.lm_head.weight.shape == (100, SHAPE["hidden_size"])
    # `model_dtype: null` in the config means fp32 master weights
    assert next(load_causal_lm(str(model_dir), dtype=None).parameters()).dtype == torch.float32


def test_gradient_checkpointing_gives_the_same_gradients(model_dir: Path):
    def grads(checkpointing: bool) -> dict[str, torch.Tensor]:
        model = load_causal_lm(str(model_dir))
        if checkpointing:
            enable_gradient_checkpointing(model)
            assert model.is_gradient_checkpointing
        model.train()
        model(**{k: v.cpu() for k, v in inputs().items()}).logits.square().mean().backward()
        return {n: p.grad for n, p in model.named_parameters()}

    plain, checkpointed = grads(False), grads(True)
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------ FSDP2


def test_apply_fsdp2_shards_every_decoder_layer_and_the_root(model_dir: Path, mesh):
    model = apply_fsdp2(load_causal_lm(str(model_dir)), mesh)
    assert isinstance(model, FSDPModule)
    assert all(isinstance(layer, FSDPModule) for layer in model.model.layers)
    assert all(isinstance(p, DTensor) for p in model.parameters())


def test_one_rank_with_nothing_to_cast_is_a_plain_module_that_trains_as_fsdp2_does(model_dir: Path, mesh):
    plain = fsdp.apply_fsdp2(load_causal_lm(str(model_dir)), mesh)  # fp32 weights, fp32 compute
    assert not isinstance(plain, FSDPModule)
    assert not any(isinstance(p, DTensor) for p in plain.parameters())
    assert {p.device.type for p in plain.parameters()} == {device.get_device().type}
    wrapped = apply_fsdp2(load_causal_lm(str(model_dir)), mesh)
    outputs = {}
    for name, model in (("plain", plain), ("wrapped", wrapped)):
        optimizer = build_optimizer(model.parameters(), optim_config(lr=0.01))
        for _ in range(2):
            model(**inputs()).logits.square().mean().backward()
            norm = clip_grad_norm_and_step(model, optimizer, max_norm=1.0)
        with no_grad_pass(model):
            logits = model(**inputs()).logits
        outputs[name] = (norm, logits, dict(iter_full_params(model)))
    (norm, logits, params), (norm_w, logits_w, params_w) = outputs["plain"], outputs["wrapped"]
    assert norm == pytest.approx(norm_w, rel=1e-5)
    torch.testing.assert_close(logits, logits_w, atol=1e-5, rtol=1e-5)
    assert params.keys() == params_w.keys()
    for name in params:
        torch.testing.assert_close(params[name], params_w[name], atol=1e-6, rtol=1e-5, msg=name)


class _Mesh:
    def __init__(self, ranks: int):
        self.ranks = ranks

    def size(self) -> int:
        return self.ranks


def test_fsdp2_stays_wherever_it_shards_casts_or_offloads(model_dir: Path, monkeypatch):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = load_causal_lm(str(model_dir))
    fp32, bf16 = MixedPrecisionPolicy(), MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert fsdp.nothing_for_fsdp_to_do(model, _Mesh(1), fp32)
    # a reduce dtype alone casts nothing on one rank: there is no reduction
    assert fsdp.nothing_for_fsdp_to_do(model, _Mesh(1), MixedPrecisionPolicy(reduce_dtype=torch.float32))
    assert not fsdp.nothing_for_fsdp_to_do(model, _Mesh(2), fp32)  # shards
    assert not fsdp.nothing_for_fsdp_to_do(model, _Mesh(1), bf16)  # casts the weights
    assert not fsdp.nothing_for_fsdp_to_do(model, _Mesh(1), MixedPrecisionPolicy(output_dtype=torch.bfloat16))
    # a bf16 model's fp32 head (a critic's) is computed in fp32 by FSDP2
    model_bf16 = load_causal_lm(str(model_dir), dtype=torch.bfloat16)
    assert fsdp.nothing_for_fsdp_to_do(model_bf16, _Mesh(1), fp32)
    assert not fsdp.nothing_for_fsdp_to_do(model_bf16, _Mesh(1), fp32, fp32_modules=[model_bf16.lm_head])
    # shards kept on the host of a GPU machine (FSDP2's CPUOffloadPolicy)
    monkeypatch.setattr(device, "is_cuda", lambda: True)
    assert not fsdp.nothing_for_fsdp_to_do(model, _Mesh(1), fp32, cpu_offload=True)
    assert fsdp.nothing_for_fsdp_to_do(model, _Mesh(1), fp32, cpu_offload=False)


def test_one_rank_that_only_casts_is_left_plain_with_its_compute_dtype(model_dir: Path, mesh, monkeypatch):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = fsdp.apply_fsdp2(load_causal_lm(str(model_dir)), mesh, mixed_precision={"param_dtype": "bf16"})
    assert not isinstance(model, FSDPModule)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the masters
    with no_grad_pass(model):
        assert model(**inputs()).logits.dtype == torch.bfloat16  # computed with the cast copies
    assert all(p.dtype == torch.float32 for p in model.parameters())
    # what still needs FSDP2 on one rank: host shards, cast outputs, a bf16 head computed in fp32
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    assert not fsdp.fsdp_needed(model, _Mesh(1), bf16)
    assert fsdp.fsdp_needed(model, _Mesh(2), bf16)
    assert fsdp.fsdp_needed(model, _Mesh(1), MixedPrecisionPolicy(output_dtype=torch.bfloat16))
    model_bf16 = load_causal_lm(str(model_dir), dtype=torch.bfloat16)
    assert fsdp.fsdp_needed(model_bf16, _Mesh(1), MixedPrecisionPolicy(), fp32_modules=[model_bf16.lm_head])
    monkeypatch.setattr(device, "is_cuda", lambda: True)
    assert fsdp.fsdp_needed(model, _Mesh(1), bf16, cpu_offload=True)


@pytest.mark.parametrize("tied", [False, True])
def test_iter_full_params_yields_the_unwrapped_state_dict(tmp_path: Path, mesh, tied: bool):
    path = save_model(tmp_path, tie_word_embeddings=tied)
    expected = load_causal_lm(str(path)).state_dict()
    model = apply_fsdp2(load_causal_lm(str(path)), mesh)
    exported = dict(iter_full_params(model))
    # a tied head is the embedding: exported once, under the embedding's name
    assert set(exported) == set(expected) - ({"lm_head.weight"} if tied else set())
    for name, tensor in exported.items():
        assert not isinstance(tensor, DTensor)
        torch.testing.assert_close(tensor.cpu(), expected[name], atol=0, rtol=0, msg=name)


def test_mixed_precision_from_config_mapping_and_resharding(model_dir: Path, mesh):
    expected = load_causal_lm(str(model_dir)).state_dict()
    model = apply_fsdp2(load_causal_lm(str(model_dir)), mesh, mixed_precision={"param_dtype": "bf16"})
    with torch.no_grad():
        assert model(**inputs()).logits.dtype == torch.bfloat16
    # without a backward the root stays gathered, in bf16, until resharded
    assert any(p.dtype == torch.bfloat16 for p in model.parameters())
    reshard_fsdp_model(model)
    assert all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in model.parameters())
    # the export reshards by itself: fp32 master weights, not the bf16 compute copies
    model(**inputs())
    for name, tensor in iter_full_params(model):
        assert torch.equal(tensor.cpu(), expected[name]), name
    with pytest.raises(ValueError, match="unknown keys"):
        apply_fsdp2(load_causal_lm(str(model_dir)), mesh, mixed_precision={"param": "bf16"})


def _gathered_layers(model) -> list[bool]:
    return [not isinstance(layer.mlp.up_proj.weight, DTensor) for layer in model.model.layers]


@pytest.mark.parametrize("gather_once", [True, False, None])
def test_no_grad_pass_gathers_each_layer_once_then_restores_resharding(model_dir: Path, mesh, gather_once):
    model = apply_fsdp2(load_causal_lm(str(model_dir)), mesh, gather_once_per_pass=gather_once)
    with torch.no_grad():
        expected = model(**inputs()).logits
    reshard_fsdp_model(model)
    with no_grad_pass(model):
        first = model(**inputs()).logits
        # kept gathered between micro-batches only when asked (None: a model this small is, on any device);
        # the gradient mode is off either way
        kept = True if gather_once is None else gather_once
        assert _gathered_layers(model) == [kept] * len(model.model.layers)
        assert not torch.is_grad_enabled()
        second = model(**inputs()).logits
    torch.testing.assert_close(first, expected, atol=0, rtol=0)
    torch.testing.assert_close(second, expected, atol=0, rtol=0)
    assert all(isinstance(p, DTensor) for p in model.parameters())  # nothing left gathered
    # training afterwards reshards each layer after its forward again, as configured
    model(**inputs()).logits.sum()
    assert _gathered_layers(model) == [False] * len(model.model.layers)


GB = 10**9


@pytest.mark.parametrize(("params", "expected"), [(0.5e9, True), (7.6e9, True), (14.8e9, False), (32.8e9, False)])
def test_gather_once_by_default_on_a_gpu_only_when_the_bf16_weights_fit_a_quarter_of_it(params, expected):
    """`gather_once_per_pass: null` on an 80 GB GPU: Qwen2.5-0.5B and 7B keep their bf16 weights gathered
    through a no-grad pass, 14B (~30 GB, ~77 GB with a critic) and 32B do not; on CPU every size does."""
    assert gather_once_fits(int(params), 2, 80 * GB, cuda=True) is expected
    assert gather_once_fits(int(params), 2, None, cuda=False) is True
    assert gather_once_fits(int(params), 2, 8000 * GB, cuda=True) is True  # the budget scales with the device


def test_gather_once_null_counts_the_model_in_its_compute_dtype_and_a_setting_wins(model_dir: Path, monkeypatch):
    """The default counts the unsharded model's parameters in the dtype they are gathered in (bf16 mixed
    precision: 2 bytes each) against the device's memory; true or false as given wins."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from hflow.workers.fsdp import resolve_gather_once

    model = load_causal_lm(str(model_dir))
    numel = sum(p.numel() for p in model.parameters())
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    monkeypatch.setattr(device, "device_name", lambda: "cuda")
    # a device of which the bf16 weights take a quarter, or just over
    for memory, fits in [(4 * 2 * numel, True), (4 * 2 * numel - 4, False)]:
        monkeypatch.setattr(device, "total_memory_bytes", lambda memory=memory: memory)
        assert resolve_gather_once(model, None, bf16) is fits
        assert resolve_gather_once(model, True, bf16) is True
        assert resolve_gather_once(model, False, bf16) is False
    # without mixed precision the fp32 parameters are gathered: twice the bytes
    monkeypatch.setattr(device, "total_memory_bytes", lambda: 4 * 2 * numel)
    assert resolve_gather_once(model, None, MixedPrecisionPolicy()) is False


def test_clip_grad_norm_is_the_norm_of_the_unwrapped_model(model_dir: Path, mesh):
    plain = load_causal_lm(str(model_dir))
    sharded = apply_fsdp2(load_causal_lm(str(model_dir)), mesh)
    plain(**{k: v.cpu() for k, v in inputs().items()}).logits.square().mean().backward()
    sharded(**inputs()).logits.square().mean().backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in plain.parameters()]).item()

    norm = fsdp_clip_grad_norm(sharded, max_norm=None)  # measure only
    assert isinstance(norm, float) and norm == pytest.approx(expected, rel=1e-5)
    assert fsdp_clip_grad_norm(sharded, max_norm=norm / 4) == pytest.approx(expected, rel=1e-5)
    assert fsdp_clip_grad_norm(sharded, max_norm=None) == pytest.approx(norm / 4, rel=1e-4)


def test_non_finite_gradient_skips_the_step(model_dir: Path, mesh):
    model = apply_fsdp2(load_causal_lm(str(model_dir)), mesh)
    optimizer = build_optimizer(model.parameters(), optim_config(lr=0.1))
    before = {n: t.clone() for n, t in iter_full_params(model)}
    (model(**inputs()).logits.sum() * float("inf")).backward()
    assert not math.isfinite(clip_grad_norm_and_step(model, optimizer, max_norm=1.0))
    assert all(p.grad is None for p in model.parameters())
    for name, tensor in iter_full_params(model):
        assert torch.equal(tensor, before[name]), name


def test_offload_and_reload_keep_model_and_optimizer_state(model_dir: Path, mesh):
    model = apply_fsdp2(load_causal_lm(str(model_dir)), mesh)
    optimizer = build_optimizer(model.parameters(), optim_config(lr=1e-3))
    model(**inputs()).logits.mean().backward()
    optimizer.step()
    with torch.no_grad():
        expected = model(**inputs()).logits
    state_before = {k: v.full_tensor().cpu() for k, v in next(iter(optimizer.state.values())).items() if v.dim()}

    offload_fsdp_model_to_cpu(model)
    offload_optimizer(optimizer)
    assert all(p.device.type == "cpu" for p in model.parameters())
    load_fsdp_model_to_device(model)
    load_optimizer(optimizer)

    assert all(isinstance(p, DTensor) and p.device == device.get_device() for p in model.parameters())
    state_after = next(iter(optimizer.state.values()))
    for key, tensor in state_before.items():
        torch.testing.assert_close(state_after[key].full_tensor().cpu(), tensor, atol=0, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs()).logits, expected, atol=0, rtol=0)
    model(**inputs()).logits.mean().backward()  # still trains after the round trip
    optimizer.step()


# ------------------------------------------------------------------ optimizer and schedule


def optim_config(**overrides):
    """An `optim` section at the schema's defaults, with `overrides`."""
    config = default_config().actor_rollout_ref.actor.optim
    for key, value in overrides.items():
        config[key] = value
    return config


def test_build_optimizer_reads_the_optim_config():
    params = [torch.nn.Parameter(torch.zeros(2))]
    optimizer = build_optimizer(params, optim_config(lr=3e-4, betas=[0.8, 0.95], weight_decay=0.1))
    group = optimizer.param_groups[0]
    assert isinstance(optimizer, torch.optim.AdamW)
    assert (group["lr"], group["betas"], group["weight_decay"]) == (3e-4, (0.8, 0.95), 0.1)


def lr_trace(optim_cfg: dict, total_steps: int) -> list[float]:
    config = optim_config(lr=1.0, **optim_cfg)
    optimizer = build_optimizer([torch.nn.Parameter(torch.zeros(1))], config)
    scheduler = build_lr_scheduler(optimizer, config, total_steps)
    trace = []
    for _ in range(total_steps):
        trace.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return trace


def test_lr_schedules_warmup_and_decay():
    constant = lr_trace({"lr_warmup_steps": -1, "lr_warmup_steps_ratio": 0.2, "warmup_style": "constant"}, 10)
    assert constant == pytest.approx([0.0, 0.5, 1, 1, 1, 1, 1, 1, 1, 1])
    cosine = lr_trace({"lr_warmup_steps": 2, "warmup_style": "cosine", "min_lr_ratio": 0.1}, 10)
    assert cosine[:3] == pytest.approx([0.0, 0.5, 1.0])
    assert all(a >= b for a, b in zip(cosine[2:], cosine[3:], strict=False))
    assert cosine[-1] > 0.1 and cosine[-1] < 0.2
    with pytest.raises(ValueError, match="warmup_style"):
        lr_trace({"warmup_style": "linear"}, 3)


# ------------------------------------------------------------------ rank 0 loads, the other ranks receive


def test_rank0_loading_with_one_rank_loads_and_shards_as_before(model_dir: Path, mesh):
    expected = load_causal_lm(str(model_dir)).state_dict()
    model = load_causal_lm(str(model_dir), rank0_only=True)
    with weights_from_rank0(model):  # a world of one: nothing to broadcast
        apply_fsdp2(model, mesh)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor.full_tensor().cpu(), expected[name], atol=0, rtol=0, msg=name)


def _init_world(rank: int, world_size: int, port: int):
    os.environ["HFLOW_DEVICE"] = "cpu"
    torch.set_num_threads(1)
    # a collective that one rank skips fails the test within a minute instead of hanging it
    dist.init_process_group(device.dist_backend(), init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=60))
    return build_device_mesh(world_size)


def _compare_rank0_loading_main(rank: int, world_size: int, port: int, paths: dict[str, str]) -> None:
    mesh = _init_world(rank, world_size, port)
    loaders = {"untied": load_causal_lm, "tied": load_causal_lm, "value": load_value_model, "reward": load_reward_model}
    try:
        for case, path in paths.items():
            load = loaders[case]

            offload = case == "tied"  # `offload_policy` on: host shards on a GPU, the same as without on CPU

            def shard(m):  # as the workers do; the critic's 1-row head is a unit of its own (empty on rank 1)
                return apply_fsdp2(m, mesh, fp32_modules=[m.score] if case == "value" else (), cpu_offload=offload)

            everywhere = shard(load(path))  # the old way: every rank reads the whole model
            model = load(path, rank0_only=True)
            assert all(p.is_meta for p in model.parameters()) == (rank != 0), case  # rank 1 read nothing
            with weights_from_rank0(model, cpu_offload=offload):
                shard(model)

            expected = everywhere.state_dict()
            for name, tensor in model.state_dict().items():
                assert isinstance(tensor, DTensor) and not tensor.to_local().is_meta, (case, name)
                assert torch.equal(tensor.full_tensor(), expected[name].full_tensor()), (case, name)
            # buffers are per rank; the rotary `inv_freq` ones are not in a state dict
            buffers, expected_buffers = dict(model.named_buffers()), dict(everywhere.named_buffers())
            assert any(name.endswith("inv_freq") for name in buffers)
            assert buffers.keys() == expected_buffers.keys()
            for name, buffer in buffers.items():
                assert torch.equal(buffer, expected_buffers[name]), (case, name)
            if case == "tied":
                assert model.lm_head.weight is model.model.embed_tokens.weight
            # (None on models that cannot generate, before transformers 5)
            generation, expected_generation = (getattr(m, "generation_config", None) for m in (model, everywhere))
            assert (generation and generation.to_dict()) == (expected_generation and expected_generation.to_dict())
            assert model.training == everywhere.training
            x = inputs()
            logits, expected_logits = model(**x).logits, everywhere(**x).logits
            assert torch.equal(logits.log_softmax(-1), expected_logits.log_softmax(-1)), case
        dist.barrier()  # leave together (see _rss_main)
    finally:
        dist.destroy_process_group()


def test_rank0_loading_gives_every_rank_the_model_each_rank_would_have_loaded(tmp_path: Path):
    """Two ranks: rank 0 reads the folder, rank 1 builds the model empty and receives its shards. The
    result equals the old way (every rank reads the whole model): weights, non-persistent buffers,
    ties, the critic's seeded value head, a reward model's saved head, and the forward pass."""
    untied = save_model(tmp_path / "untied")
    tied = save_model(tmp_path / "tied", arch="llama", tie_word_embeddings=True)
    torch.manual_seed(1)
    reward_config = Qwen2Config(vocab_size=100, max_position_embeddings=64, num_labels=1, pad_token_id=0, **SHAPE)
    Qwen2ForSequenceClassification(reward_config).save_pretrained(tmp_path / "reward")
    paths = {"untied": untied, "tied": tied, "value": untied, "reward": tmp_path / "reward"}
    spawn_ranks(_compare_rank0_loading_main, 2, 2, free_port(), {k: str(v) for k, v in paths.items()})


@pytest.fixture
def as_cuda(monkeypatch):
    """The device helper answers as on an 8-GPU node; nothing here makes a CUDA call."""
    monkeypatch.setattr(device, "device_name", lambda: "cuda")
    monkeypatch.setattr(device, "visible_device_count", lambda: 8)


def test_rank0_broadcast_device_is_where_the_shards_live(as_cuda):
    assert rank0_broadcast_device(cpu_offload=False) == torch.device("cuda", 0)
    assert rank0_broadcast_device(cpu_offload=True) == torch.device("cpu")  # CPUOffloadPolicy: host shards, gloo


def test_rank0_broadcast_device_on_cpu_is_the_host():
    assert rank0_broadcast_device(cpu_offload=False) == rank0_broadcast_device(cpu_offload=True) == torch.device("cpu")


class _Rotary(torch.nn.Module):
    """A parameter, a rotary-style non-persistent buffer and a persistent one."""

    def __init__(self, param_device: str | None = None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(4, 4, device=param_device))
        self.register_buffer("inv_freq", torch.arange(2.0), persistent=False)
        self.register_buffer("scale", torch.ones(3))


def _rank0_loading_as_on_a_gpu(rank: int, cpu_offload: bool, monkeypatch) -> tuple[list, set]:
    """`weights_from_rank0` as rank `rank` of two on a GPU node, with fake tensors (they carry a CUDA device
    without CUDA) and the collectives recorded: the device of every tensor rank 0's state dict is broadcast
    into, and of every buffer broadcast; and where the buffers are afterwards."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hflow.workers.fsdp import models

    seen: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(dist, "broadcast", lambda tensor, src: seen.append(("buffer", tensor.device)))
    monkeypatch.setattr(models, "set_model_state_dict", lambda model, full, options: seen.extend(
        ("state", value.device) for value in model.state_dict().values()))
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    if rank == 0:  # read from disk, then sharded: shards where the offload policy keeps them
        with fake:
            model = _Rotary("cpu" if cpu_offload else "cuda:0")
    else:
        with torch.device("meta"):  # built empty
            model = _Rotary()
    with fake:
        with weights_from_rank0(model, cpu_offload=cpu_offload):
            if rank == 0:  # what `fully_shard` does to buffers, whatever the offload policy
                for module in model.modules():
                    for name, buffer in module._buffers.items():
                        module._buffers[name] = buffer.to("cuda:0")
        return seen, {buffer.device for buffer in model.buffers()}


@pytest.mark.parametrize("cpu_offload", [False, True])
def test_every_rank_broadcasts_on_the_same_device_whatever_the_offload_policy(as_cuda, monkeypatch, cpu_offload):
    """Rank 0's buffers sit where `fully_shard` put them (the GPU, even with `offload_policy`), the other
    ranks' where their empty model is materialised: before the broadcasts every rank's shards and buffers
    go to `rank0_broadcast_device`, so no rank sends over NCCL to a rank that waits on gloo, and the state
    dict's tensors share one device (torch refuses a mix); afterwards the buffers are on the GPU."""
    source = rank0_broadcast_device(cpu_offload)
    sender, sender_buffers = _rank0_loading_as_on_a_gpu(0, cpu_offload, monkeypatch)
    receiver, receiver_buffers = _rank0_loading_as_on_a_gpu(1, cpu_offload, monkeypatch)
    assert sender == receiver == [("state", source)] * 2 + [("buffer", source)] * 2
    assert sender_buffers == receiver_buffers == {torch.device("cuda", 0)}


def _status_kib(field: str) -> int:
    """A `kB` line of /proc/self/status: VmRSS (resident now) or VmHWM (peak resident)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(f"{field}:"))


def _rss_main(rank: int, world_size: int, port: int, path: str, out_dir: str) -> None:
    mesh = _init_world(rank, world_size, port)
    try:
        # Linux: writing 5 resets VmHWM to the current RSS, so the peak below is that of the loading
        # alone. Without it, VmHWM is the process's lifetime peak: an upper bound, still fine to assert on.
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            reset = True
        except OSError:
            reset = False
        dist.barrier()
        before = _status_kib("VmRSS")
        model = load_causal_lm(path, rank0_only=True)
        with weights_from_rank0(model):
            apply_fsdp2(model, mesh)
        growth = (_status_kib("VmHWM") - before) * 1024
        shard = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps({"growth": growth, "shard": shard, "reset": reset}))
        # Both ranks leave together: a rank that tears gloo down while its peer is still connected can
        # abort the peer ("terminate called without an active exception", seen once in CI).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_rank1_host_memory_during_model_setup_is_its_shard_plus_one_tensor(tmp_path: Path, monkeypatch):
    """With rank-0 loading, rank 1's peak host memory while it sets up a 2-rank FSDP2 model grows by its
    own fp32 shard (half the model) plus one full tensor in flight, instead of the whole model.

    Half the model is the floor on CPU, where the shards live in host memory (on GPU they do not)."""
    from safetensors import safe_open

    from hflow.tasks.tiny_models import build_causal_lm

    # ~36M parameters, ~139 MiB in fp32, in 3 layers: the largest tensor (an MLP matrix, 11 MiB) is
    # small beside half the model.
    path = build_causal_lm(tmp_path / "model", preset="small", hidden_size=1024, num_layers=3, num_heads=16,
                           num_kv_heads=8, intermediate_size=2816)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        numels = [math.prod(f.get_slice(key).get_shape()) for key in f.keys()]
    model_bytes, largest_bytes = 4 * sum(numels), 4 * max(numels)

    # glibc raises its mmap threshold to the largest block freed so far and then keeps up to twice that
    # on its heap after frees (here rank 1's peak then varies between +102 and +119 MiB). A fixed
    # threshold makes the peak measure the tensors the code keeps alive, not what the allocator caches.
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    spawn_ranks(_rss_main, 2, 2, free_port(), str(path), str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    mib = 2**20
    report = (f"model {model_bytes / mib:.1f} MiB (largest tensor {largest_bytes / mib:.1f} MiB); peak RSS growth: "
              f"rank 0 {ranks[0]['growth'] / mib:.1f} MiB, rank 1 {ranks[1]['growth'] / mib:.1f} MiB "
              f"(its shard {ranks[1]['shard'] / mib:.1f} MiB; VmHWM reset: {ranks[1]['reset']})")
    print(report)
    slack = 16 * mib  # the modeling code's import, the empty model's Python objects, gloo buffers
    assert ranks[1]["shard"] <= model_bytes / 2 + largest_bytes, report
    assert ranks[1]["growth"] < ranks[1]["shard"] + largest_bytes + slack, report
    assert ranks[1]["growth"] < 0.7 * model_bytes, report  # every rank loading the model needed more than all of it
