"""End to end: `run_ppo` with 2 ranks, the real vLLM engine and FSDP2 on CPU, on the built-in model and task.

The built-in model answers right about a fifth of the time when it samples, so the samples of one prompt
earn different rewards: advantages are non-zero and every update really moves the weights. That is what
lets these tests fail for the right reasons: a resumed run that lost its optimizer state, or a shortcut
that changed the gradient, shows up in the following steps' losses and in the saved Adam moments.
"""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

from hflow import CONFIG_DIR
from hflow.trainer.main_ppo import run_ppo
from hflow.reward.score import arithmetic
from hflow.tasks.builtin_task import ensure_builtin_assets

REPO = Path(__file__).resolve().parents[2]
STEPS = 4  # the uninterrupted run; a resumed run starts from step 1 or 3 and continues to 4
EPOCH_STEPS = 3  # 24 training problems at 8 per step


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The built-in model, 24 training problems (3 steps per epoch at 8 per step) and 8 validation ones."""
    builtin = ensure_builtin_assets()
    root = tmp_path_factory.mktemp("e2e")
    train = pq.read_table(builtin.train_file)
    # every fifth problem: additions and subtractions alike (the file lists all additions first)
    pq.write_table(train.take(list(range(0, train.num_rows, 5))[:24]), root / "train.parquet")
    pq.write_table(pq.read_table(builtin.val_file).slice(0, 8), root / "val.parquet")
    (root / "model").symlink_to(builtin.model_path)
    return root


def overrides(assets: Path, run_dir: Path, *extra: str) -> list[str]:
    base = [
        f"actor_rollout_ref.model.path={assets / 'model'}",
        f"data.train_files={assets / 'train.parquet'}",
        f"data.val_files={assets / 'val.parquet'}",
        "data.train_batch_size=8",
        "data.max_prompt_length=32",
        "data.max_response_length=8",
        "actor_rollout_ref.rollout.n=4",  # 4 samples per prompt: most groups hold a right and a wrong answer
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",  # one mini-batch per step: its ppo_kl is the metric
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "critic.optim.lr=1e-3",
        "actor_rollout_ref.rollout.kv_cache_memory_bytes=33554432",
        "trainer.n_gpus_per_node=2",
        "trainer.logger=[console,jsonl]",
        f"trainer.log_dir={run_dir / 'logs'}",
        f"trainer.default_local_dir={run_dir / 'ckpt'}",
        "trainer.val_before_train=false",
        # the separate old-log-prob pass every step, whose checks these tests read (on-policy runs skip it by default)
        "algorithm.reuse_update_log_probs=false",
    ]
    given = {o.split("=", 1)[0] for o in extra}  # a key given here replaces the default above
    return [o for o in base if o.split("=", 1)[0] not in given] + list(extra)


# The GRPO settings every GRPO run here shares, so that their first steps sample the same responses.
GRPO = ("algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=true")


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
    # The old-log-prob pass and the update's forward agree, so the first (only) mini-batch is on-policy.
    assert abs(step["actor/ppo_kl"]) < 1e-6 and step["actor/pg_clipfrac"] == 0
    assert step["training/rollout_probs_diff_max"] < 1e-3  # and so does the sampler
    # Rewards vary within groups, so the update is not a no-op.
    assert step["critic/advantages/max"] > 0 > step["critic/advantages/min"], step
    assert step["actor/grad_norm"] > 1e-3, step


def _training_steps(metrics: list[dict]) -> list[dict]:
    return [m for m in metrics if "actor/pg_loss" in m]


@pytest.fixture(scope="module")
def uninterrupted(ray_session, assets, tmp_path_factory):
    """A 4-step GRPO run that saves steps 3 (the end of the first epoch, which a resumed test starts from)
    and 4, with a Hugging Face export of the policy."""
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    metrics = run(assets, run_dir, *GRPO, f"trainer.total_training_steps={STEPS}", "trainer.test_freq=2",
                  f"trainer.save_freq={EPOCH_STEPS}", f"trainer.rollout_data_dir={run_dir / 'rollouts'}",
                  "actor_rollout_ref.actor.checkpoint.contents=[model,optimizer,extra,hf_model]")
    return run_dir, metrics


def test_grpo_end_to_end_updates_the_policy(assets, uninterrupted):
    run_dir, metrics = uninterrupted
    steps = _training_steps(metrics)
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    for step in steps:
        check_step_metrics(step, ["actor/kl_loss"])
    # Each step's score is the task's own verdict on what was sampled: rescored here from the step's dumped
    # responses against the training file's answers, with none of the trainer's reward plumbing.
    answers = {row["prompt"][0]["content"]: row["reward_model"]["ground_truth"]
               for row in pq.read_table(assets / "train.parquet").to_pylist()}
    rescored = []
    for step in steps:
        rows = [json.loads(line) for line in (run_dir / "rollouts" / f"{step['step']}.jsonl").read_text().splitlines()]
        assert len(rows) == 8 * 4
        questions = [max((q for q in answers if q in row["input"]), key=len) for row in rows]
        right = [arithmetic.compute_score(row["output"], answers[q]) for row, q in zip(rows, questions)]
        assert [row["score"] for row in rows] == right, step["step"]  # each sample's own, in its place
        assert step["critic/score/mean"] == pytest.approx(sum(right) / len(right), abs=1e-6), step["step"]
        rescored += right
        # this CPU's update against its own measured fp32 matmul peak (hflow/utils/flops_counter.py)
        assert 0 < step["perf/mfu/actor"] <= 1, step["perf/mfu/actor"]
    assert 0 < sum(rescored) < len(rescored)  # the setup: right and wrong answers both occur, so the check bites
    assert any(k.startswith("val-core/hflow/arithmetic/") for k in metrics[-1])
    assert (run_dir / "logs" / "learning_curve.png").stat().st_size > 10_000
    # the trained policy differs from the model it started from
    initial = load_file(str(assets / "model" / "model.safetensors"))
    trained = load_file(str(run_dir / "ckpt" / f"global_step_{STEPS}" / "actor" / "huggingface" / "model.safetensors"))
    assert initial.keys() == trained.keys()
    changed = [name for name in initial if (initial[name] - trained[name]).abs().max() > 1e-4]
    assert len(changed) > len(initial) // 2, changed


@pytest.mark.slow  # a second training run (GAE)
def test_ppo_with_a_critic_end_to_end(ray_session, assets, tmp_path):
    metrics = run(assets, tmp_path, "algorithm.adv_estimator=gae", "trainer.total_training_steps=2",
                  "trainer.test_freq=2")
    steps = _training_steps(metrics)
    assert [m["step"] for m in steps] == [1, 2]
    for step in steps:
        check_step_metrics(step, ["critic/vf_loss", "critic/values/mean", "critic/vf_explained_var",
                                  "timing_s/values", "critic/grad_norm"])
        assert step["critic/vf_loss"] > 0 and step["critic/grad_norm"] > 1e-3
    # the critic learned from step 1: its values for step 2's batch are no longer those of a fresh head
    assert steps[1]["critic/values/mean"] != pytest.approx(steps[0]["critic/values/mean"], abs=1e-4)
    assert any(k.startswith("val-core/hflow/arithmetic/") for k in metrics[-1])


FIRST_STEP_KEYS = ["actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "critic/score/mean",
                   "critic/advantages/max"]


def _same_first_step(got: dict, want: dict, rel: float) -> None:
    for key in FIRST_STEP_KEYS:
        assert got[key] == pytest.approx(want[key], rel=rel, abs=1e-6), key


@pytest.mark.slow  # a second training run
def test_sampler_log_probs_can_stand_in_for_the_old_log_probs(ray_session, assets, tmp_path, uninterrupted):
    metrics = run(assets, tmp_path, *GRPO, "trainer.total_training_steps=1", "algorithm.use_rollout_log_probs=true")
    step = metrics[0]
    assert "timing_s/old_log_prob" not in step  # the forward pass was skipped
    assert abs(step["actor/ppo_kl"]) < 1e-5 and step["actor/pg_clipfrac"] == 0  # and the update stayed on-policy
    # the same update as with a separate pass, to fp32 rounding of the sampler's log-probs
    _same_first_step(step, _training_steps(uninterrupted[1])[0], rel=1e-4)


@pytest.mark.slow  # a second training run
def test_on_policy_update_can_reuse_its_own_log_probs(ray_session, assets, tmp_path, uninterrupted):
    # null = reuse wherever exact: this on-policy run (one epoch, one mini-batch) does; the separate pass
    # runs at step 1 and every rollout_check_freq steps for its checks
    metrics = run(assets, tmp_path, *GRPO, "trainer.total_training_steps=3", "algorithm.reuse_update_log_probs=null",
                  "algorithm.rollout_check_freq=2", "trainer.test_freq=-1")
    steps = _training_steps(metrics)
    assert ["timing_s/old_log_prob" in s for s in steps] == [True, False, True]  # steps 1 and 3 check
    assert ["training/rollout_probs_diff_max" in s for s in steps] == [True, False, True]
    assert all(math.isfinite(s["actor/entropy"]) and s["actor/entropy"] > 0 for s in steps)  # the update reports it
    # step 2's loss, its gradient and the KL term are those of a run with a separate old-log-prob pass
    assert abs(steps[1]["actor/ppo_kl"]) < 1e-6 and steps[1]["actor/pg_clipfrac"] == 0
    # (the uninterrupted run samples the same two steps: it validates only after step 2)
    separate = _training_steps(uninterrupted[1])
    _same_first_step(steps[0], separate[0], rel=1e-5)
    _same_first_step(steps[1], separate[1], rel=1e-5)


@pytest.mark.slow  # a second training run
def test_custom_reward_function_from_a_file(assets, tmp_path):
    """The reward's way from the user's file to the step's metrics does not depend on the backend: one rank in
    this process (local backend, HF generation), which starts in a fraction of the time two Ray workers take."""
    reward_file = tmp_path / "my_reward.py"
    reward_file.write_text(
        "def length_reward(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):\n"
        "    return {'score': 0.25 + bonus, 'chars': len(solution_str)}\n")
    metrics = run(assets, tmp_path, "algorithm.adv_estimator=grpo", "trainer.total_training_steps=1",
                  "trainer.backend=local", "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.name=hf",
                  f"custom_reward_function.path={reward_file}", "custom_reward_function.name=length_reward",
                  "+custom_reward_function.reward_kwargs.bonus=0.5")
    step = metrics[0]
    assert step["critic/score/mean"] == pytest.approx(0.75)
    assert step["reward/chars/mean"] > 0


def _comparable(step: dict) -> dict:
    skip = ("timing", "perf/", "time")
    return {k: v for k, v in step.items() if not any(s in k for s in skip)}


def _actor_optimizer_state(checkpoint: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """The actor's AdamW state in a checkpoint (DCP shards merged on the driver): {"<param>.<moment>": tensor}."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    merged = tmp_path / f"{checkpoint.parent.parent.name}-{checkpoint.name}.pt"
    dcp_to_torch_save(str(checkpoint / "actor" / "model_optim"), str(merged))
    state = torch.load(merged, weights_only=True)["optimizer"]["state"]
    return {f"{param}.{key}": torch.as_tensor(value) for param, moments in state.items()
            for key, value in moments.items()}


# Stopped mid-epoch (after step 1 of the epoch's 3): the loader resumes inside the epoch and rolls over into
# the next one after the restart; a run of its own, stopped there by total_training_steps and found again by
# resume_mode=auto through the `latest` marker. Stopped at an epoch's end (after step 3): the restart must
# begin the next epoch, with its own shuffle, not replay the finished one or skip a batch of the next; it
# starts (resume_mode=resume_path) from the uninterrupted run's own step-3 checkpoint, which saves a run.
@pytest.mark.slow  # training runs, stopped and resumed
@pytest.mark.parametrize("stop_after", [1, EPOCH_STEPS], ids=["mid-epoch", "end-of-epoch"])
def test_resumed_run_continues_exactly_like_an_uninterrupted_one(ray_session, assets, tmp_path, uninterrupted,
                                                                 stop_after):
    if stop_after == EPOCH_STEPS:
        first, resume = [], ["trainer.resume_mode=resume_path",
                             f"trainer.resume_from_path={uninterrupted[0] / 'ckpt' / f'global_step_{stop_after}'}"]
    else:
        first = run(assets, tmp_path, *GRPO, f"trainer.total_training_steps={stop_after}",
                    f"trainer.save_freq={stop_after}")
        assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == str(stop_after)
        resume = ["trainer.resume_mode=auto"]
    resumed = run(assets, tmp_path, *GRPO, f"trainer.total_training_steps={STEPS}", "trainer.test_freq=2",
                  *resume, "trainer.save_freq=1", "trainer.max_actor_ckpt_to_keep=2")
    kept = sorted(p.name for p in (tmp_path / "ckpt").glob("global_step_*"))
    # older checkpoints pruned (the run from another's checkpoint saved only step 4 here)
    assert kept == (["global_step_3", "global_step_4"] if first else ["global_step_4"]), kept

    # The restarted process logged only the steps after the checkpoint. The runs are deterministic, so a
    # restart that ignored the checkpoint and trained from step 1 would log the same values for the later
    # steps: the step numbers of the second process's own records are what tell them apart.
    after = resumed[len(first):]
    assert [m["step"] for m in after] == list(range(stop_after + 1, STEPS + 1)), [m["step"] for m in after]

    # The steps after the restart: same data, samples, losses, gradients, KL and validation scores.
    uninterrupted_dir, uninterrupted_metrics = uninterrupted
    expected = {m["step"]: m for m in uninterrupted_metrics}
    for step in after:
        want = _comparable(expected[step["step"]])
        got = _comparable(step)
        assert got.keys() == want.keys()
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (step["step"], key)

    # The optimizer carried on from its saved state: Adam's moments (and step count) at the end are the
    # uninterrupted run's. Restarted moments would differ by far more than rounding.
    want = _actor_optimizer_state(uninterrupted_dir / "ckpt" / f"global_step_{STEPS}", tmp_path)
    got = _actor_optimizer_state(tmp_path / "ckpt" / f"global_step_{STEPS}", tmp_path)
    assert got.keys() == want.keys() and any(k.endswith("exp_avg_sq") for k in want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-9, msg=key)


def _start(assets: Path, run_dir: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "hflow.trainer.main_ppo", "algorithm.adv_estimator=grpo",
           "trainer.total_training_steps=500", *overrides(assets, run_dir)]
    # Ctrl-C's default action, as under a terminal: a test run started in the background of a non-interactive
    # shell (`bash -c '... &'`) inherits an ignored SIGINT, and an ignored signal stays ignored across exec.
    return subprocess.Popen(cmd, cwd=run_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


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


@pytest.mark.slow  # a training run in a subprocess
@pytest.mark.alone  # timed: the first step within its deadline, every process gone within 60 s of the signal
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
    # hflow's own words (WorkerGroupError, raised in RayWorkerGroup._get_one), not Ray's
    assert re.search(r"worker \S+ \(rank [01]\) died during \w+\(\)", output), output[-3000:]
    _assert_all_gone(descendants)


@pytest.mark.slow  # a training run in a subprocess
@pytest.mark.alone  # timed: the first step within its deadline, every process gone within 60 s of the signal
def test_ctrl_c_stops_every_worker(assets, tmp_path):
    proc = _start(assets, tmp_path)
    try:
        descendants = _wait_for_first_step(proc, tmp_path)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        try:
            output, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            raise AssertionError("the run did not stop within 60 s of Ctrl-C; its last output:\n" + output[-6000:])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, output[-3000:]
    _assert_all_gone(descendants)
