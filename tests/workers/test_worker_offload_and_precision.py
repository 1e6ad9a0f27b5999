"""Worker memory and precision switches, on workers built in this process (a torch.distributed group of one).

On CPU the device *is* the host, so parameter offloading cannot be seen in where tensors live; these
tests watch the offload helpers being called (spies that call through) around the worker's methods.
"""

from __future__ import annotations


import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from hflow.protocol import DataProto
from hflow.trainer.main_ppo import CONFIG_DIR
from hflow.workers import fsdp
from hflow.tasks.tiny_models import build_causal_lm
from hflow.utils.torch_functional import compute_position_id_with_mask
from hflow.workers import fsdp_workers
from hflow.workers.config import ConfigError, normalize_actor_rollout_ref
from hflow.workers.critic.config import normalize_critic
from hflow.workers.fsdp_workers import ActorRolloutRefWorker, CriticWorker

PROMPT_LEN, RESPONSE_LEN = 8, 4


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return str(build_causal_lm(tmp_path_factory.mktemp("model") / "qwen2-tiny", preset="tiny"))


def make_config(model_path: str, *overrides: str):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        config = compose(config_name="ppo_trainer", overrides=[
            f"actor_rollout_ref.model.path={model_path}",
            f"data.max_prompt_length={PROMPT_LEN}",
            f"data.max_response_length={RESPONSE_LEN}",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
            *overrides,
        ])
    OmegaConf.resolve(config)
    return config


def make_batch(n: int = 2, seed: int = 0) -> DataProto:
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(10, 400, (n, PROMPT_LEN + RESPONSE_LEN), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :3] = 0  # left padding
    return DataProto.from_dict({
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": compute_position_id_with_mask(attention_mask),
        "responses": input_ids[:, PROMPT_LEN:],
    })


@pytest.fixture()
def offload_calls(monkeypatch) -> list[tuple[str, torch.nn.Module]]:
    """(event, module) for every parameter onload / offload the workers ask of `hflow.workers.fsdp`."""
    calls = []
    for event, name in (("onload", "load_fsdp_model_to_device"), ("offload", "offload_fsdp_model_to_cpu")):
        original = getattr(fsdp, name)

        def record(module, *args, _event=event, _original=original, **kwargs):
            calls.append((_event, module))
            return _original(module, *args, **kwargs)

        monkeypatch.setattr(fsdp, name, record)
    return calls


# ------------------------------------------------------------------ ref.fsdp_config.param_offload


def test_ref_param_offload_brackets_compute_ref_log_prob(model_path, world_of_one, offload_calls, fsdp_on_one_rank):
    config = make_config(model_path, "actor_rollout_ref.ref.fsdp_config.param_offload=true")
    worker = ActorRolloutRefWorker(config.actor_rollout_ref, role="ref")
    worker.init_model()
    assert offload_calls == [("offload", worker.ref_module)]  # lives on the host from the start

    offload_calls.clear()
    out = worker.compute_ref_log_prob(make_batch())
    assert offload_calls == [("onload", worker.ref_module), ("offload", worker.ref_module)]
    assert all(p.device.type == "cpu" for p in worker.ref_module.parameters())
    assert all(isinstance(p, DTensor) for p in worker.ref_module.parameters())  # root resharded after the forward
    assert out.batch["ref_log_prob"].shape == (2, RESPONSE_LEN)


def test_ref_without_param_offload_stays_on_the_device(model_path, world_of_one, offload_calls):
    worker = ActorRolloutRefWorker(make_config(model_path).actor_rollout_ref, role="ref")
    worker.init_model()
    worker.compute_ref_log_prob(make_batch())
    assert offload_calls == []


# ------------------------------------------------------------------ save_hf_model with parameter offload


def test_save_hf_model_onloads_offloaded_shards_for_the_export(model_path, world_of_one, offload_calls, monkeypatch,
                                                              tmp_path):
    config = make_config(model_path, "actor_rollout_ref.actor.fsdp_config.param_offload=true")
    worker = ActorRolloutRefWorker(config.actor_rollout_ref, role="actor")
    worker.init_model()
    export = fsdp_workers.save_hf_model

    def record_export(model, *args, **kwargs):
        offload_calls.append(("export", model))
        return export(model, *args, **kwargs)

    monkeypatch.setattr(fsdp_workers, "save_hf_model", record_export)
    offload_calls.clear()
    worker.save_hf_model(str(tmp_path / "hf"))
    actor = worker.actor_module
    assert offload_calls == [("onload", actor), ("export", actor), ("offload", actor)]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    original = AutoModelForCausalLM.from_pretrained(model_path)
    for (name, got), (_, want) in zip(reloaded.state_dict().items(), original.state_dict().items()):
        torch.testing.assert_close(got, want, atol=0, rtol=0, msg=name)


# ------------------------------------------------------------------ fsdp_config.offload_policy


@pytest.mark.parametrize("section,clashing", [
    ("actor_rollout_ref.actor.fsdp_config", "param_offload"),
    ("actor_rollout_ref.actor.fsdp_config", "optimizer_offload"),
    ("actor_rollout_ref.ref.fsdp_config", "param_offload"),
    ("critic.model.fsdp_config", "optimizer_offload"),
])
def test_offload_policy_with_per_phase_offload_is_rejected_naming_both_keys(model_path, section, clashing):
    config = make_config(model_path, f"{section}.offload_policy=true", f"{section}.{clashing}=true")
    with pytest.raises(ConfigError) as error:
        if section.startswith("critic"):
            normalize_critic(config.critic, world_size=1)
        else:
            normalize_actor_rollout_ref(config.actor_rollout_ref, "actor_rollout_ref", world_size=1)
    assert f"{section}.offload_policy" in str(error.value) and f"{section}.{clashing}" in str(error.value)


def test_offload_policy_and_gather_once_reach_the_sharding(model_path, world_of_one, monkeypatch):
    """`offload_policy` reaches both `apply_fsdp2` and `weights_from_rank0` (which must agree on where the
    shards live); `gather_once_per_pass` arrives as given, null (decided by size and device) by default."""
    requested, loading = [], []
    apply_fsdp2, weights_from_rank0 = fsdp.apply_fsdp2, fsdp.weights_from_rank0

    def record(*args, cpu_offload=False, gather_once_per_pass="unset", **kwargs):
        requested.append((cpu_offload, gather_once_per_pass))
        # skipped on CPU, used on GPU
        return apply_fsdp2(*args, cpu_offload=cpu_offload, gather_once_per_pass=gather_once_per_pass, **kwargs)

    def record_loading(model, cpu_offload=False):
        loading.append(cpu_offload)
        return weights_from_rank0(model, cpu_offload=cpu_offload)

    monkeypatch.setattr(fsdp, "apply_fsdp2", record)
    monkeypatch.setattr(fsdp, "weights_from_rank0", record_loading)
    config = make_config(model_path, "actor_rollout_ref.ref.fsdp_config.offload_policy=true",
                         "critic.model.fsdp_config.offload_policy=true",
                         "actor_rollout_ref.actor.fsdp_config.gather_once_per_pass=false")
    ActorRolloutRefWorker(config.actor_rollout_ref, role="actor").init_model()
    ActorRolloutRefWorker(config.actor_rollout_ref, role="ref").init_model()
    CriticWorker(config.critic).init_model()
    assert requested == [(False, False), (True, None), (True, None)]  # actor (defaults off), ref, critic
    assert loading == [False, True, True]


# ------------------------------------------------------------------ the rollout engine's memory and dtype


def test_gpu_memory_utilization_null_is_half_colocated_and_most_on_devices_of_its_own(model_path):
    def utilization(*overrides: str, own_device: bool) -> float:
        config = make_config(model_path, *overrides)
        role = "rollout" if own_device else "actor_rollout_ref"
        normalized = normalize_actor_rollout_ref(config.actor_rollout_ref, role, 1, own_device=own_device)
        return normalized.rollout.gpu_memory_utilization

    assert utilization(own_device=False) == 0.5
    assert utilization(own_device=True) == 0.9
    given = "actor_rollout_ref.rollout.gpu_memory_utilization=0.7"
    assert utilization(given, own_device=False) == utilization(given, own_device=True) == 0.7
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.rollout\.gpu_memory_utilization must be in \(0, 1\]"):
        utilization("actor_rollout_ref.rollout.gpu_memory_utilization=1.5", own_device=True)


def test_standalone_rollout_worker_sizes_its_engine_for_a_device_of_its_own(model_path, monkeypatch):
    """The split placement's `RolloutWorker` normalises its config as the owner of its devices."""
    from hflow.workers import rollout_worker

    seen = {}

    class Stop(Exception):
        pass

    def spy(config, role, world_size, own_device=False):
        seen["config"] = normalize_actor_rollout_ref(config, role, world_size, own_device=own_device)
        raise Stop  # the engine itself is not needed

    monkeypatch.setattr(rollout_worker, "normalize_actor_rollout_ref", spy)
    with pytest.raises(Stop):
        rollout_worker.RolloutWorker(make_config(model_path).actor_rollout_ref).init_model()
    assert seen["config"].rollout.gpu_memory_utilization == 0.9


@pytest.mark.parametrize(("capability", "dtype"), [((9, 0), "bfloat16"), ((7, 0), "float16")])
def test_rollout_dtype_null_follows_the_gpus_bf16_support(model_path, monkeypatch, capability, dtype):
    from hflow.utils import device

    monkeypatch.setattr(device, "device_name", lambda: "cuda")
    monkeypatch.setattr(device, "cuda_capability", lambda: capability)
    config = make_config(model_path)
    assert normalize_actor_rollout_ref(config.actor_rollout_ref, "actor_rollout_ref", 1).rollout.dtype == dtype


# ------------------------------------------------------------------ critic values in fp32


def test_critic_values_are_fp32_under_bf16_mixed_precision(model_path, world_of_one):
    config = make_config(model_path, "critic.ppo_micro_batch_size_per_gpu=2",
                         "critic.model.fsdp_config.mixed_precision={param_dtype:bfloat16,reduce_dtype:float32}",
                         "critic.model.value_head_init=normal")  # a zero head's values are 0, exact in bf16 too
    worker = CriticWorker(config.critic)
    worker.init_model()
    batch = make_batch(4)
    values = worker.compute_values(batch).batch["values"]
    # one rank: a plain module whose fp32 masters stay fp32 (bf16 compute copies only inside each pass)
    assert all(not isinstance(p, DTensor) and p.dtype == torch.float32 for p in worker.critic_module.parameters())
    assert values.dtype == torch.float32
    # A head computed in bf16 rounds every value to bf16's 8-bit mantissa; the fp32 head does not.
    assert not torch.equal(values, values.bfloat16().float())

    # The loss sees the same fp32 values (the update's forward, with gradients).
    worker.critic.critic_module.train()
    with fsdp.update_pass(worker.critic_module):
        vpreds = worker.critic._forward_micro_batch(batch.batch.to(values.device))
        # the body computes with bf16 copies, the value head with its fp32 weights
        assert worker.critic_module.score.weight.dtype == torch.float32
        assert worker.critic_module.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert vpreds.dtype == torch.float32 and vpreds.requires_grad
    assert not torch.equal(vpreds.detach(), vpreds.detach().bfloat16().float())
    torch.testing.assert_close(vpreds.detach(), values, atol=0, rtol=0)
    fsdp.reshard_fsdp_model(worker.critic_module)
