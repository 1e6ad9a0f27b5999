"""Self-distillation (OPSD, `teacher.source=self`) teaches the built-in task with no task reward, and its control
does not.

The student is the built-in model pre-trained also to answer what a hint in the prompt says (`HINT_SPEC`): on
its own prompt it prefers the answer one too high (greedy validation 0.0); with "The answer is <h>." after the
question it answers h. The teacher is that same policy (its starting weights, frozen) shown the row's privileged
context; the only reward is the teacher's log-prob minus the student's at each sampled token
(`algorithm.distill.task_reward_coef=0`). Arm `answer`: the context is the ground truth, so the teacher prefers
the right answer and the student learns it without ever seeing the hint. Control `wrong`: the context is a
wrong answer (`extra_info.wrong_answer` = the answer + 2): the same machinery, a teacher that says the wrong
number, and the student never answers right. A bug that moved the student whatever the context says (the
context dropped, the response re-tokenised off its positions, a task reward leaking in) fails one of the two.

The runs are the real entry point on the local backend with the recipe of tests/trainer/test_distillation.py
(slow tier: 6 steps; fast tier: 2 steps); `bench/distill_controls.py --opsd` runs both arms over 3 seeds
(bench/results/opsd_task.md).
"""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.trainer.test_distillation import distill

STEPS = 6
FAST_STEPS = 2  # the fast tier's version: the first validation after training, both arms
TEMPLATES = {"answer": "{prompt}\nThe answer is {ground_truth}.", "wrong": "{prompt}\nThe answer is {wrong_answer}."}
# the built-in task's own settings (config/builtin_task.yaml), which apply only when model and data are both unset
BUILTIN = ["data.max_prompt_length=32", "data.max_response_length=8",
           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", "actor_rollout_ref.actor.optim.lr=2.0e-4"]


def opsd(work: Path, arm: str, steps: int, seed: int, threads: int | None = None) -> dict[int, float]:
    """One run of `arm` in `work`; returns {step: greedy validation score}."""
    from hflow.tasks.builtin_task import HINT_SPEC, ensure_builtin_assets

    assets = ensure_builtin_assets(spec=HINT_SPEC)
    work.mkdir(parents=True, exist_ok=True)
    rows = pq.read_table(assets.train_file).to_pylist()
    for row in rows:  # the control's privileged context: a wrong answer (neither right nor the habit's)
        row["extra_info"] = {**row["extra_info"], "wrong_answer": row["extra_info"]["answer"] + 2}
    train = work / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), train)
    overrides = (f"actor_rollout_ref.model.path={assets.model_path}", f"data.train_files={train}",
                 f"data.val_files={assets.val_file}", "teacher.source=self",
                 f"teacher.privileged_template='{TEMPLATES[arm]}'", *BUILTIN)
    return distill(work, assets.model_path, steps, seed, threads=threads, overrides=overrides)


ARMS = pytest.mark.parametrize("arm", ["answer", "wrong"], ids=["privileged-answer", "control-wrong-answer"])


@pytest.mark.slow  # learning runs (self-distillation and its control)
@ARMS
def test_self_distillation_teaches_only_with_the_right_context(tmp_path, arm):
    curve = opsd(tmp_path, arm, STEPS, seed=1)
    assert sorted(curve) == list(range(0, STEPS + 1, 2)), curve
    assert curve[0] <= 0.2, curve  # the student starts out wrong
    if arm == "answer":
        assert curve[STEPS] >= 0.8, f"did not learn from its privileged self: {curve}"
    else:
        assert max(curve.values()) <= 0.2, f"learned from a teacher shown a wrong answer: {curve}"


@ARMS
def test_two_steps_of_self_distillation_move_the_student_only_with_the_right_context(tmp_path, arm):
    """The fast tier's version: after 2 steps the right context has lifted the held-out score (0.35-0.57 in
    bench/results/opsd_task.md) and the wrong one has not."""
    curve = opsd(tmp_path, arm, FAST_STEPS, seed=1)
    assert curve[0] <= 0.2, curve
    if arm == "answer":
        assert curve[FAST_STEPS] >= 0.25, f"did not move towards its privileged self: {curve}"
    else:
        assert curve[FAST_STEPS] <= 0.1, f"moved towards the right answer with a wrong context: {curve}"
