"""LoRA (PEFT) on the FSDP2 actor: only the adapters train, the reference is the base model with the
adapters off, and everything that leaves the actor (vLLM sync, weight stream, HF export) gets the merged
weights under the base model's names. Workers are built in this process, on a torch.distributed group of one.
"""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from hflow.config_schema import ConfigError
from hflow.protocol import DataProto
from hflow.trainer.main_ppo import CONFIG_DIR
from hflow.workers import fsdp
from hflow.tasks.tiny_models import build_causal_lm
from hflow.utils.torch_functional import compute_position_id_with_mask
from hflow.workers.actor import DataParallelPPOActor
from hflow.workers.fsdp_workers import ActorRolloutRefWorker

PROMPT_LEN, RESPONSE_LEN, RANK, ALPHA = 8, 4, 8, 16


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return str(build_causal_lm(tmp_path_factory.mktemp("model") / "qwen2-tiny", preset="tiny"))


def arr_config(model_path: str, *overrides: str):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        config = compose(config_name="ppo_trainer", overrides=[
            f"actor_rollout_ref.model.path={model_path}",
            f"actor_rollout_ref.model.lora_rank={RANK}",
            f"actor_rollout_ref.model.lora_alpha={ALPHA}",
            f"data.max_prompt_length={PROMPT_LEN}",
            f"data.max_response_length={RESPONSE_LEN}",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.actor.optim.lr=5e-2",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
            *overrides,
        ])
    OmegaConf.resolve(config)
    return config.actor_rollout_ref


def ppo_batch(n: int = 4, seed: int = 0) -> DataProto:
    gen = torch.Generator().manual_seed(seed)
    prompt_mask = (torch.arange(PROMPT_LEN) >= PROMPT_LEN - torch.randint(2, PROMPT_LEN + 1, (n, 1), generator=gen)).long()
    response_mask = (torch.arange(RESPONSE_LEN) < torch.randint(1, RESPONSE_LEN + 1, (n, 1), generator=gen)).long()
    prompts = torch.randint(10, 400, (n, PROMPT_LEN), generator=gen) * prompt_mask
    responses = torch.randint(10, 400, (n, RESPONSE_LEN), generator=gen) * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], dim=-1)
    return DataProto.from_dict({
        "input_ids": torch.cat([prompts, responses], dim=-1),
        "responses": responses,
        "attention_mask": attention_mask,
        "position_ids": compute_position_id_with_mask(attention_mask),
        "response_mask": response_mask,
        "advantages": torch.randn(n, RESPONSE_LEN, generator=gen) * response_mask,
    }, meta_info={"temperature": 1.0})


def train_one_step(worker: ActorRolloutRefWorker, seed: int = 0) -> DataProto:
    batch = ppo_batch(seed=seed)
    batch.batch["old_log_probs"] = worker.compute_log_prob(batch).batch["old_log_probs"]
    worker.update_actor(batch)
    return batch


def merged(model) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in fsdp.iter_full_params(model)}


@pytest.fixture()
def worker(model_path, world_of_one) -> ActorRolloutRefWorker:
    worker = ActorRolloutRefWorker(arr_config(model_path), role="actor")
    worker.init_model()
    return worker


def test_optimizer_holds_only_the_adapters(worker):
    named = dict(worker.actor_module.named_parameters())
    lora = {name for name in named if ".lora_A." in name or ".lora_B." in name}
    assert lora
    in_optimizer = {id(p) for group in worker.actor_optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(named[name]) for name in lora}
    assert {name for name, p in named.items() if p.requires_grad} == lora
    assert not hasattr(worker, "ref_module")  # the reference is the actor's base model, not a second copy


def test_frozen_weights_get_no_gradient_and_no_optimizer_state(worker):
    """After an update only the adapters hold gradients and AdamW moments: a full-size gradient or optimizer
    state of a frozen weight is what would make LoRA's memory no smaller than full fine-tuning's."""
    train_one_step(worker)
    named = dict(worker.actor_module.named_parameters())
    lora = {n for n in named if ".lora_A." in n or ".lora_B." in n}
    with_state = {id(p) for p, state in worker.actor_optimizer.state.items() if state}
    assert with_state == {id(named[n]) for n in lora}
    # update_actor zeroes gradients before each mini-batch; the last one's stay: adapters only
    assert {n for n, p in named.items() if p.grad is not None} <= lora


def test_actor_lora_linears_add_in_place(worker):
    from peft.tuners.lora import layer as lora_layer

    from hflow.workers.fsdp.lora import fast_linear_class

    linears = [m for m in worker.actor_module.modules() if isinstance(m, lora_layer.Linear)]
    assert linears and all(type(m) is fast_linear_class(lora_layer.Linear) for m in linears)


def test_in_place_lora_forward_allocates_no_output_sized_temporaries(model_path):
    """The cause of LoRA's higher peak RSS (bench/results/lora_memory.md): PEFT's forward makes three extra
    tensors of the output's size per wrapped linear. hflow's makes none, with PEFT's outputs and gradients."""
    from peft.tuners.lora import layer as lora_layer
    from torch.utils._python_dispatch import TorchDispatchMode

    from hflow.workers.fsdp.lora import add_lora

    torch.manual_seed(0)
    model = add_lora(fsdp.load_causal_lm(model_path), RANK, ALPHA)
    layer = next(m for m in model.modules() if isinstance(m, lora_layer.Linear))
    with torch.no_grad():
        for p in (*layer.lora_A.parameters(), *layer.lora_B.parameters()):
            p.normal_(std=0.1)
    x = torch.randn(3, 5, layer.in_features, requires_grad=True)
    out_numel = 3 * 5 * layer.out_features

    class OutputSized(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            outputs = result if isinstance(result, (tuple, list)) else (result,)
            # new storage of the output's size (views and in-place results share their input's)
            fresh = [t for t in outputs if isinstance(t, torch.Tensor) and t.numel() == out_numel
                     and not func._schema.is_mutable and not func.is_view]
            OutputSized.count += len(fresh)
            return result

    def run(forward):
        OutputSized.count = 0
        with OutputSized():
            out = forward(x)
        allocated = OutputSized.count
        grads = torch.autograd.grad(out.square().sum(), [x, layer.lora_A["default"].weight,
                                                          layer.lora_B["default"].weight])
        return out.detach(), grads, allocated

    fast_out, fast_grads, fast_allocated = run(layer)
    peft_out, peft_grads, peft_allocated = run(lambda t: lora_layer.Linear.forward(layer, t))
    assert fast_allocated == 1  # the base layer's output, which the adapter is added into
    assert peft_allocated >= 3  # the measured cause: B's output, its scaled copy, the sum
    torch.testing.assert_close(fast_out, peft_out, atol=1e-6, rtol=1e-5)
    for fast, peft in zip(fast_grads, peft_grads):
        torch.testing.assert_close(fast, peft, atol=1e-6, rtol=1e-5)
    with model.disable_adapter():  # the reference pass: the base layer alone
        torch.testing.assert_close(layer(x), layer.base_layer(x), atol=0, rtol=0)


def test_merged_weights_are_peft_merge_and_unload_under_the_base_names(model_path, world_of_one):
    def lora_model():
        torch.manual_seed(0)
        model = fsdp.apply_lora(fsdp.load_causal_lm(model_path), RANK, ALPHA)
        with torch.no_grad():  # B starts at 0: give it values so that the merge means something
            for name, param in model.named_parameters():
                if ".lora_B." in name:
                    param.normal_(std=0.05)
        return model

    expected = lora_model().merge_and_unload().state_dict()
    sharded = fsdp.apply_fsdp2(lora_model(), world_of_one)
    weights = merged(sharded)
    base = AutoModelForCausalLM.from_pretrained(model_path)
    base_names = {name for name, _ in fsdp.named_weights(base)}
    assert weights.keys() == base_names
    assert [(n, tuple(s)) for n, s, _ in fsdp.full_param_shapes(sharded)] == [
        (n, tuple(t.shape)) for n, t in weights.items()]
    moved = 0.0
    for name, tensor in weights.items():
        assert tensor.shape == base.state_dict()[name].shape, name
        torch.testing.assert_close(tensor, expected[name], atol=1e-6, rtol=0, msg=name)
        moved = max(moved, (tensor - base.state_dict()[name]).abs().max().item())
    assert moved > 1e-3  # the adapters are in the merged weights


def test_reference_is_the_base_model_with_the_adapters_off(worker, model_path):
    train_one_step(worker)
    data = ppo_batch(seed=5)
    ref = worker.compute_ref_log_prob(data).batch["ref_log_prob"]
    actor = worker.compute_log_prob(data).batch["old_log_probs"]

    base = DataParallelPPOActor(OmegaConf.create({}), fsdp.load_causal_lm(model_path))
    data.meta_info.update(micro_batch_size=4, temperature=1.0)
    expected, _ = base.compute_log_prob(data)
    torch.testing.assert_close(ref, expected, atol=1e-5, rtol=0)
    assert (actor - expected).abs().max() > 1e-3  # the trained adapters change the policy
    # the adapters are back on after the reference pass
    torch.testing.assert_close(worker.compute_log_prob(data).batch["old_log_probs"], actor, atol=0, rtol=0)


def test_export_is_a_plain_merged_model_and_a_checkpoint_resumes(worker, tmp_path):
    train_one_step(worker)
    at_save = merged(worker.actor_module)
    worker.save_hf_model(str(tmp_path / "hf"))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")  # no PEFT needed to load it
    state = exported.state_dict()
    for name, tensor in at_save.items():
        torch.testing.assert_close(state[name], tensor, atol=0, rtol=0, msg=name)

    worker.save_checkpoint(str(tmp_path / "ckpt"), global_step=1)
    train_one_step(worker, seed=1)
    assert any(not torch.equal(t, at_save[n]) for n, t in merged(worker.actor_module).items())
    worker.load_checkpoint(str(tmp_path / "ckpt"))
    for name, tensor in merged(worker.actor_module).items():
        assert torch.equal(tensor, at_save[name]), name


def test_negative_lora_rank_is_a_config_error(model_path):
    from hflow.workers.config import check_lora

    with pytest.raises(ConfigError, match="actor_rollout_ref.model.lora_rank"):
        check_lora(arr_config(model_path, "actor_rollout_ref.model.lora_rank=-1"), "actor_rollout_ref")


@pytest.mark.slow  # a learning run
def test_builtin_task_learns_with_lora(ray_session, tmp_path, monkeypatch):
    """GRPO on the built-in task training adapters only, with a KL loss: the reference log-probs come from the
    actor's base model (no reference worker)."""
    import json

    from hflow.trainer.main_ppo import run_ppo

    monkeypatch.chdir(tmp_path)
    overrides = ["algorithm.adv_estimator=grpo", f"actor_rollout_ref.model.lora_rank={RANK}",
                 "actor_rollout_ref.actor.optim.lr=2e-3", "actor_rollout_ref.actor.use_kl_loss=true",
                 "trainer.total_training_steps=8", "trainer.test_freq=8"]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        config = compose(config_name="ppo_trainer", overrides=overrides)
    run_ppo(config, frozenset(o.split("=")[0] for o in overrides))
    key = "val-core/hflow/arithmetic/reward/mean@1"
    records = [json.loads(line) for line in open(tmp_path / "logs" / "hflow" / "default" / "metrics.jsonl")]
    scores = [r[key] for r in records if key in r]
    assert any("actor/kl_loss" in r for r in records)
    assert scores[0] <= 0.2, scores
    assert scores[-1] >= 0.8, scores
