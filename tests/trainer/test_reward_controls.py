"""Learning comes from the reward: on the built-in task, GRPO with the true reward learns, while the same
run with the training reward replaced by a coin flip, or inverted, does not.

A bug that pushed the model off its pre-trained bias whatever the reward says (a sign error, advantages
that ignore the scores, a loss on the wrong tokens) would pass a test that only checks the real run;
it cannot pass these controls. The runs use the local backend (one process) to stay cheap; the rollout
and update are the same code as on Ray.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

VAL_KEY = "val-core/hflow/arithmetic/reward/mean@1"
CONTROLS = str(Path(__file__).with_name("reward_controls.py"))


def _validation_scores(tmp_path, reward_name):
    run = subprocess.run(
        [sys.executable, "-m", "hflow.trainer.main_ppo", "algorithm.adv_estimator=grpo", "trainer.backend=local",
         "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.name=hf", "trainer.total_training_steps=12",
         f"custom_reward_function.path={CONTROLS}", f"custom_reward_function.name={reward_name}"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": REPO_ROOT}, capture_output=True, text=True, timeout=900,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    records = [json.loads(line) for line in open(tmp_path / "logs" / "hflow" / "default" / "metrics.jsonl")]
    return [r[VAL_KEY] for r in records if VAL_KEY in r]


# The positive control -- the same local run with the real reward learns -- is
# tests/trainer/test_local_backend.py::test_local_backend_learns_without_ray_or_vllm.
@pytest.mark.parametrize("reward_name,learns", [("coin_flip", False), ("inverted", False)])
def test_only_the_real_reward_teaches_the_task(tmp_path, reward_name, learns):
    scores = _validation_scores(tmp_path, reward_name)
    assert scores[0] <= 0.2, scores  # the built-in model starts out wrong
    if learns:
        assert scores[-1] >= 0.8, scores
    elif reward_name == "inverted":
        assert max(scores) <= 0.3, scores
    else:
        # A coin-flip reward is a random walk, and the model's one habit ("one too high") is a single shared
        # direction: a walk along it moves many problems at once. The run is not bit-reproducible, and in
        # seven runs the walk peaked anywhere from 0.1 to 0.75 (the spurious-reward effect: clipped updates on
        # random advantages drift along the policy's own prior). The real reward passes 0.8 by step 4 and
        # stays there; the coin must never reach it.
        assert max(scores) < 0.8 and scores[-1] < 0.8, scores
