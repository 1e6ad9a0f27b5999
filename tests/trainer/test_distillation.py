"""On-policy distillation teaches the built-in task with no task reward at all, and its control does not.

The student is the built-in model (it prefers the answer one too high: greedy validation 0.0); the teacher is
the same architecture and tokenizer pre-trained without that habit (`TEACHER_SPEC`: greedy validation 1.0).
With `algorithm.distill.task_reward_coef=0` the only reward is the teacher's log-prob minus the student's at
each sampled token, so GRPO can lift the student only through the teacher. The control replaces the teacher by
the student's own folder: the same reward machinery, a signal that says nothing about the answer, and the
student stays wrong. A bug that moved the student whatever the teacher says (a reward of the wrong sign or on
the wrong tokens, a task reward leaking in) fails one of the two.

The runs are the real entry point on the local backend (one process, HF rollout), with the lean recipe below
(16 prompts x 4 samples per step, no KL anchor); bench/distill_controls.py runs both arms over 3 seeds and
more steps (bench/results/distill_controls.md).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.trainer.learning import VAL_KEY, validation_curve

pytestmark = pytest.mark.slow  # learning runs (distillation and its control)

STEPS = 6
# the recipe every distillation run here and in bench/distill_controls.py uses (beside the built-in settings)
RECIPE = ["algorithm.adv_estimator=grpo", "trainer.backend=local", "trainer.n_gpus_per_node=1",
          "actor_rollout_ref.rollout.name=hf", "data.train_batch_size=16", "actor_rollout_ref.rollout.n=4",
          "actor_rollout_ref.actor.ppo_mini_batch_size=16", "actor_rollout_ref.actor.use_kl_loss=false",
          "algorithm.distill.coef=1.0", "algorithm.distill.task_reward_coef=0.0", "trainer.test_freq=2",
          "trainer.logger=[jsonl]"]


def teacher_paths() -> dict[str, str]:
    """{arm: teacher.model.path}: the clean teacher, and (the control) the student itself."""
    from hflow.tasks.builtin_task import TEACHER_SPEC, ensure_builtin_assets

    return {"teacher": ensure_builtin_assets(spec=TEACHER_SPEC).model_path,
            "self": ensure_builtin_assets().model_path}


def distill(work: Path, teacher_path: str, steps: int, seed: int, threads: int | None = None,
            overrides: tuple[str, ...] = ()) -> dict[int, float]:
    """One run of the recipe (then `overrides`) in `work`; returns {step: greedy validation score}."""
    work.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "hflow.trainer.main_ppo", *RECIPE, f"teacher.model.path={teacher_path}",
           f"trainer.total_training_steps={steps}", f"data.seed={seed}", f"trainer.seed={seed}",
           f"actor_rollout_ref.rollout.seed={seed}", *overrides]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")]))}
    if threads:  # several runs at a time: one torch thread pool each, or they fight over the cores
        env["OMP_NUM_THREADS"] = str(threads)
    with open(work / "log.txt", "w") as log:
        run = subprocess.run(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=3600)
    assert run.returncode == 0, (work / "log.txt").read_text()[-4000:]
    return validation_curve(metrics(work), VAL_KEY)


def metrics(work: Path) -> list[dict]:
    """The run's metric records, one per step."""
    return [json.loads(line) for line in open(work / "logs" / "hflow" / "default" / "metrics.jsonl")]


@pytest.mark.parametrize("arm", ["teacher", "self"], ids=["clean-teacher", "control-student-as-teacher"])
def test_distillation_teaches_only_with_a_teacher_that_knows(tmp_path, arm):
    curve = distill(tmp_path, teacher_paths()[arm], STEPS, seed=1)
    assert sorted(curve) == list(range(0, STEPS + 1, 2)), curve
    assert curve[0] <= 0.2, curve  # the built-in student starts out wrong
    if arm == "teacher":
        assert curve[STEPS] >= 0.9 and curve[STEPS - 2] >= 0.8, f"did not learn from the teacher: {curve}"
    else:
        assert max(curve.values()) <= 0.2, f"learned without a teacher that knows: {curve}"


JSD_STEPS = 4


def test_the_jsd_term_alone_teaches_from_the_teacher(tmp_path):
    """GKD's term alone (`algorithm.distill.jsd_coef=1`, no reward of any kind: every advantage is 0, so the
    policy loss passes nothing) moves the student toward the teacher: the measured reverse KL of its samples
    to the teacher falls, and its greedy answers become right. The control for this claim is the test above's
    (the same machinery with the student as its own teacher: the term is then 0 and nothing moves)."""
    curve = distill(tmp_path, teacher_paths()["teacher"], JSD_STEPS, seed=1,
                    overrides=("algorithm.distill.coef=0.0", "algorithm.distill.jsd_coef=1.0"))
    kl = {r["step"]: r["distill/reverse_kl"] for r in metrics(tmp_path) if "distill/reverse_kl" in r}
    jsd = {r["step"]: r["actor/distill_jsd"] for r in metrics(tmp_path) if "actor/distill_jsd" in r}
    pg = [r["actor/pg_loss"] for r in metrics(tmp_path) if "actor/pg_loss" in r]
    assert all(value == 0 for value in pg), pg  # the term is the only thing that trains
    assert curve[0] <= 0.2 and curve[JSD_STEPS] >= 0.8, f"did not learn from the teacher's distribution: {curve}"
    assert kl[JSD_STEPS] < 0.5 * kl[1] and jsd[JSD_STEPS] < 0.5 * jsd[1], (kl, jsd)
