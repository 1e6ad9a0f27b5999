"""End to end: `run_ppo` with 2 ranks, the real vLLM engine and FSDP2 on CPU, on a tiny random model.

The model is untrained, so these tests check the machinery (metrics present and finite, exact log-prob
agreement, custom rewards, exact resumption, failure handling), not learning; learning is checked by
the built-in default run.
"""

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import psutil
import pytest
from hydra import compose, initialize_config_dir

from hflow.trainer.main_ppo import CONFIG_DIR, run_ppo
from hflow.utils.tiny_models import build_causal_lm

REPO = Path(__file__).resolve().parents[2]


def write_arithmetic(path: Path, n: int, seed: int) -> None:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        rows.append({"data_source": "hflow/arithmetic", "prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
                     "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                     "extra_info": {"index": i}})
    pd.DataFrame(rows).to_parquet(path)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    build_causal_lm(root / "model", preset="tiny")
    write_arithmetic(root / "train.parquet", 24, seed=0)  # 3 steps per epoch at 8 prompts per step
    write_arithmetic(root / "val.parquet", 8, seed=1)
    return root


def overrides(assets: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        f"actor_rollout_ref.model.path={assets / 'model'}",
        f"data.train_files={assets / 'train.parquet'}",
        f"data.val_files={assets / 'val.parquet'}",
        "data.train_batch_size=8",
        "data.max_prompt_length=32",
        "data.max_response_length=12",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",  # one mini-batch per step: its ppo_kl is the metric
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "critic.optim.lr=1e-3",
        "actor_rollout_ref.rollout.kv_cache_memory_bytes=33554432",
        "trainer.n_gpus_per_node=2",
        "trainer.logger=[console,jsonl]",
        f"trainer.log_dir={run_dir / 'logs'}",
        f"trainer.default_local_dir={run_dir / 'ckpt'}",
        "trainer.val_before_train=false",
        *extra,
    ]


def run(assets: Path, run_dir: Path, *extra: str) -> list[dict]:
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        config = compose(config_name="ppo_trainer", overrides=overrides(assets, run_dir, *extra))
    run_ppo(config)
    with open(run_dir / "logs" / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


CORE_METRICS = ["actor/pg_loss", "actor/ppo_kl", "actor/pg_clipfrac", "actor/entropy", "actor/grad_norm",
                "critic/score/mean", "critic/rewards/mean", "critic/advantages/mean", "response_length/mean",
                "perf/throughput", "perf/time_per_step", "timing_s/gen", "timing_s/old_log_prob",
                "timing_s/update_actor", "training/rollout_probs_diff_mean", "training/rollout_probs_diff_max"]


def check_step_metrics(step: dict, extra_keys=()) -> None:
    for key in [*CORE_METRICS, *extra_keys]:
        assert key in step, key
        assert step[key] is not None and math.isfinite(step[key]), (key, step[key])
    assert abs(step["actor/ppo_kl"]) < 1e-6  # the first (only) mini-batch is on-policy
    assert step["actor/pg_clipfrac"] == 0
    assert step["training/rollout_probs_diff_max"] < 1e-3


@pytest.mark.parametrize("estimator,extra_keys", [
    ("grpo", ["actor/kl_loss"]),
    ("gae", ["critic/vf_loss", "critic/values/mean", "critic/vf_explained_var", "timing_s/values"]),
])
def test_end_to_end_runs_and_reports_metrics(ray_session, assets, tmp_path, estimator, extra_keys):
    extra = ["actor_rollout_ref.actor.use_kl_loss=true"] if estimator == "grpo" else []
    metrics = run(assets, tmp_path, f"algorithm.adv_estimator={estimator}", "trainer.total_training_steps=2",
                  "trainer.test_freq=2", *extra)
    steps = [m for m in metrics if "actor/pg_loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for step in steps:
        check_step_metrics(step, extra_keys)
    assert any(k.startswith("val-core/hflow/arithmetic/") for k in metrics[-1])
    assert (tmp_path / "logs" / "learning_curve.png").stat().st_size > 10_000


def test_sampler_log_probs_can_stand_in_for_the_old_log_probs(ray_session, assets, tmp_path):
    metrics = run(assets, tmp_path, "algorithm.adv_estimator=grpo", "trainer.total_training_steps=1",
                  "algorithm.use_rollout_log_probs=true")
    step = metrics[0]
    assert "timing_s/old_log_prob" not in step  # the forward pass was skipped
    assert abs(step["actor/ppo_kl"]) < 1e-5 and step["actor/pg_clipfrac"] == 0  # and the update stayed on-policy


def test_on_policy_update_can_reuse_its_own_log_probs(ray_session, assets, tmp_path):
    metrics = run(assets, tmp_path, "algorithm.adv_estimator=grpo", "trainer.total_training_steps=1",
                  "algorithm.reuse_update_log_probs=true", "actor_rollout_ref.actor.use_kl_loss=true")
    step = metrics[0]
    assert "timing_s/old_log_prob" not in step  # no forward pass of its own
    assert step["actor/ppo_kl"] == 0 and step["actor/pg_clipfrac"] == 0  # ratio exactly 1
    assert math.isfinite(step["actor/grad_norm"]) and math.isfinite(step["actor/pg_loss"])
    assert "training/rollout_probs_diff_max" not in step  # the parity check needs the separate pass


def test_custom_reward_function_from_a_file(ray_session, assets, tmp_path):
    reward_file = tmp_path / "my_reward.py"
    reward_file.write_text(
        "def length_reward(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):\n"
        "    return {'score': 0.25 + bonus, 'chars': len(solution_str)}\n")
    metrics = run(assets, tmp_path, "algorithm.adv_estimator=grpo", "trainer.total_training_steps=1",
                  f"custom_reward_function.path={reward_file}", "custom_reward_function.name=length_reward",
                  "+custom_reward_function.reward_kwargs.bonus=0.5")
    step = metrics[0]
    assert step["critic/score/mean"] == pytest.approx(0.75)
    assert step["reward/chars/mean"] > 0


def _comparable(step: dict) -> dict:
    skip = ("timing", "perf/", "time")
    return {k: v for k, v in step.items() if not any(s in k for s in skip)}


@pytest.fixture(scope="module")
def uninterrupted(ray_session, assets, tmp_path_factory):
    return run(assets, tmp_path_factory.mktemp("uninterrupted"), "algorithm.adv_estimator=grpo",
               "trainer.total_training_steps=4")


@pytest.mark.parametrize("stop_after", [1, 3], ids=["mid-epoch", "end-of-epoch"])
def test_resumed_run_continues_exactly_like_an_uninterrupted_one(ray_session, assets, tmp_path, uninterrupted,
                                                                 stop_after):
    run(assets, tmp_path, "algorithm.adv_estimator=grpo", f"trainer.total_training_steps={stop_after}",
        f"trainer.save_freq={stop_after}")
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == str(stop_after)
    resumed = run(assets, tmp_path, "algorithm.adv_estimator=grpo", "trainer.total_training_steps=4",
                  "trainer.resume_mode=auto", "trainer.save_freq=1", "trainer.max_actor_ckpt_to_keep=2")
    kept = sorted(p.name for p in (tmp_path / "ckpt").glob("global_step_*"))
    assert kept == ["global_step_3", "global_step_4"]  # older checkpoints pruned
    after = [m for m in resumed if m["step"] > stop_after]
    assert [m["step"] for m in after] == list(range(stop_after + 1, 5))
    expected = {m["step"]: m for m in uninterrupted}
    for step in after:
        want = _comparable(expected[step["step"]])
        got = _comparable(step)
        assert got.keys() == want.keys()
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (step["step"], key)


def _start(assets: Path, run_dir: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "hflow.trainer.main_ppo", "algorithm.adv_estimator=grpo",
           "trainer.total_training_steps=500", *overrides(assets, run_dir)]
    return subprocess.Popen(cmd, cwd=run_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _wait_for_first_step(proc: subprocess.Popen, run_dir: Path, timeout_s: float = 180) -> list[psutil.Process]:
    metrics = run_dir / "logs" / "metrics.jsonl"
    deadline = time.monotonic() + timeout_s
    while not (metrics.exists() and metrics.read_text().strip()):
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "no training step within the time limit"
        time.sleep(0.5)
    return psutil.Process(proc.pid).children(recursive=True)


def _assert_all_gone(processes: list[psutil.Process], timeout_s: float = 30) -> None:
    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    assert not alive, [(p.pid, p.name()) for p in alive]


def test_killing_a_worker_ends_the_run_naming_it_and_leaves_no_orphans(assets, tmp_path):
    proc = _start(assets, tmp_path)
    try:
        descendants = _wait_for_first_step(proc, tmp_path)
        workers = [p for p in descendants if "WorkerDict" in " ".join(p.cmdline())]
        assert len(workers) == 2, [p.cmdline() for p in descendants]
        killed_at = time.monotonic()
        workers[1].kill()
        output, _ = proc.communicate(timeout=60)
        assert time.monotonic() - killed_at < 60
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert "WorkerDict" in output and "died" in output, output[-3000:]
    _assert_all_gone(descendants)


def test_ctrl_c_stops_every_worker(assets, tmp_path):
    proc = _start(assets, tmp_path)
    try:
        descendants = _wait_for_first_step(proc, tmp_path)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, output[-3000:]
    _assert_all_gone(descendants)
