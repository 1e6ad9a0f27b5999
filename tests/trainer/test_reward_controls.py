"""Learning comes from the reward: on the built-in task, GRPO with the true reward learns, while the same
run with the training reward replaced by a seeded coin flip, or inverted, does not.

A bug that pushed the model off its pre-trained habit whatever the reward says (a sign error, advantages
that ignore the scores, a loss on the wrong tokens) would pass a test that only checks the real run; it
cannot pass these controls. The three runs are the same command but for the reward function: the README's
main job on the local backend (one process, HF rollout), in a subprocess where `import ray` and `import vllm`
raise, so the real run also shows that `trainer.backend=local` learns without either. Rewards are computed
in the driver (`timeout_s=null`), so the coin's draws, and the whole run, are reproducible.
bench/reward_controls.py runs the same three over five seeds and the full 30 steps (bench/results/
reward_controls.md).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.trainer.test_local_backend import IMPORT_BLOCKER

VAL_KEY = "val-core/hflow/arithmetic/reward/mean@1"
CONTROLS = str(Path(__file__).with_name("reward_controls.py"))
STEPS = 12


def _validation_scores(tmp_path, reward_name):
    blocker_dir = tmp_path / "blocker"
    blocker_dir.mkdir()
    (blocker_dir / "sitecustomize.py").write_text(IMPORT_BLOCKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker_dir), REPO_ROOT])}
    run = subprocess.run(
        [sys.executable, "-m", "hflow.trainer.main_ppo", "algorithm.adv_estimator=grpo", "trainer.backend=local",
         "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.name=hf", f"trainer.total_training_steps={STEPS}",
         f"custom_reward_function.path={CONTROLS}", f"custom_reward_function.name={reward_name}",
         "custom_reward_function.timeout_s=null", "+custom_reward_function.reward_kwargs.coin_seed=1"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    records = [json.loads(line) for line in open(tmp_path / "logs" / "hflow" / "default" / "metrics.jsonl")]
    return {r["step"]: r[VAL_KEY] for r in records if VAL_KEY in r}


@pytest.mark.parametrize("reward_name", ["real", "coin_flip", "inverted"])
def test_only_the_real_reward_teaches_the_task(tmp_path, reward_name):
    scores = _validation_scores(tmp_path, reward_name)  # {step: greedy validation score}, every 2 steps
    assert sorted(scores) == list(range(0, STEPS + 1, 2)), scores
    assert scores[0] <= 0.2, scores  # the built-in model starts out wrong
    later = [score for step, score in scores.items() if step >= 4]
    if reward_name == "real":
        assert scores[STEPS] >= 0.9 and sum(later) / len(later) >= 0.8, scores
    elif reward_name == "coin_flip":
        # The built-in model's one habit ("one too high") is a shared direction that random updates undo, so
        # the coin drifts: with coin_seed=1 it reaches 0.55 by step 12 (reproducibly), and over five seeds and
        # 30 steps see bench/results/reward_controls.md. It must stay below the real reward's pass mark.
        assert max(scores.values()) < 0.8 and scores[STEPS] < 0.8, scores
    else:
        assert max(scores.values()) <= 0.1, scores
