"""The reward managers teach the built-in task: ``reward_model.reward_manager=batch`` (the user's function
called once per batch, with lists), ``dapo`` (naive plus the overlong buffer, on by default for it), a manager
the user's reward file registers, and the remote scorer (``custom_reward_function.url``, a scoring server
in this test process). Each is the README's local-backend GRPO run for 6 steps (the built-in task is at
0.9 by step 4), judged by the pass mark every learning test shares (tests/trainer/learning.py). The three
runs go two at a time with one torch thread each (as bench/reward_controls.py runs them): a run of the tiny
model gains little from a second thread, and two side by side use both cores.
"""

import json
import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from hflow.reward.score import default_compute_score
from tests.conftest import REPO_ROOT
from tests.trainer.learning import assert_learned, validation_curve
from tests.reward.test_remote_scorer import start_server

pytestmark = pytest.mark.slow  # learning runs (one per reward manager)

STEPS = 6

USER_FILE = '''
from hflow.reward.score import default_compute_score
from hflow.reward.managers import NaiveRewardManager, register


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return default_compute_score(data_source, solution_str, ground_truth, extra_info)


def batch_score(data_sources, solution_strs, ground_truths, extra_infos, **kwargs):
    return [{"score": float(default_compute_score(*args)), "batch": len(data_sources)}
            for args in zip(data_sources, solution_strs, ground_truths, extra_infos)]


@register("learn_test_mine")
class Mine(NaiveRewardManager):
    """A user's manager: naive's scores, and a metric of its own."""

    def __call__(self, data, return_dict=False):
        out = super().__call__(data, return_dict=True)
        out["reward_metrics"]["mine/calls"] = 1.0
        return out if return_dict else out["reward_tensor"]
'''


def _run(tmp_path, *overrides):
    (tmp_path / "user_reward.py").write_text(USER_FILE)
    run = subprocess.run(
        [sys.executable, "-m", "hflow.trainer.main_ppo", "algorithm.adv_estimator=grpo", "trainer.backend=local",
         "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.name=hf", f"trainer.total_training_steps={STEPS}",
         *overrides],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": REPO_ROOT, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    records = [json.loads(line) for line in open(tmp_path / "logs" / "hflow" / "default" / "metrics.jsonl")]
    assert_learned(validation_curve(records))
    return [r for r in records if "reward/errors" in r]  # the training steps


@pytest.fixture(scope="module")
def scoring_server():
    """A scoring server on 127.0.0.1 that scores like the built-in task and answers 503 to every fifth
    request (tests/reward/test_remote_scorer.py)."""
    server = start_server(["flaky"], score=lambda item: float(default_compute_score(
        item["data_source"], item["solution_str"], item["ground_truth"], item["extra_info"])))
    yield server
    server.shutdown()
    server.server_close()


CASES = ["user-registered", "batch", "dapo-remote"]  # the longest first: the three take the time of two


def _run_case(tmp_path, server, case):
    user_file = f"custom_reward_function.path={tmp_path / 'user_reward.py'}"
    overrides = {
        "batch": ["reward_model.reward_manager=batch", user_file, "custom_reward_function.name=batch_score"],
        "dapo-remote": ["reward_model.reward_manager=dapo", f"custom_reward_function.url={server.url}",
                        "custom_reward_function.batch_size=16"],
        "user-registered": ["reward_model.reward_manager=learn_test_mine", user_file],
    }[case]
    return _run(tmp_path, *overrides)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, scoring_server) -> dict[str, Future]:
    """{case: the run's future training steps}, for the cases this session selected, two runs at a time. A
    run that fails raises in its own test only (`Future.result`)."""
    wanted = [case for case in CASES if any(getattr(item, "callspec", None) is not None and item.module is
                                            request.module and item.callspec.params.get("case") == case
                                            for item in request.session.items)]
    with ThreadPoolExecutor(2) as pool:  # leaving the block waits for every run
        return {case: pool.submit(_run_case, tmp_path_factory.mktemp(case), scoring_server, case) for case in wanted}


# The first test's setup runs all three, two at a time: its time limit is two runs' (each stops at 600 s).
@pytest.mark.timeout(2 * 600 + 60)
@pytest.mark.parametrize("case", ["batch", "dapo-remote", "user-registered"])
def test_each_manager_teaches_the_task(runs, scoring_server, case):
    """batch: the user's batch function; dapo (its overlong buffer on by default) scoring through the remote
    scorer, against a server whose every fifth request fails once with a 503 (retried); a manager the user's
    reward file registers. Dapo and the remote scorer share a run to keep the suite short."""
    server = scoring_server
    steps = runs[case].result()
    assert len(steps) == STEPS and all(r["reward/errors"] == 0 for r in steps)
    overlong = ["reward/overlong_penalty_mean" in r and "response/overlong_frac" in r for r in steps]
    assert all(overlong) if case == "dapo-remote" else not any(overlong)  # data.max_response_length 64: len 12
    if case == "dapo-remote":
        assert len(server.bodies) > 2 * STEPS  # several requests per step, and the failed ones again
    if case == "batch":
        assert all(r["reward/batch/mean"] > 1 for r in steps)  # one call with the whole batch
    if case == "user-registered":
        assert all(r["mine/calls"] == 1.0 for r in steps)
