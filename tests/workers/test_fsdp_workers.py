"""The hybrid-engine workers on real Ray actors: 2 CPU ranks, FSDP2 on gloo, the real vLLM engine.

One colocated group (actor+rollout, reference, critic in one process per rank) is shared by the tests
of this module, in the order a training step uses it.
"""

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from safetensors.torch import load_file

pytest.importorskip("ray", reason="needs Ray (the GPU check's machine has none)")

from hflow.protocol import DataProto
from hflow.single_controller.base import Dispatch, register
from hflow.single_controller.ray import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    WorkerGroupError,
    create_colocated_worker_cls,
)
from hflow.trainer.main_ppo import CONFIG_DIR
from hflow.tasks.tiny_models import build_causal_lm
from hflow.utils.torch_functional import compute_position_id_with_mask
from hflow.workers.fsdp_workers import ActorRolloutRefWorker, CriticWorker

WORLD = 2
PROMPT_LEN, RESPONSE_LEN, N = 160, 16, 2  # prompts >= 128 tokens: a stale prefix cache would show


def make_config(model_path, *overrides):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        config = compose(config_name="ppo_trainer", overrides=[
            f"actor_rollout_ref.model.path={model_path}",
            f"data.max_prompt_length={PROMPT_LEN}",
            f"data.max_response_length={RESPONSE_LEN}",
            f"actor_rollout_ref.rollout.n={N}",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.actor.optim.lr=1e-3",
            "actor_rollout_ref.actor.shuffle=false",
            "actor_rollout_ref.rollout.kv_cache_memory_bytes=67108864",
            "actor_rollout_ref.rollout.max_num_batched_tokens=2048",
            "critic.optim.lr=1e-3",
            *overrides,
        ])
    OmegaConf.resolve(config)
    return config


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(build_causal_lm(tmp_path_factory.mktemp("model") / "qwen2-tiny", preset="tiny"))


_READS: list[str] = []  # in each worker process: the classes whose weights from_pretrained read from disk


def _count_weight_reads() -> None:
    """Record every `from_pretrained` of this process (once per process: the roles share it)."""
    from transformers import PreTrainedModel

    if getattr(PreTrainedModel.from_pretrained, "_counted", False):
        return
    original = PreTrainedModel.from_pretrained.__func__

    def from_pretrained(cls, *args, **kwargs):
        _READS.append(cls.__name__)
        return original(cls, *args, **kwargs)

    from_pretrained._counted = True
    PreTrainedModel.from_pretrained = classmethod(from_pretrained)


class CountingActorRolloutRefWorker(ActorRolloutRefWorker):
    def __init__(self, *args, **kwargs):
        _count_weight_reads()
        super().__init__(*args, **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weight_reads(self):
        return list(_READS)


class CountingCriticWorker(CriticWorker):
    def __init__(self, *args, **kwargs):
        _count_weight_reads()
        super().__init__(*args, **kwargs)


@pytest.fixture(scope="module")
def groups(ray_session, model_path):
    config = make_config(model_path)
    roles = {
        "actor_rollout": RayClassWithInitArgs(CountingActorRolloutRefWorker, config=config.actor_rollout_ref,
                                              role="actor_rollout"),
        "ref": RayClassWithInitArgs(CountingActorRolloutRefWorker, config=config.actor_rollout_ref, role="ref"),
        "critic": RayClassWithInitArgs(CountingCriticWorker, config=config.critic),
    }
    group = RayWorkerGroup(RayResourcePool([WORLD], use_gpu=False), create_colocated_worker_cls(roles))
    views = group.spawn(roles.keys())
    for name in ("critic", "ref", "actor_rollout"):
        views[name].init_model()
    yield views
    group.shutdown()


def make_prompts(n_prompts=4, seed=0):
    """Left-padded prompts of varying length (>= 128 real tokens) from the tiny vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.zeros(n_prompts, PROMPT_LEN, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i in range(n_prompts):
        length = PROMPT_LEN - 8 * i
        input_ids[i, -length:] = torch.randint(10, 400, (length,), generator=gen)
        attention_mask[i, -length:] = 1
    return DataProto.from_dict(
        {"input_ids": input_ids, "attention_mask": attention_mask,
         "position_ids": compute_position_id_with_mask(attention_mask)},
        non_tensors={"tag": np.array([f"p{i}" for i in range(n_prompts)], dtype=object)},
    )


def rollout_step(groups, seed=0):
    out = groups["actor_rollout"].generate_sequences(make_prompts(seed=seed))
    out.meta_info.pop("metrics", None)
    response_length = out.batch["responses"].shape[1]
    out.batch["response_mask"] = out.batch["attention_mask"][:, -response_length:]
    return out.union(groups["actor_rollout"].compute_log_prob(out))


def with_advantages(batch, seed=0):
    gen = torch.Generator().manual_seed(seed)
    batch.batch["advantages"] = torch.randn(batch.batch["responses"].shape, generator=gen) * batch.batch["response_mask"]
    return batch


def max_logprob_gap(batch):
    mask = batch.batch["response_mask"].bool()
    return (batch.batch["rollout_log_probs"] - batch.batch["old_log_probs"]).abs()[mask].max().item()


@pytest.mark.parametrize("overrides,named", [
    (["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"], "ppo_micro_batch_size_per_gpu"),
    (["actor_rollout_ref.rollout.tensor_model_parallel_size=3"], "tensor_model_parallel_size"),
    (["actor_rollout_ref.model.path=/nonexistent"], "actor_rollout_ref.model.path"),
])
# First in the file: its group needs slots that the module's `groups` fixture holds until the end. One rank:
# each check runs in every rank's init_model, and every actor process costs ~9 s of CPU importing hflow's workers.
def test_impossible_settings_fail_at_init_model_naming_the_key(ray_session, model_path, overrides, named):
    config = make_config(model_path, *overrides)
    group = RayWorkerGroup(RayResourcePool([1], use_gpu=False), RayClassWithInitArgs(
        ActorRolloutRefWorker, config=config.actor_rollout_ref, role="actor_rollout"))
    try:
        with pytest.raises(WorkerGroupError, match=named):
            group.init_model()
    finally:
        group.shutdown()


def test_only_rank_zero_reads_the_weights_from_disk(groups):
    """Actor, reference and critic each read the checkpoint once, on rank 0; rank 1 builds its modules on
    the meta device and receives its shards from rank 0 (no host memory for a full model per rank)."""
    rank0, rank1 = groups["actor_rollout"].weight_reads()
    assert len(rank0) == 3 and "Qwen2ForCausalLM" in rank0, rank0  # actor, reference, critic
    assert rank1 == [], rank1


def test_generation_contract(groups):
    out = groups["actor_rollout"].generate_sequences(make_prompts())
    assert len(out) == 4 * N
    assert out.batch["responses"].shape == (4 * N, RESPONSE_LEN)
    assert out.batch["input_ids"].shape == (4 * N, PROMPT_LEN + RESPONSE_LEN)
    assert out.non_tensor_batch["tag"].tolist() == [f"p{i}" for i in range(4) for _ in range(N)]
    assert "timing_s/weight_sync" in out.meta_info["metrics"]


def test_sampler_and_trainer_log_probs_agree_before_and_after_an_update(groups):
    batch = rollout_step(groups)
    assert max_logprob_gap(batch) < 1e-4
    groups["actor_rollout"].update_actor(with_advantages(batch))
    after = rollout_step(groups, seed=1)
    assert max_logprob_gap(after) < 1e-4  # the engine generated with the updated weights
    # and the update really changed the policy: the same sequences now score differently
    rescored = groups["actor_rollout"].compute_log_prob(batch)
    mask = batch.batch["response_mask"].bool()
    assert (rescored.batch["old_log_probs"] - batch.batch["old_log_probs"]).abs()[mask].max() > 1e-3


def test_first_mini_batch_has_zero_kl_and_clip_fraction(groups):
    batch = with_advantages(rollout_step(groups, seed=2))  # ppo_mini_batch_size = the whole batch
    metrics = groups["actor_rollout"].update_actor(batch).meta_info["metrics"]
    assert max(abs(v) for v in metrics["actor/ppo_kl"]) < 1e-6
    assert max(metrics["actor/pg_clipfrac"]) == 0
    assert all(np.isfinite(metrics["actor/grad_norm"]))


@torch.no_grad()
def hf_log_probs(model_dir, batch):
    """Log-probs of the responses under the weights in `model_dir`, computed here with plain transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    responses = batch.batch["responses"]
    logits = model(input_ids=batch.batch["input_ids"], attention_mask=batch.batch["attention_mask"],
                   position_ids=batch.batch["position_ids"]).logits[:, -responses.shape[1] - 1:-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)


def test_reference_policy_stays_at_the_initial_weights(groups, model_path):
    batch = rollout_step(groups, seed=3)
    ref = groups["ref"].compute_ref_log_prob(batch).batch["ref_log_prob"]
    mask = batch.batch["response_mask"].bool()
    # the reference scores as the model folder's weights do ...
    assert (ref - hf_log_probs(model_path, batch)).abs()[mask].max() < 1e-4
    # ... while the actor, updated by earlier tests, no longer does
    assert (ref - batch.batch["old_log_probs"]).abs()[mask].max() > 1e-3


def test_critic_value_loss_falls_on_a_fixed_batch(groups):
    batch = rollout_step(groups, seed=4)
    batch = batch.union(groups["critic"].compute_values(batch))
    batch.batch["returns"] = torch.linspace(-1, 1, len(batch))[:, None] * batch.batch["response_mask"]
    losses = []
    for _ in range(6):
        metrics = groups["critic"].update_critic(batch).meta_info["metrics"]
        losses.append(float(np.mean(metrics["critic/vf_loss"])))
    assert losses[-1] < 0.5 * losses[0], losses


def _weights(path):
    return load_file(str(path / "model.safetensors"))


def test_checkpoint_round_trip_and_resumed_update_equals_uninterrupted(groups, tmp_path):
    actor = groups["actor_rollout"]
    batch = with_advantages(rollout_step(groups, seed=5), seed=5)
    actor.save_checkpoint(str(tmp_path / "ckpt"), global_step=7)
    actor.save_hf_model(str(tmp_path / "before"))
    actor.update_actor(batch)
    actor.save_hf_model(str(tmp_path / "uninterrupted"))
    actor.load_checkpoint(str(tmp_path / "ckpt"))
    actor.save_hf_model(str(tmp_path / "loaded"))
    for name, tensor in _weights(tmp_path / "before").items():
        assert torch.equal(tensor, _weights(tmp_path / "loaded")[name]), name
    actor.update_actor(batch)  # needs the restored optimizer state to match
    actor.save_hf_model(str(tmp_path / "resumed"))
    uninterrupted, resumed = _weights(tmp_path / "uninterrupted"), _weights(tmp_path / "resumed")
    for name, tensor in uninterrupted.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=0, atol=1e-6, msg=name)
    assert any(not torch.equal(uninterrupted[k], _weights(tmp_path / "before")[k]) for k in uninterrupted)


def test_hf_export_generates_the_same_greedy_tokens(groups, tmp_path):
    from transformers import AutoModelForCausalLM

    actor = groups["actor_rollout"]
    actor.save_hf_model(str(tmp_path / "export"))
    prompts = make_prompts()
    prompts.meta_info.update(do_sample=False, validate=True)
    out = actor.generate_sequences(prompts)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"), dtype=torch.float32)
    for i in range(len(prompts)):
        mask = prompts.batch["attention_mask"][i].bool()
        ids = prompts.batch["input_ids"][i][mask][None]
        expected = model.generate(ids, max_new_tokens=RESPONSE_LEN, do_sample=False,
                                  eos_token_id=model.generation_config.eos_token_id,
                                  pad_token_id=model.generation_config.pad_token_id)[0, ids.shape[1]:]
        got = out.batch["responses"][i][: len(expected)]
        assert got.tolist() == expected.tolist(), i
