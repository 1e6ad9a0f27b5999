"""Learning comes from the reward: on the built-in task, GRPO with the true reward learns, while the same
run with the training reward replaced by a seeded coin flip, or inverted, does not; PPO with a critic (GAE)
learns with the true reward too.

A bug that pushed the model off its pre-trained habit whatever the reward says (a sign error, advantages
that ignore the scores, a loss on the wrong tokens, a missing KL anchor) would pass a test that only checks
the real run; it cannot pass these controls. The runs are the same command but for the reward function and
the estimator: the README's main job on the local backend (one process, HF rollout), in a subprocess where
`import ray` and `import vllm` raise, so the real runs also show that `trainer.backend=local` learns without
either. Rewards are computed in the driver (`timeout_s=null`), so the coin's draws, and the whole run, are
reproducible. bench/reward_controls.py runs the GRPO three over five seeds and the full 30 steps
(bench/results/reward_controls.md), where the coin never exceeds 0.3 and the inverted reward 0.1: the marks
asserted here. As in the bench, the runs go two at a time with one torch thread each (a run of the tiny
model gains little from a second thread; two side by side use both cores): the four take the time of two.
"""

import json
import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.trainer.learning import assert_learned, validation_curve
from tests.trainer.test_local_backend import IMPORT_BLOCKER

pytestmark = pytest.mark.slow  # learning runs (the real reward and its controls)

CONTROLS = str(Path(__file__).with_name("reward_controls.py"))
STEPS = 8


def _validation_scores(tmp_path, estimator, reward_name):
    blocker_dir = tmp_path / "blocker"
    blocker_dir.mkdir()
    (blocker_dir / "sitecustomize.py").write_text(IMPORT_BLOCKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker_dir), REPO_ROOT]), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "hflow.trainer.main_ppo", f"algorithm.adv_estimator={estimator}", "trainer.backend=local",
         "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.name=hf", f"trainer.total_training_steps={STEPS}",
         f"custom_reward_function.path={CONTROLS}", f"custom_reward_function.name={reward_name}",
         "custom_reward_function.timeout_s=null", "+custom_reward_function.reward_kwargs.coin_seed=1"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    records = [json.loads(line) for line in open(tmp_path / "logs" / "hflow" / "default" / "metrics.jsonl")]
    return validation_curve(records)


CASES = [("grpo", "real"), ("grpo", "coin_flip"), ("grpo", "inverted"), ("gae", "real")]


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> dict[tuple[str, str], Future]:
    """{(estimator, reward): the run's future validation curve}, for the cases this session selected, two
    runs at a time. A run that fails raises in its own test only (`Future.result`)."""
    wanted = [case for case in CASES if any(getattr(item, "callspec", None) is not None and item.module is
                                            request.module and tuple(item.callspec.params.values()) == case
                                            for item in request.session.items)]
    with ThreadPoolExecutor(2) as pool:  # leaving the block waits for every run
        return {case: pool.submit(_validation_scores, tmp_path_factory.mktemp("-".join(case)), *case)
                for case in wanted}


# The first test's setup runs all four, two at a time: its time limit is two runs' (each stops at 900 s).
@pytest.mark.timeout(2 * 900 + 60)
@pytest.mark.parametrize("estimator,reward_name", CASES, ids=["grpo-real", "grpo-coin_flip", "grpo-inverted", "gae-real"])
def test_only_the_real_reward_teaches_the_task(runs, estimator, reward_name):
    scores = runs[(estimator, reward_name)].result()  # {step: greedy validation score}, every 2 steps
    assert sorted(scores) == list(range(0, STEPS + 1, 2)), scores
    if reward_name == "real":
        assert_learned(scores)
    else:
        assert scores[0] <= 0.2, scores  # the built-in model starts out wrong ...
        # ... and stays wrong when the reward says nothing about the answer, or rewards wrong ones
        assert max(scores.values()) <= (0.3 if reward_name == "coin_flip" else 0.1), scores
