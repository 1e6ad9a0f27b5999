"""The memory plan (hflow.trainer.memory, printed by hflow.cli.memory_plan): its phases on the built-in model, the sharding, checkpointing and
optimizer terms, a plan that does not fit with the key that makes it fit, preflight's summary and enforce
modes, and the plan against the real run's tensors on CPU (one small setting)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from hflow import CONFIG_DIR
from hflow.trainer.memory import facts as memory_facts, plan as mp
from hflow.config_schema import ConfigError
from hflow.tasks.defaults import fill_builtin_defaults
from hflow.trainer.config import validate_config

GIB = 2**30
# a small run of the built-in model: short sequences, few of them
SMALL = ["data.max_prompt_length=32", "data.max_response_length=32", "data.train_batch_size=4",
         "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "critic.ppo_mini_batch_size=4",
         "critic.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
         "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4", "critic.forward_micro_batch_size_per_gpu=4",
         "trainer.backend=local", "trainer.n_gpus_per_node=1"]


def builtin_config(*overrides: str):
    args = [*SMALL, *overrides]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        config = validate_config(compose(config_name="ppo_trainer", overrides=args))
    fill_builtin_defaults(config, frozenset(a.split("=", 1)[0] for a in args))
    return config


def phase(plan: mp.Plan, name: str) -> mp.Phase:
    return next(p for p in plan.phases if p.name == name)


def test_the_plan_of_the_builtin_run_has_every_phase_and_fits():
    plan = mp.plan_memory(builtin_config(), "cpu", 8 * GIB)
    assert [p.name for p in plan.phases] == ["rollout", "weight sync", "old log-prob", "ref log-prob", "values",
                                             "actor update", "critic update"]
    assert plan.fits and all(p.total > 0 for p in plan.phases)
    update = phase(plan, "actor update").components
    assert update["actor optimizer state"] > 0 and update["actor grads (sharded)"] > 0
    assert update["actor activations"] > 0
    assert phase(plan, "rollout").components["vLLM KV cache"] == mp.CPU_DEFAULT_KV_CACHE_BYTES
    text = mp.format_plan(plan)
    assert "| actor update |" in text and "— fits" in text and "assumed" in text


def test_the_constants_memory_plan_repeats_are_the_modules_own():
    # memory_plan repeats them so that a cached plan imports neither vLLM nor transformers
    from hflow.utils import packing
    from hflow.workers import fsdp

    source = (Path(mp.__file__).parents[2] / "workers" / "rollout" / "vllm_rollout.py").read_text()
    [expr] = re.findall(r"^CPU_DEFAULT_KV_CACHE_BYTES = (.+)$", source, flags=re.M)
    assert eval(compile(ast.parse(expr, mode="eval"), "", "eval")) == mp.CPU_DEFAULT_KV_CACHE_BYTES
    assert mp.CPU_ATTENTION == packing.SDPA_VARLEN
    for numel, size, device in ((7_000_000_000, 2, 80 * GIB), (14_000_000_000, 2, 80 * GIB), (10**6, 4, 10**6)):
        assert memory_facts.gather_once(None, numel, size, "cuda", device) == fsdp.gather_once_fits(numel, size, device, True)
    assert memory_facts.gather_once(None, 10**12, 4, "cpu", 1) and not memory_facts.gather_once(False, 1, 4, "cpu", 1)
    for numel, device in ((1_500_000_000, 80 * GIB), (3_000_000_000, 80 * GIB), (7_000_000_000, 80 * GIB)):
        assert (memory_facts.gather_once_update(None, numel, 2, 4, "cuda", device)
                == fsdp.update_gather_fits(numel, 2, 4, device, True))
    assert memory_facts.gather_once_update(None, 1_500_000_000, 2, 4, "cuda", 80 * GIB)
    assert not memory_facts.gather_once_update(None, 7_000_000_000, 2, 4, "cuda", 80 * GIB)


def test_sharded_state_is_divided_by_the_world_size():
    one = mp.plan_memory(builtin_config(), "cpu", 8 * GIB)
    two = mp.plan_memory(builtin_config("trainer.backend=ray", "trainer.n_gpus_per_node=2"), "cpu", 8 * GIB)
    for name, key in (("actor update", "actor params (sharded)"), ("actor update", "actor optimizer state"),
                      ("old log-prob", "actor optimizer state (AdamW, sharded)"),  # resident: a formula
                      ("old log-prob", "ref params (sharded)")):
        assert phase(two, name).components[key] == pytest.approx(phase(one, name).components[key] / 2, rel=0.02), key


def test_optimizer_state_is_two_fp32_moments_per_parameter():
    plan = mp.plan_memory(builtin_config(), "cpu", 8 * GIB)
    numel = plan.facts["parameters"]
    assert phase(plan, "actor update").components["actor optimizer state"] == pytest.approx(2 * 4 * numel, rel=0.01)
    # between updates the state stays on the device: the log-prob pass carries it too
    assert phase(plan, "old log-prob").components["actor optimizer state (AdamW, sharded)"] == pytest.approx(
        2 * 4 * numel, rel=0.01)


def test_the_actors_ema_is_an_fp32_copy_of_its_shards_in_every_phase():
    plan = mp.plan_memory(builtin_config("actor_rollout_ref.actor.ema.enable=true"), "cpu", 8 * GIB)
    for name in ("old log-prob", "actor update", "rollout"):
        assert phase(plan, name).components["actor EMA (fp32, sharded)"] == pytest.approx(
            4 * plan.facts["parameters"]), name


def test_gradient_checkpointing_lowers_the_update_activations():
    longer = ["data.max_prompt_length=128", "data.max_response_length=128"]
    off = phase(mp.plan_memory(builtin_config(*longer), "cpu", 8 * GIB), "actor update")
    on = phase(mp.plan_memory(builtin_config(*longer, "actor_rollout_ref.model.enable_gradient_checkpointing=true"),
                              "cpu", 8 * GIB), "actor update")
    assert on.components["actor activations"] < 0.8 * off.components["actor activations"]


HEAVY = ["data.max_prompt_length=256", "data.max_response_length=256", "data.train_batch_size=16",
         "actor_rollout_ref.actor.ppo_mini_batch_size=16", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
         "critic.ppo_micro_batch_size_per_gpu=4", "critic.ppo_mini_batch_size=16"]


def device_for_heavy(config) -> float:
    """A device between the heavy run's other phases and its actor update: only the update is over."""
    roomy = mp.plan_memory(config, "cpu", 64 * GIB)
    assert roomy.peak.name == "actor update"
    others = max(p.total for p in roomy.phases if p.name != "actor update")
    return (others + roomy.peak.total) / 2


def test_a_plan_that_does_not_fit_names_the_phase_and_a_key_that_makes_it_fit():
    config = builtin_config(*HEAVY)
    device = device_for_heavy(config)
    plan = mp.plan_memory(config, "cpu", device)
    assert [p.name for p in plan.failing()] == ["actor update"]
    assert "does NOT fit" in mp.summary_line(plan) and "actor update" in mp.summary_line(plan)
    found = mp.remedies(config, plan)
    fitting = [r for r in found if r.fits]
    assert fitting, mp.format_plan(plan, found)
    first = fitting[0]
    assert set(first.overrides) <= {"actor_rollout_ref.model.enable_gradient_checkpointing",
                                    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"}
    fixed = mp.plan_memory(mp._with(config, first.overrides), "cpu", device)
    assert fixed.fits and phase(fixed, "actor update").total == pytest.approx(first.after)


def test_enforce_refuses_in_preflight_naming_the_phase_and_a_key(capsys):
    from hflow.trainer.preflight import preflight_check

    device = device_for_heavy(builtin_config(*HEAVY))
    config = builtin_config(*HEAVY, "trainer.memory_plan=enforce", f"trainer.device_memory_gb={device / GIB}")
    with pytest.raises(ConfigError) as err:
        preflight_check(config)
    message = str(err.value)
    assert "memory plan: phase 'actor update' does not fit" in message
    assert re.search(r"actor_rollout_ref\.(model\.enable_gradient_checkpointing=true|actor\.ppo_micro_batch_size_per_gpu=)",
                     message), message
    OmegaConf.update(config, "trainer.memory_plan", "summary")  # summary: one line, no refusal
    preflight_check(config)
    assert "does NOT fit" in capsys.readouterr().out


def test_summary_prints_one_line_and_off_prints_nothing(capsys):
    from hflow.trainer.preflight import check_memory

    check_memory(builtin_config())
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("memory plan: peak ") and out[0].endswith("— fits"), out
    check_memory(builtin_config("trainer.memory_plan=off"))
    assert capsys.readouterr().out == ""
    with pytest.raises(ConfigError, match="trainer.memory_plan"):
        check_memory(builtin_config("trainer.memory_plan=always"))


def test_a_model_folder_without_a_model_type_skips_the_summary(tmp_path, capsys):
    from hflow.trainer.preflight import check_memory

    (tmp_path / "config.json").write_text('{"max_position_embeddings": 512}')
    config = builtin_config()
    OmegaConf.update(config, "actor_rollout_ref.model.path", str(tmp_path))
    check_memory(config)
    assert capsys.readouterr().out.startswith("memory plan: skipped")


def test_the_plan_matches_the_real_run_counted_on_cpu(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh

    from hflow.trainer.memory.trace import count_real_pass

    config = builtin_config("data.max_prompt_length=64", "data.max_response_length=64")
    plan = mp.plan_memory(config, "cpu", 8 * GIB)  # before the real process group: the plan makes a fake one
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'store'}")
    try:
        mesh = init_device_mesh("cpu", (1,))
        for name in ("old log-prob", "actor update"):
            traced = phase(plan, name)
            counted = count_real_pass(name, traced.spec, OmegaConf.create(OmegaConf.to_container(config, resolve=True)),
                                      mesh)["Total"]
            # the bench finds 0.999-1.001 (bench/results/memory_plan.md); 10 % is the bound, 2 % what holds
            assert traced.traced == pytest.approx(counted, rel=0.02), (name, traced.traced, counted)
    finally:
        dist.destroy_process_group()


def test_the_distillation_teacher_is_counted_at_its_own_size(tmp_path):
    from hflow.tasks.tiny_models import build_causal_lm

    teacher = build_causal_lm(tmp_path / "teacher", preset="tiny", seed=0, hidden_size=256, intermediate_size=512)
    with_teacher = [f"teacher.model.path={teacher}", "algorithm.distill.coef=1", "teacher.fsdp_config.param_offload=false"]
    plan = mp.plan_memory(builtin_config(*with_teacher), "cpu", 8 * GIB)
    names = [p.name for p in plan.phases]
    assert names.index("ref log-prob") < names.index("teacher log-prob") < names.index("actor update"), names
    teacher_numel = memory_facts.model_numel(memory_facts.model_config_text(OmegaConf.create({"path": str(teacher)})))[0]
    assert teacher_numel > 2 * plan.facts["parameters"]  # a bigger model than the student
    # kept between its passes (fp32 on CPU), in every other phase
    for name in ("old log-prob", "actor update", "rollout"):
        assert phase(plan, name).components["teacher params (sharded)"] == pytest.approx(4 * teacher_numel), name
    # its pass is traced on its own architecture, not the student's
    assert phase(plan, "teacher log-prob").traced > phase(plan, "ref log-prob").traced
    # offloaded between uses on a GPU: nothing of it stays in the other phases
    offloaded = mp.plan_memory(builtin_config(*with_teacher[:2]), "cuda", 80 * GIB)
    assert "teacher params (sharded)" not in phase(offloaded, "actor update").components
    assert "teacher log-prob" in [p.name for p in offloaded.phases]
