"""Rollout engines and the FSDP -> vLLM weight sync, on a real in-process vLLM engine (CPU, fp32).

One engine serves the whole module (built in a few seconds). Tests that depend on the engine's
weights push the weights they need first (a reload takes ~10 ms), so they do not depend on order.
Log-prob parity uses prompts of at least 128 tokens, the CPU prefix-cache block size: with shorter
prompts a missing prefix-cache reset after a weight update would go unnoticed.
"""

from __future__ import annotations

import gc
import logging
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import DictConfig, OmegaConf
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

from hflow.trainer.config import default_config
from hflow.protocol import DataProto
from hflow.utils.torch_functional import compute_position_id_with_mask, get_response_mask
from hflow.workers.rollout import HFRollout

PROMPT_LENGTH = 192
RESPONSE_LENGTH = 24
TEMPERATURE = 0.8
PARITY_TOL = 1e-4

QUESTIONS = [
    "What is 17 plus 25?",
    "Tom has 3 apples and buys 4 more. How many apples does he have?",
    "Let's think step by step: what is 6 * 7?",
]
LONG_CONTEXT = "The quick brown fox jumps over the lazy dog. " * 8  # 152 tokens


def rollout_config(**overrides) -> DictConfig:
    """`actor_rollout_ref.rollout` at the schema's defaults, with this module's settings and `overrides`."""
    config = default_config().actor_rollout_ref.rollout
    settings = {
        "n": 4,
        "temperature": TEMPERATURE,
        "prompt_length": PROMPT_LENGTH,
        "response_length": RESPONSE_LENGTH,
        "dtype": "float32",
        "enforce_eager": True,
        "kv_cache_memory_bytes": 64 * 2**20,
        "gpu_memory_utilization": 0.5,  # null resolves in the worker (normalize_actor_rollout_ref), not here
    }
    for key, value in {**settings, **overrides}.items():
        OmegaConf.update(config, key, value, merge=True)
    return config


# ---- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_build(world, tiny_model_dir, tiny_tokenizer):
    """The module's vLLMRollout (random 'dummy' weights: every test pushes the weights it needs),
    plus the host RNG states seen just before and after building it."""
    from hflow.workers.rollout.vllm_rollout import vLLMRollout

    hf_config = AutoConfig.from_pretrained(tiny_model_dir)
    torch.manual_seed(1234)
    random.seed(1234)
    np.random.seed(1234)
    before = (torch.random.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    rollout = vLLMRollout(str(tiny_model_dir), rollout_config(), tiny_tokenizer, hf_config)
    after = (torch.random.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    yield rollout, before, after
    del rollout
    gc.collect()


@pytest.fixture(scope="module")
def rollout(engine_build):
    return engine_build[0]


@pytest.fixture()
def hf_model(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return model.eval()


# ---- helpers ------------------------------------------------------------------------------------


def chat_prompt_ids(tokenizer, questions: list[str], context: str = "") -> list[list[int]]:
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": context + q}], add_generation_prompt=True, return_dict=True
        )["input_ids"]
        for q in questions
    ]


def make_prompts(tokenizer, questions: list[str], context: str = "", **non_tensors) -> DataProto:
    """Chat-formatted prompts, left-padded to PROMPT_LENGTH, with per-row non-tensor fields."""
    rows = chat_prompt_ids(tokenizer, questions, context)
    input_ids = torch.full((len(rows), PROMPT_LENGTH), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, row in enumerate(rows):
        assert len(row) <= PROMPT_LENGTH
        input_ids[i, PROMPT_LENGTH - len(row) :] = torch.tensor(row)
        attention_mask[i, PROMPT_LENGTH - len(row) :] = 1
    return DataProto.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": compute_position_id_with_mask(attention_mask),
        },
        non_tensors,
        meta_info={"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id},
    )


@torch.no_grad()
def hf_log_probs(model: torch.nn.Module, output: DataProto, temperature: float) -> torch.Tensor:
    """What the trainer computes: log_softmax(logits / T) of each response token, (B·n, L)."""
    responses = output.batch["responses"]
    logits = model(
        input_ids=output.batch["input_ids"],
        attention_mask=output.batch["attention_mask"],
        position_ids=output.batch["position_ids"],
    ).logits
    logits = logits[:, -responses.shape[1] - 1 : -1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)


def max_masked_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return (a - b).abs()[mask.bool()].max().item()


@torch.no_grad()
def perturb_(model: torch.nn.Module, generator: torch.Generator, scale: float = 0.05) -> None:
    """Move every weight by seeded noise, as a training step would (so a stale sync shows up)."""
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=generator) * scale)


def push(rollout, model: torch.nn.Module) -> None:
    rollout.update_weights((name, p.detach()) for name, p in model.named_parameters())


# ---- tiny models --------------------------------------------------------------------------------


def test_tiny_model_is_reproducible(tmp_path, tiny_model_dir):
    from hflow.tasks.tiny_models import build_causal_lm, build_token_classification

    again = build_causal_lm(tmp_path / "again", preset="tiny", arch="qwen2", seed=0)
    files = sorted(p.name for p in tiny_model_dir.iterdir())
    assert "model.safetensors" in files and "tokenizer.json" in files
    assert files == sorted(p.name for p in again.iterdir())
    for name in files:
        assert (tiny_model_dir / name).read_bytes() == (again / name).read_bytes(), name

    other_seed = build_causal_lm(tmp_path / "seed1", preset="tiny", seed=1)
    assert (other_seed / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()

    llama = AutoModelForCausalLM.from_pretrained(build_causal_lm(tmp_path / "llama", arch="llama"))
    assert type(llama).__name__ == "LlamaForCausalLM"
    assert 1_000_000 < sum(p.numel() for p in llama.parameters()) < 2_000_000

    with pytest.raises(ValueError, match="head size"):
        build_causal_lm(tmp_path / "bad", hidden_size=240)

    critic = AutoModelForTokenClassification.from_pretrained(build_token_classification(tmp_path / "critic"))
    assert critic.config.num_labels == 1


# ---- vLLM rollout -------------------------------------------------------------------------------


def test_ignore_eos_makes_every_training_sample_full_length(rollout, hf_model, tiny_tokenizer):
    """rollout.ignore_eos (fixed work for benchmarks): training samples run to response_length past EOS,
    validation still stops at EOS."""
    from hflow.workers.rollout.base import resolve_sampling

    push(rollout, hf_model)
    prompts = make_prompts(tiny_tokenizer, QUESTIONS[:2])
    eos = tiny_tokenizer.eos_token_id
    rollout.config = rollout_config(ignore_eos=True)
    try:
        assert resolve_sampling(rollout.config, {}).ignore_eos
        assert not resolve_sampling(rollout.config, {"validate": True}).ignore_eos
        params = rollout._sampling_params(resolve_sampling(rollout.config, {}), eos)
        assert params.ignore_eos and eos not in params.stop_token_ids
        # every sample runs to response_length tokens, whether or not it sampled EOS on the way
        from vllm import TokensPrompt

        requests = [TokensPrompt(prompt_token_ids=ids) for ids in chat_prompt_ids(tiny_tokenizer, QUESTIONS[:2])]
        outputs = rollout.llm.generate(requests, params, use_tqdm=False)
        lengths = [len(sample.token_ids) for output in outputs for sample in output.outputs]
        assert lengths == [RESPONSE_LENGTH] * (2 * rollout.config.n)
        out = rollout.generate_sequences(prompts)
        assert tuple(out.batch["responses"].shape) == (2 * rollout.config.n, RESPONSE_LENGTH)
    finally:
        rollout.config = rollout_config()
    assert eos in rollout._sampling_params(resolve_sampling(rollout.config, {}), eos).stop_token_ids


def test_cpu_engine_arguments_and_impossible_configs(world, tiny_model_dir):
    """On CPU: in-process engine, explicit KV cache, never sleep mode; bad configs fail before vLLM starts."""
    import os

    from hflow.workers.rollout.vllm_rollout import CPU_DEFAULT_KV_CACHE_BYTES, vLLMRollout

    hf_config = AutoConfig.from_pretrained(tiny_model_dir)
    config = rollout_config(kv_cache_memory_bytes=None)
    kwargs = vLLMRollout._engine_kwargs(str(tiny_model_dir), config, hf_config, None)
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert kwargs["distributed_executor_backend"] is None  # world of one: a plain in-process engine
    assert "enable_sleep_mode" not in kwargs and "gpu_memory_utilization" not in kwargs
    assert kwargs["kv_cache_memory_bytes"] == CPU_DEFAULT_KV_CACHE_BYTES
    assert kwargs["max_model_len"] == PROMPT_LENGTH + RESPONSE_LENGTH
    assert kwargs["logprobs_mode"] == "processed_logprobs"

    bad = {
        "enable_sleep_mode": rollout_config(engine_kwargs={"vllm": {"enable_sleep_mode": True}}),
        "tensor_model_parallel_size": rollout_config(tensor_model_parallel_size=2),
        "max_position_embeddings": rollout_config(prompt_length=4096),
        "max_num_batched_tokens": rollout_config(max_num_batched_tokens=64, enable_chunked_prefill=False),
    }
    for message, config in bad.items():
        with pytest.raises(ValueError, match=message):
            vLLMRollout._engine_kwargs(str(tiny_model_dir), config, hf_config, None)

    # Chunked prefill by default exactly where a whole sequence does not fit one scheduler step (long contexts).
    assert kwargs["enable_chunked_prefill"] is False  # 8192 tokens a step hold the whole sequence
    long = vLLMRollout._engine_kwargs(str(tiny_model_dir), rollout_config(max_num_batched_tokens=64), hf_config, None)
    assert long["enable_chunked_prefill"] is True and long["max_num_batched_tokens"] == 64


@pytest.mark.parametrize("on_gpu", [False, True])
def test_engine_kwargs_resolve_enforce_eager_per_device_and_pass_max_num_seqs(request, tiny_model_dir, on_gpu):
    from hflow.workers.rollout.vllm_rollout import vLLMRollout

    if on_gpu:
        request.getfixturevalue("pretend_cuda")
    hf_config = AutoConfig.from_pretrained(tiny_model_dir)
    kwargs = vLLMRollout._engine_kwargs(
        str(tiny_model_dir), rollout_config(enforce_eager=None, max_num_seqs=7), hf_config, None)
    assert kwargs["enforce_eager"] is (not on_gpu)  # CUDA graphs on GPU, eager on CPU
    assert kwargs["max_num_seqs"] == 7
    assert kwargs.get("enable_sleep_mode", False) is on_gpu
    # An explicit setting wins on either device.
    for explicit in (True, False):
        config = rollout_config(enforce_eager=explicit)
        assert vLLMRollout._engine_kwargs(str(tiny_model_dir), config, hf_config, None)["enforce_eager"] is explicit


def test_on_cuda_the_workers_pin_vllms_v1_model_runner(pretend_cuda, monkeypatch, tmp_path):
    """vLLM 0.32 picks its Model Runner V2 by itself on a CUDA machine with Triton; hflow's workers start with
    VLLM_USE_V2_MODEL_RUNNER=0 (Ray's runtime_env and the local backend's process alike), under which vLLM's
    own selection gives V1, the runner the CPU engines run (and routing capture reads)."""
    import os

    import vllm.envs
    from vllm.config import VllmConfig
    from vllm.config import vllm as vllm_config_module

    from hflow.trainer.main_ppo import WORKER_ENV, start_backend

    vllm.envs.disable_envs_cache()  # an engine built earlier in this process froze the environment's values
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)  # as on a GPU machine
    for key in WORKER_ENV:  # as a fresh worker process has them (and put back after the test)
        monkeypatch.delenv(key, raising=False)
    vllm_config = VllmConfig()
    assert vllm_config.use_v2_model_runner  # vLLM's own choice on CUDA: V2
    assert WORKER_ENV["VLLM_USE_V2_MODEL_RUNNER"] == "0"  # what every Ray worker starts with
    config = default_config()
    config.trainer.backend = "local"
    start_backend(config)  # the local backend: this process's environment
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert not vllm_config.use_v2_model_runner  # vLLM now selects V1


@pytest.mark.parametrize("on_gpu", [False, True])
def test_recording_routing_runs_the_engine_eagerly(request, tiny_model_dir, on_gpu):
    """Router replay's capture is a host callback in every MoE layer's forward: no CUDA graphs or compiled
    model while recording, on either device (an explicit enforce_eager=false with it is refused)."""
    from hflow.workers.rollout.vllm_rollout import vLLMRollout

    if on_gpu:
        request.getfixturevalue("pretend_cuda")
    hf_config = AutoConfig.from_pretrained(tiny_model_dir)
    config = rollout_config(enforce_eager=None)
    OmegaConf.update(config, "record_routing", True, force_add=True)
    assert vLLMRollout._engine_kwargs(str(tiny_model_dir), config, hf_config, None)["enforce_eager"] is True
    config.enforce_eager = False
    with pytest.raises(ValueError, match="enforce_eager=false"):
        vLLMRollout._engine_kwargs(str(tiny_model_dir), config, hf_config, None)


def test_the_engine_runs_the_chosen_model_runner_and_says_so_once(rollout, caplog):
    from hflow.workers.rollout import vllm_env

    assert rollout.llm.hflow_model_runner == "V1 vllm.v1.worker.cpu_model_runner.CPUModelRunner"  # checked at build
    vllm_env._runner_logged = False
    with caplog.at_level(logging.INFO, logger=vllm_env.__name__):
        names = [vllm_env.check_model_runner(rollout.llm).hflow_model_runner for _ in range(2)]
    assert names[0] == names[1] == "V1 vllm.v1.worker.cpu_model_runner.CPUModelRunner"
    said = [r.getMessage() for r in caplog.records if "vLLM model runner" in r.getMessage()]
    assert len(said) == 1 and "VLLM_USE_V2_MODEL_RUNNER=0" in said[0], said


def test_engine_build_leaves_host_rng_alone(engine_build):
    _, before, after = engine_build
    assert torch.equal(before[0], after[0])
    assert before[1] == after[1]
    assert np.array_equal(before[2], after[2])


def test_output_contract(rollout, hf_model, tiny_tokenizer):
    push(rollout, hf_model)
    n, batch = 4, len(QUESTIONS)
    prompts = make_prompts(
        tiny_tokenizer,
        QUESTIONS,
        uid=["a", "b", "c"],
        extra_info=[{"i": 0}, {"i": 1}, {"i": 2}],
        raw_prompt_ids=chat_prompt_ids(tiny_tokenizer, QUESTIONS),
    )
    prompts.meta_info["global_steps"] = 7
    out = rollout.generate_sequences(prompts)

    rows, L, P = batch * n, RESPONSE_LENGTH, PROMPT_LENGTH
    expected = {
        "prompts": ((rows, P), torch.long),
        "responses": ((rows, L), torch.long),
        "input_ids": ((rows, P + L), torch.long),
        "attention_mask": ((rows, P + L), torch.long),
        "position_ids": ((rows, P + L), torch.long),
        "rollout_log_probs": ((rows, L), torch.float32),
    }
    assert set(out.batch.keys()) == set(expected)
    for key, (shape, dtype) in expected.items():
        assert tuple(out.batch[key].shape) == shape, key
        assert out.batch[key].dtype == dtype, key

    # Prompt-major: rows i*n .. i*n+n-1 belong to prompt i, and so do the non-tensor fields.
    assert torch.equal(out.batch["prompts"], prompts.batch["input_ids"].repeat_interleave(n, dim=0))
    assert list(out.non_tensor_batch["uid"]) == [u for u in "abc" for _ in range(n)]
    assert [e["i"] for e in out.non_tensor_batch["extra_info"]] == [i for i in range(batch) for _ in range(n)]
    assert "raw_prompt_ids" not in out.non_tensor_batch
    assert out.meta_info["global_steps"] == 7

    responses = out.batch["responses"]
    assert torch.equal(out.batch["input_ids"], torch.cat([out.batch["prompts"], responses], dim=1))
    response_mask = out.batch["attention_mask"][:, P:]
    assert torch.equal(response_mask, get_response_mask(responses, tiny_tokenizer.eos_token_id))
    assert torch.equal(out.batch["attention_mask"][:, :P], prompts.batch["attention_mask"].repeat_interleave(n, 0))
    # Right padding: everything after a response's end is the pad id, and its log-prob is 0.
    lengths = (responses != tiny_tokenizer.pad_token_id).sum(-1)
    for row, length in zip(responses, lengths):
        assert (row[length:] == tiny_tokenizer.pad_token_id).all()
    assert (out.batch["rollout_log_probs"][response_mask == 0] == 0).all()
    assert (out.batch["rollout_log_probs"][response_mask == 1] < 0).all()
    # Positions continue from the last prompt position.
    position_ids = out.batch["position_ids"]
    assert torch.equal(position_ids[:, P:], position_ids[:, P - 1 : P] + torch.arange(1, L + 1))
    # Samples of one prompt differ (T = 0.8 over a ~uniform random model).
    assert not torch.equal(responses[0], responses[1])


def test_batch_eos_ends_the_response(rollout, hf_model, tiny_tokenizer):
    """A token in meta_info['eos_token_id'] stops generation and ends the mask, inclusive."""
    push(rollout, hf_model)
    prompts = make_prompts(tiny_tokenizer, QUESTIONS[:1])
    prompts.meta_info["do_sample"] = False
    free = rollout.generate_sequences(prompts).batch["responses"][0].tolist()
    # A token first seen at position k >= 2 becomes an extra EOS.
    k = next(i for i in range(2, RESPONSE_LENGTH) if free[i] not in free[:i])
    prompts.meta_info["eos_token_id"] = [tiny_tokenizer.eos_token_id, free[k]]
    out = rollout.generate_sequences(prompts)
    response = out.batch["responses"][0]
    assert response[: k + 1].tolist() == free[: k + 1]
    assert (response[k + 1 :] == tiny_tokenizer.pad_token_id).all()
    response_mask = out.batch["attention_mask"][0, PROMPT_LENGTH:]
    assert response_mask.tolist() == [1] * (k + 1) + [0] * (RESPONSE_LENGTH - k - 1)


def test_greedy_is_deterministic_and_matches_hf_generate(rollout, hf_model, tiny_tokenizer):
    push(rollout, hf_model)
    prompts = make_prompts(tiny_tokenizer, QUESTIONS)
    prompts.meta_info["do_sample"] = False
    first = rollout.generate_sequences(prompts)
    second = rollout.generate_sequences(prompts)
    assert len(first) == len(QUESTIONS)  # greedy: one sample per prompt whatever rollout.n is
    assert torch.equal(first.batch["responses"], second.batch["responses"])

    validation = prompts.select(deepcopy=True)
    validation.meta_info = {**prompts.meta_info, "validate": True}
    validation.meta_info.pop("do_sample")
    assert torch.equal(rollout.generate_sequences(validation).batch["responses"], first.batch["responses"])

    hf_out = HFRollout(hf_model, rollout_config(name="hf")).generate_sequences(prompts)
    assert torch.equal(hf_out.batch["responses"], first.batch["responses"])
    mask = first.batch["attention_mask"][:, PROMPT_LENGTH:]
    # Greedy log-probs are those of the untempered distribution in both engines.
    diff = max_masked_diff(first.batch["rollout_log_probs"], hf_out.batch["rollout_log_probs"], mask)
    assert diff < PARITY_TOL


def test_weight_update_parity_with_long_prompts(rollout, hf_model, tiny_tokenizer):
    """Sampler log-probs after `update_weights` equal an HF forward with the new weights at T."""
    prompts = make_prompts(tiny_tokenizer, QUESTIONS[:2], context=LONG_CONTEXT)
    assert prompts.batch["attention_mask"].sum(-1).min() >= 128
    push(rollout, hf_model)
    rollout.generate_sequences(prompts)  # fills the prefix cache with KV of the old weights

    old = {name: p.detach().clone() for name, p in hf_model.named_parameters()}
    generator = torch.Generator().manual_seed(0)
    perturb_(hf_model, generator)
    push(rollout, hf_model)
    out = rollout.generate_sequences(prompts)
    mask = out.batch["attention_mask"][:, PROMPT_LENGTH:]
    new_diff = max_masked_diff(out.batch["rollout_log_probs"], hf_log_probs(hf_model, out, TEMPERATURE), mask)

    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            p.copy_(old[name])
    old_diff = max_masked_diff(out.batch["rollout_log_probs"], hf_log_probs(hf_model, out, TEMPERATURE), mask)
    print(f"max |logprob diff|: new weights {new_diff:.2e}, old weights {old_diff:.2f}")
    assert new_diff < PARITY_TOL
    assert old_diff > 0.1


def test_sharding_manager_syncs_fsdp2_weights(rollout, hf_model, tiny_tokenizer):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hflow.workers.sharding_manager import FSDPVLLMShardingManager

    generator = torch.Generator().manual_seed(1)
    perturb_(hf_model, generator)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
    for layer in hf_model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(hf_model, mesh=mesh)
    manager = FSDPVLLMShardingManager(hf_model, rollout)

    prompts = make_prompts(tiny_tokenizer, QUESTIONS[:2], context=LONG_CONTEXT)
    torch.manual_seed(99)
    training_rng = torch.random.get_rng_state()
    with manager:
        first = manager.postprocess_data(rollout.generate_sequences(manager.preprocess_data(prompts)))
    assert torch.equal(torch.random.get_rng_state(), training_rng)  # generation drew from its own stream
    assert manager.last_sync_s > 0

    mask = first.batch["attention_mask"][:, PROMPT_LENGTH:]
    diff = max_masked_diff(first.batch["rollout_log_probs"], hf_log_probs(hf_model, first, TEMPERATURE), mask)
    print(f"FSDP2 -> vLLM sync {manager.last_sync_s * 1e3:.1f} ms, max |logprob diff| {diff:.2e}")
    assert diff < PARITY_TOL

    # The generation stream continues across contexts instead of restarting.
    with manager:
        second = rollout.generate_sequences(prompts)
    assert not torch.equal(first.batch["responses"], second.batch["responses"])


def test_sharding_manager_wakes_in_two_stages_and_sleeps_at_level_2(rollout, hf_model, tiny_tokenizer, monkeypatch):
    """Weights wake before the sync, the KV cache after it; on exit the engine sleeps at level 2, which
    discards its weights (the next sync overwrites them all) instead of copying them to host memory.
    On CPU the calls are no-ops inside the rollout, so only their order and arguments are checked."""
    from hflow.workers.sharding_manager import FSDPVLLMShardingManager

    calls = []

    def spy(name):
        method = getattr(rollout, name)

        def record(*args, **kwargs):
            calls.append((name, kwargs.get("tags", kwargs.get("level"))))
            return method(*args, **kwargs)

        monkeypatch.setattr(rollout, name, record)

    for name in ("wake_up", "update_weights", "sleep"):
        spy(name)
    manager = FSDPVLLMShardingManager(hf_model, rollout)
    with manager:
        rollout.generate_sequences(make_prompts(tiny_tokenizer, QUESTIONS[:1]))
    assert calls == [("wake_up", ["weights"]), ("update_weights", None), ("wake_up", ["kv_cache"]), ("sleep", 2)]


# ---- HF rollout ---------------------------------------------------------------------------------


def test_hf_rollout_contract_on_fsdp2_module(world, hf_model, tiny_tokenizer):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    for layer in hf_model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(hf_model, mesh=mesh)
    n = 2
    config = rollout_config(name="hf", n=n, micro_batch_size=2)
    prompts = make_prompts(tiny_tokenizer, QUESTIONS, uid=["a", "b", "c"])
    torch.manual_seed(0)
    out = HFRollout(hf_model, config).generate_sequences(prompts)  # micro-batches of 2 and 1 prompts

    rows = len(QUESTIONS) * n
    assert tuple(out.batch["responses"].shape) == (rows, RESPONSE_LENGTH)
    assert tuple(out.batch["input_ids"].shape) == (rows, PROMPT_LENGTH + RESPONSE_LENGTH)
    assert out.batch["rollout_log_probs"].dtype == torch.float32
    assert list(out.non_tensor_batch["uid"]) == ["a", "a", "b", "b", "c", "c"]
    assert torch.equal(out.batch["prompts"], prompts.batch["input_ids"].repeat_interleave(n, dim=0))
    mask = out.batch["attention_mask"][:, PROMPT_LENGTH:]
    assert torch.equal(mask, get_response_mask(out.batch["responses"], tiny_tokenizer.eos_token_id))
    diff = max_masked_diff(out.batch["rollout_log_probs"], hf_log_probs(hf_model, out, TEMPERATURE), mask)
    assert diff < PARITY_TOL
    assert hf_model.training is False  # the mode it had before generating


def test_stale_cpu_all_reduce_segments_are_removed_and_live_ones_kept():
    """vLLM's CPU tensor-parallel engines reuse the same /dev/shm names in every run and never unlink them
    (a second TP run failed with errno 17): segments no process maps are removed before an engine starts,
    those a running engine maps stay."""
    import mmap
    import uuid

    from hflow.workers.rollout.vllm_rollout import _remove_stale_cpu_shared_memory

    tag = uuid.uuid4().hex[:8]
    stale, live = Path(f"/dev/shm/{tag}-tp:0-[0-1]-cpushm_0"), Path(f"/dev/shm/{tag}-tp:0-[0-1]-cpushm_1")
    for path in (stale, live):
        path.write_bytes(b"\0" * 4096)
    with open(live, "r+b") as f, mmap.mmap(f.fileno(), 4096):
        try:
            _remove_stale_cpu_shared_memory()
            assert not stale.exists()
            assert live.exists()
        finally:
            stale.unlink(missing_ok=True)
            live.unlink(missing_ok=True)


# ---- weight updates during generation (trainer.async_steps >= 2, rollout.partial_rollout) ----------


class UpdateAfterSteps:
    """A `WeightUpdates` source whose one update (to `new_model`, version 1) arrives before engine step
    `after + 1`: the test's stand-in for the weight stream, which the trainer tests run for real."""

    def __init__(self, rollout, new_model: torch.nn.Module, after: int, partial: bool):
        self.rollout, self.new_model, self.after, self.partial = rollout, new_model, after, partial
        self.steps, self._version, self.staged = 0, 0, False

    @property
    def version(self) -> int:
        return self._version

    def arrived(self) -> bool:
        self.steps += 1
        return self.steps == self.after + 1

    def take(self) -> None:
        if self.partial:
            push(self.rollout, self.new_model)
            self._version = 1
        else:
            self.staged = True  # the engine keeps the weights it started with


def check_versions_and_log_probs(output, old_model, new_model, mask: torch.Tensor) -> tuple[int, int]:
    """Each sampled token's recorded version says which weights sampled it, and the sampler's log-prob
    of it is that model's (1e-4, fp32); within a sample the versions never go back. Returns the count
    of old- and new-version tokens."""
    versions = output.batch["rollout_versions"]
    assert ((versions >= 0) == mask).all(), "every sampled token, and only those, has a version"
    for row, row_mask in zip(versions, mask):
        sampled = row[row_mask].tolist()
        assert sampled == sorted(sampled), f"versions go back within a sample: {sampled}"
    sampler = output.batch["rollout_log_probs"]
    old, new = mask & (versions == 0), mask & (versions == 1)
    if old.any():
        assert max_masked_diff(hf_log_probs(old_model, output, TEMPERATURE), sampler, old) < PARITY_TOL
    if new.any():
        assert max_masked_diff(hf_log_probs(new_model, output, TEMPERATURE), sampler, new) < PARITY_TOL
    return int(old.sum()), int(new.sum())


def generate_through_an_update(rollout, hf_model, tokenizer, model_dir, partial: bool):
    """Long prompts, `hf_model`'s weights, and an update to a perturbed copy arriving before step 9."""
    new_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    perturb_(new_model, torch.Generator().manual_seed(7), scale=0.2)
    push(rollout, hf_model)
    updates = UpdateAfterSteps(rollout, new_model, after=8, partial=partial)
    torch.manual_seed(0)
    output = rollout.generate_sequences(make_prompts(tokenizer, QUESTIONS, context=LONG_CONTEXT), weight_updates=updates)
    return output, updates, new_model, output.batch["attention_mask"][:, -RESPONSE_LENGTH:].bool()


def test_partial_rollout_continues_interrupted_requests_with_the_new_weights(rollout, hf_model, tiny_tokenizer,
                                                                            tiny_model_dir):
    """partial_rollout: an update that arrives mid-generation stops every request in flight; each goes on
    from the tokens it had, sampled (and scored) by the new weights from then on, and its tokens record
    the version that sampled them. The long prompts (> one 128-token KV block) make a prefix cache kept
    across the update show up in the new tokens' log-probs."""
    output, _, new_model, mask = generate_through_an_update(rollout, hf_model, tiny_tokenizer, tiny_model_dir, True)
    assert output.batch["responses"].shape == (len(QUESTIONS) * 4, RESPONSE_LENGTH)
    old, new = check_versions_and_log_probs(output, hf_model, new_model, mask)
    assert old > 0 and new > 0, (old, new)
    interrupted = output.meta_info["metrics"]["rollout/interrupted_requests"]
    assert interrupted > 0
    # the requests in flight at the update kept their first tokens and went on to the full length or EOS
    switched = [(row[m] == 0).any() and (row[m] == 1).any() for row, m in zip(output.batch["rollout_versions"], mask)]
    assert sum(switched) == interrupted, (switched, interrupted)


def test_update_without_partial_rollout_is_staged_and_requests_finish_with_their_weights(rollout, hf_model,
                                                                                      tiny_tokenizer, tiny_model_dir):
    output, updates, new_model, mask = generate_through_an_update(rollout, hf_model, tiny_tokenizer, tiny_model_dir,
                                                                  False)
    assert updates.staged and output.meta_info["metrics"]["rollout/interrupted_requests"] == 0
    old, new = check_versions_and_log_probs(output, hf_model, new_model, mask)
    assert new == 0 and old == int(mask.sum())


# ---- continuous admission: this engine serves the rows a router hands it ---------------------------


def serve_batch(rollout, router, engine: int, prompts: DataProto) -> None:
    from hflow.workers.rollout.router import RouterClient

    stop = {"eos_token_id": prompts.meta_info["eos_token_id"], "pad_token_id": prompts.meta_info["pad_token_id"]}
    rollout.serve(RouterClient(router), engine, stop)


def submit(router, prompts: DataProto, n: int) -> None:
    from hflow.workers.rollout.base import prompt_token_ids

    router.submit(0, [{"ids": ids, "tools_kwargs": {}} for ids in prompt_token_ids(prompts) for _ in range(n)],
                  {}, min_version=0)


def test_routed_rows_come_back_in_order_and_each_row_samples_the_same_on_any_engine(rollout, hf_model, tiny_tokenizer):
    """The real engine serves a batch alone (the reference), then again as engine 0 of two while the test,
    as engine 1, holds 5 of the 12 samples and answers them from the reference. Each sample's request has
    its own seed, so the rows the engine ran among fewer others are the reference's, token for token; the
    assembled output is the reference's in the original row order."""
    from hflow.trainer.ppo.routed_rollout import assemble_routed
    from hflow.workers.rollout.router import RowRouter

    push(rollout, hf_model)
    n, config = 4, rollout.config
    prompts = make_prompts(tiny_tokenizer, QUESTIONS)
    alone = RowRouter(engines=1)
    submit(alone, prompts, n)
    serve_batch(rollout, alone, 0, prompts)
    reference = alone.collect(0)
    assert reference["rows_per_engine"] == [12]

    shared = RowRouter(engines=2)
    submit(shared, prompts, n)
    held = shared.exchange(1, [], running=0, room=5, version=0, any_version=True)
    assert len(held) == 5
    serve_batch(rollout, shared, 0, prompts)  # returns with engine 1's rows still out: nothing left for it
    assert not shared.complete(0)
    shared.exchange(1, [(b, r, reference["results"][r]) for b, r, *_ in held], 0, 0, 0, any_version=True)
    routed = shared.collect(0)
    assert routed["rows_per_engine"] == [7, 5]
    engine0 = [r for r in range(12) if routed["engine_of"][r] == 0]
    for r in engine0:
        assert routed["results"][r]["tokens"] == reference["results"][r]["tokens"], r
        assert routed["results"][r]["log_probs"] == pytest.approx(reference["results"][r]["log_probs"], abs=PARITY_TOL)
    distinct = {tuple(reference["results"][r]["tokens"]) for r in range(12)}
    assert len(distinct) > 6  # samples of one prompt differ: the seeds are per row, not per prompt

    output = assemble_routed(prompts, {}, n, routed, config)
    expected = assemble_routed(prompts, {}, n, reference, config)
    for key in ("prompts", "responses", "attention_mask", "position_ids", "rollout_log_probs"):
        assert torch.allclose(output.batch[key].float(), expected.batch[key].float(), atol=PARITY_TOL), key
    assert torch.equal(output.batch["prompts"][::n], prompts.batch["input_ids"])  # prompt-major, in order
    metrics = output.meta_info["metrics"]
    assert metrics["rollout/rows/engine0"] == [7.0] and metrics["rollout/rows/engine1"] == [5.0]


def test_routed_later_batch_waits_for_its_weights_loaded_once_nothing_runs(rollout, hf_model, tiny_tokenizer):
    """One serve call runs two batches; the second asks for policy 1, whose update arrives (staged, no partial
    rollouts) while the first batch runs. The engine loads it once nothing runs on it, between two steps,
    and only then takes the second batch: the first batch is all version 0, the second all version 1, each
    with its model's log-probs."""
    import copy

    from hflow.trainer.ppo.routed_rollout import assemble_routed
    from hflow.workers.rollout.base import prompt_token_ids
    from hflow.workers.rollout.router import RouterClient, RowRouter

    new_model = copy.deepcopy(hf_model)
    perturb_(new_model, torch.Generator().manual_seed(7), scale=0.05)
    push(rollout, hf_model)
    prompts, n = make_prompts(tiny_tokenizer, QUESTIONS), 2
    samples = [{"ids": ids, "tools_kwargs": {}} for ids in prompt_token_ids(prompts) for _ in range(n)]
    router = RowRouter(engines=1)
    router.submit(0, samples, {}, min_version=0)
    router.submit(1, samples, {}, min_version=1)
    updates = UpdateAfterSteps(rollout, new_model, after=3, partial=False)
    loaded_while_busy = []

    def between_steps(busy: bool) -> None:
        if updates.staged and not busy:
            push(rollout, new_model)
            updates.staged, updates._version = False, 1
            loaded_while_busy.append(busy)

    stop = {"eos_token_id": prompts.meta_info["eos_token_id"], "pad_token_id": prompts.meta_info["pad_token_id"]}
    rollout.serve(RouterClient(router), 0, stop, weight_updates=updates, between_steps=between_steps)
    assert loaded_while_busy == [False]
    for batch, version in ((0, 0), (1, 1)):
        output = assemble_routed(prompts, {}, n, router.collect(batch), rollout.config)
        mask = output.batch["rollout_versions"] >= 0
        assert set(output.batch["rollout_versions"][mask].tolist()) == {version}, batch
        old, new = check_versions_and_log_probs(output, hf_model, new_model, mask)
        assert (old, new) == ((int(mask.sum()), 0) if version == 0 else (0, int(mask.sum())))


def test_preflight_refuses_router_replay_with_a_compiled_engine(tmp_path):
    import json

    from hflow.config_schema import ConfigError
    from hflow.workers.moe import check_moe_settings

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 4,
                                                      "num_experts_per_tok": 2}))
    config = default_config()
    config.actor_rollout_ref.model.path = str(tmp_path)
    config.actor_rollout_ref.actor.router_replay = True
    check_moe_settings(config)  # enforce_eager null: eager while recording
    config.actor_rollout_ref.rollout.enforce_eager = False
    with pytest.raises(ConfigError, match="rollout.enforce_eager"):
        check_moe_settings(config)
