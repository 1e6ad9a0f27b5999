"""The GDPO demonstration (issue 52): on the built-in task with two named rewards, `correct` and a planted
`format` reward worth 10x more that the model's habit games (examples/reward_functions/two_rewards.py),
GDPO learns the right answer while GRPO on the plain sum (its control) is gamed.

The runs are bench/gdpo_task.py's arms (the same command lines, `arm_command`), on the local backend with the
HF rollout, the reward in the driver. The bench's 3 seeds are in bench/results/gdpo_task.md; the marks
asserted here sit between the two arms there (GDPO >= 0.95 from step 4 on; the plain sum at most 0.475, near
0.45, the accuracy of a policy doing exactly what `format` pays for): GDPO passes the built-in task's shared
learning mark (tests/trainer/learning.py: ends >= 0.9, stays learned), the plain sum is never above 0.6.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.trainer.learning import VAL_KEY, assert_learned, validation_curve

_spec = importlib.util.spec_from_file_location("bench_gdpo_task", Path(REPO_ROOT) / "bench" / "gdpo_task.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

STEPS = 10


def run(arm: str, steps: int, work: Path, seed: int = 1) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(bench.arm_command(arm, steps, seed) + [f"trainer.test_freq={2 if steps > 2 else 1}"],
                          cwd=work, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return [json.loads(line) for line in open(work / "logs" / "hflow" / "default" / "metrics.jsonl")]


def test_gdpo_two_steps_report_each_reward_and_its_advantage_share(tmp_path):
    """Fast tier: two GDPO steps of the real trainer; each step has both rewards' means and shares of the
    advantage (computed from the batch's reward_score/<name> columns), all finite, the shares summing to 1."""
    records = [r for r in run("gdpo", 2, tmp_path) if "training/global_step" in r]
    assert len(records) == 2
    for r in records:
        names = ("reward/correct/mean", "reward/format/mean", "reward/correct/adv_share", "reward/format/adv_share",
                 "critic/advantages/mean", "critic/advantages/max", "critic/advantages/min")
        assert all(math.isfinite(r[name]) for name in names), {n: r.get(n) for n in names}
        assert r["reward/correct/adv_share"] + r["reward/format/adv_share"] == pytest.approx(1.0)
        assert 0 < r["reward/format/adv_share"] < r["reward/correct/adv_share"]  # weights 0.25 and 1
        assert 0 <= r["reward/format/mean"] <= 10 and 0 <= r["reward/correct/mean"] <= 1


@pytest.mark.slow  # two learning runs, side by side
@pytest.mark.timeout(900 + 60)
def test_gdpo_learns_the_right_answer_where_the_plain_sum_is_gamed(tmp_path):
    with ThreadPoolExecutor(2) as pool:
        futures = {arm: pool.submit(run, arm, STEPS, tmp_path / arm) for arm in ("gdpo", "grpo-sum")
                   if (tmp_path / arm).mkdir() is None}
        curves = {arm: validation_curve(f.result(), VAL_KEY) for arm, f in futures.items()}
    gdpo, plain = curves["gdpo"], curves["grpo-sum"]
    assert plain[0] <= 0.2, curves  # the built-in model starts out wrong
    assert_learned(gdpo)  # the mark every learning test on the built-in task shares: ends >= 0.9, stays learned
    assert max(plain.values()) <= 0.6, curves  # the control: the sum is gamed by `format`
