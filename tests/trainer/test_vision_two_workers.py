"""The built-in vision task on the default two Ray workers, as the README runs it (issue 53).

`python -m hflow.trainer.main_ppo algorithm.adv_estimator=grpo data.builtin_task=vision_digits` shards the tiny
Qwen2-VL over two FSDP2 ranks. Two things failed there and nowhere on one rank, where FSDP2 leaves the model
plain: the memory plan's trace (the vision tower never ran in it, so its units were never gathered: the
tracker's `_unsharded_param` AttributeError; and its gradients and optimizer state were missing on every
world size), and the HF rollout (`generate` encodes the images before its first forward, where the root
unit's patch embedding and merger were still shards: "got mixed torch.Tensor and DTensor").

- fast: two steps on the two workers, planned by the memory plan, and the plan's trace of the tower (its
  optimizer state present, and absent with `freeze_vision_tower`, on one rank and on two);
- slow: the learning claim on two workers beside its control (blanked training pictures), as
  tests/trainer/test_vision_task_learns.py makes it on one rank;
- vLLM asked to sample a vision-language model where it cannot build one (the CPU stack) stops in
  preflight, naming the key and the fix.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tests.trainer.learning import validation_curve
from tests.trainer.test_command_line import main_ppo
from tests.trainer.test_user_errors import run_in_process
from tests.trainer.test_vision_task_learns import CONTROL_AT_MOST, LEARNED_AT_LEAST, VAL_KEY, vision_assets  # noqa: F401

STEPS = 6


def metrics(work: Path) -> list[dict]:
    return [json.loads(line) for line in open(work / "logs" / "hflow" / "default" / "metrics.jsonl")]


def test_the_default_is_two_workers():
    from hflow.trainer.config import default_config

    assert default_config().trainer.n_gpus_per_node == 2  # what "the default two workers" below means


@pytest.mark.timeout(900)
def test_vision_task_runs_on_two_ray_workers_planned_by_the_memory_plan(vision_assets, tmp_path):  # noqa: F811
    from hflow.cli import memory_plan

    code, output, _ = main_ppo(tmp_path, "algorithm.adv_estimator=grpo", "data.builtin_task=vision_digits",
                               "trainer.total_training_steps=2", "trainer.test_freq=2",
                               "trainer.val_before_train=false", "trainer.logger=[console,jsonl]", timeout=840)
    assert code == 0, output[-4000:]
    assert "memory plan: peak" in output and "fits" in output, output[-4000:]
    records = metrics(tmp_path)
    assert [r["step"] for r in records if "critic/score/mean" in r] == [1, 2]
    assert VAL_KEY in records[-1]
    # the plan it printed, in full: two ranks, the vision tower's share in the passes (traces cached by the run)
    table = tmp_path / "plan.md"
    assert memory_plan.main(["algorithm.adv_estimator=grpo", "data.builtin_task=vision_digits",
                             "--out", str(table)]) == 0
    plan = table.read_text()
    assert "2 training ranks" in plan and "actor vision tower (activations, pixels)" in plan, plan


def _tiny_vision_spec(world: int):
    from hflow.tasks.vision_task import ensure_vision_assets
    from hflow.trainer.memory.trace import PassSpec

    text = (Path(ensure_vision_assets().model_path) / "config.json").read_text()
    return PassSpec(model="causal", model_config=text, world=world, batch=4, seq=36, response=4, train=True)


@pytest.mark.parametrize("world", [1, 2])
def test_trace_of_an_update_holds_the_vision_towers_optimizer_state(world):
    """AdamW's moments of every trainable parameter are in the update's trace: the tower's too, unless it is
    frozen; so trained / frozen is all parameters / the language model's."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from hflow.trainer.memory.trace import trace_fake

    spec = _tiny_vision_spec(world)
    model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(**json.loads(spec.model_config)))
    total = sum(p.numel() for p in model.parameters())
    tower = sum(p.numel() for p in model.model.visual.parameters())
    trains = trace_fake(spec)
    frozen = trace_fake(replace(spec, freeze_vision_tower=True))
    assert trains["OptState"] / frozen["OptState"] == pytest.approx(total / (total - tower), rel=1e-3)


def test_vllm_on_a_vision_model_without_torchvision_stops_in_preflight(vision_assets, tmp_path, monkeypatch,  # noqa: F811
                                                                      capsys):
    """The user's own image rows and the vision model with the default rollout (vLLM): on the CPU stack
    torchvision does not load, so vLLM's engine could not build the model (it stopped at start-up in a
    pydantic ValidationError traceback); preflight says which key to set instead. (torchvision is made
    unimportable here, as it is on the CPU stack, so the case is the same on a machine that has it.)"""
    monkeypatch.setitem(sys.modules, "torchvision", None)
    args = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4",
            f"data.train_files={vision_assets.train_file}", f"data.val_files={vision_assets.val_file}",
            f"actor_rollout_ref.model.path={vision_assets.model_path}",
            "data.max_prompt_length=32", "data.max_response_length=4"]
    code, output, stderr = run_in_process("hflow.trainer.main_ppo", args, tmp_path, monkeypatch, capsys)
    assert code == 1 and "Traceback" not in output, output[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("hflow: error: actor_rollout_ref.rollout.name=vllm cannot sample from the "
                           "vision-language model"), last
    assert "torchvision" in last and "Set actor_rollout_ref.rollout.name=hf" in last, last


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_grpo_learns_the_vision_task_on_two_workers_and_not_blanked_pictures(vision_assets, tmp_path):  # noqa: F811
    curves = {}
    for task in ("vision_digits", "vision_digits_blanked"):
        work = tmp_path / task
        work.mkdir()
        code, output, _ = main_ppo(work, "algorithm.adv_estimator=grpo", f"data.builtin_task={task}",
                                   f"trainer.total_training_steps={STEPS}", f"trainer.test_freq={STEPS}",
                                   "trainer.logger=[console,jsonl]", timeout=840)
        assert code == 0, output[-4000:]
        curves[task] = validation_curve(metrics(work), VAL_KEY)
    learned, blanked = curves["vision_digits"], curves["vision_digits_blanked"]
    assert sorted(learned) == [0, STEPS], learned
    assert learned[0] <= 0.2 and learned[STEPS] >= LEARNED_AT_LEAST, learned
    assert max(blanked.values()) <= CONTROL_AT_MOST, blanked
