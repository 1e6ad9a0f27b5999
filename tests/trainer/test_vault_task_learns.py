"""The built-in stateful task learns with its environment, and not with either control.

`python -m hflow.trainer.main_ppo algorithm.adv_estimator=grpo data.builtin_task=vault` trains
`hflow.tasks.vault_task`: the code to open a vault exists only in the episode's environment, shown after a
first turn ``look``; the small model looks a fifth of the time (greedy: never, score 0) and copies what it is
shown. Held-out greedy episodes with the real environment must go from <= 0.2 to >= 0.8 through hflow's
multi-turn loop on the vLLM engine (local backend). The controls are the same command with the environment's
state reset at every turn (`vault_reset_every_turn`) or its feedback shuffled (`vault_shuffled`), on training
rows only: looking can no longer pay, and the held-out score must stay <= 0.2. bench/stateful_task.py runs the
three over three seeds (bench/results/stateful_task.md). The three runs go at once, one torch thread each.
"""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.trainer.learning import validation_curve

pytestmark = pytest.mark.slow  # learning runs (the stateful task and its two controls)

VAL_KEY = "val-core/hflow/vault/reward/mean@1"
STEPS = 6
TASKS = ("vault", "vault_reset_every_turn", "vault_shuffled")


def run_vault(work: Path, task: str) -> tuple[dict[int, float], list[dict]]:
    work.mkdir()
    run = subprocess.run(
        [sys.executable, "-m", "hflow.trainer.main_ppo", "algorithm.adv_estimator=grpo", f"data.builtin_task={task}",
         "trainer.backend=local", "trainer.n_gpus_per_node=1", f"trainer.total_training_steps={STEPS}",
         "trainer.logger=[jsonl]"],
        cwd=work, capture_output=True, text=True, timeout=900,
        env={**os.environ, "PYTHONPATH": REPO_ROOT, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    records = [json.loads(line) for line in open(work / "logs" / "hflow" / "default" / "metrics.jsonl")]
    return validation_curve(records, VAL_KEY), records


@pytest.mark.timeout(900 + 60)
def test_grpo_learns_the_vault_and_neither_control_does(tmp_path):
    from hflow.tasks.vault_task import ensure_vault_assets

    ensure_vault_assets()  # once, before the runs that share it
    with ThreadPoolExecutor(len(TASKS)) as pool:
        futures = {task: pool.submit(run_vault, tmp_path / task, task) for task in TASKS}
    (learned, records), *controls = [futures[task].result() for task in TASKS]
    assert sorted(learned) == list(range(0, STEPS + 1, 2)), learned
    assert learned[0] <= 0.2 and learned[STEPS] >= 0.8, learned
    assert min(r["agent/ended/env_done"] for r in records if "agent/ended/env_done" in r) >= 0.95, "the env judges"
    for task, (curve, control_records) in zip(TASKS[1:], controls):
        assert max(curve.values()) <= 0.2, (task, curve)
        scores = [r["critic/score/mean"] for r in control_records if "critic/score/mean" in r]
        assert max(scores) <= 0.02, (task, scores)  # its training feedback never opens a vault
