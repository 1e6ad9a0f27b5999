"""CISPO and SAPO (issue 52) through the real trainer: two steps of the built-in task each, on the local
backend with the HF rollout. Two PPO epochs per batch, so the second epoch's ratios leave 1 and the losses'
clip and gate are exercised on real log-probs. Their numbers are checked against hand computations in
tests/algorithms/test_objectives.py; here: the mode is the one that ran, and its metrics are finite."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT


@pytest.mark.parametrize("mode", ["cispo", "sapo"])
def test_the_trainer_runs_two_steps_with_the_loss_mode(tmp_path, mode):
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "hflow.trainer.main_ppo", "algorithm.adv_estimator=grpo", "trainer.backend=local",
           "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.name=hf", "trainer.total_training_steps=2",
           f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}", "actor_rollout_ref.actor.ppo_epochs=2",
           "actor_rollout_ref.actor.policy_loss.cispo_clip_ratio_high=0.001", "trainer.logger=[jsonl]"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    records = [json.loads(line) for line in open(tmp_path / "logs" / "hflow" / "default" / "metrics.jsonl")]
    steps = [r for r in records if "actor/pg_loss" in r]
    assert len(steps) == 2
    for r in steps:
        assert all(math.isfinite(r[k]) for k in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm"))
    if mode == "cispo":  # a tiny upper bound: the second epoch's weights above 1.001 are clipped
        assert max(r["actor/pg_clipfrac"] for r in steps) > 0
    else:  # the soft gate clips nothing
        assert all(r["actor/pg_clipfrac"] == 0 for r in steps)
