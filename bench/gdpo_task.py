"""GDPO against the plain sum on a two-reward task where the proxy reward pays more (issue 52, item 5).

    .venv/bin/python bench/gdpo_task.py                          # 3 seeds x {gdpo, grpo-sum} x 12 steps, 2 at a time
    .venv/bin/python bench/gdpo_task.py --seeds 1 --steps 6      # a quick look

The task is the built-in arithmetic task with the reward of examples/reward_functions/two_rewards.py:
`correct` in {0, 1} and a planted `format` reward of 10 for an odd last digit, which the built-in model's
habit (the answer one too high) earns on every problem whose right answer is even. Both arms are
`python -m hflow.trainer.main_ppo trainer.backend=local actor_rollout_ref.rollout.name=hf` with the
built-in settings (config/builtin_task.yaml, in the results' options) and seed s for data, workers and sampler:

    gdpo      algorithm.adv_estimator=gdpo algorithm.reward_weights='{correct: 1.0, format: 0.25}'
    grpo-sum  algorithm.adv_estimator=grpo   (trains on score = correct + format)

Greedy validation on the 40 held-out problems scores correctness only. A policy that has learned exactly what
`format` pays for (the right answer where it is odd, the habit where it is even) scores the share of odd right
answers, reported beside the table. Writes bench/results/gdpo_task.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
REWARD = ROOT / "examples" / "reward_functions" / "two_rewards.py"
BUILTIN_SETTINGS = ROOT / "config" / "builtin_task.yaml"
VAL_KEY = "val-core/hflow/arithmetic/reward/mean@1"
ARMS = {
    "gdpo": ["algorithm.adv_estimator=gdpo", "algorithm.reward_weights={correct: 1.0, format: 0.25}"],
    "grpo-sum": ["algorithm.adv_estimator=grpo"],
}
TRAIN_KEYS = ("reward/correct/mean", "reward/format/mean")


def arm_command(arm: str, steps: int, seed: int) -> list[str]:
    """The main_ppo command line of one run (the test tests/trainer/test_gdpo_task.py runs the same)."""
    return [sys.executable, "-m", "hflow.trainer.main_ppo", *ARMS[arm], "trainer.backend=local",
            "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.name=hf", f"trainer.total_training_steps={steps}",
            f"custom_reward_function.path={REWARD}", "custom_reward_function.name=compute_score",
            "custom_reward_function.timeout_s=null", f"data.seed={seed}", f"trainer.seed={seed}",
            f"actor_rollout_ref.rollout.seed={seed}", "trainer.logger=[jsonl]"]


def run_arm(arm: str, steps: int, seed: int, work: Path, threads: int | None = None) -> list[dict]:
    """Run one arm in `work`; its metrics.jsonl records."""
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if threads:  # runs side by side: one torch thread each
        env["OMP_NUM_THREADS"] = str(threads)
    with open(work / "log.txt", "w") as log:
        done = subprocess.run(arm_command(arm, steps, seed), cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise RuntimeError(f"{arm} seed {seed} failed ({done.returncode}); the end of its log:\n"
                           + (work / "log.txt").read_text()[-3000:])
    return [json.loads(line) for line in open(work / "logs" / "hflow" / "default" / "metrics.jsonl")]


def odd_answer_share() -> float:
    """The share of validation problems whose right answer is odd: the accuracy of a policy that does exactly
    what `format` pays for."""
    import pyarrow.parquet as pq

    from hflow.tasks.builtin_task import ensure_builtin_assets

    rows = pq.read_table(ensure_builtin_assets().val_file).to_pylist()
    return sum(int(r["reward_model"]["ground_truth"]) % 2 for r in rows) / len(rows)


def summarise(records: list[dict]) -> dict:
    curve = {r["step"]: r[VAL_KEY] for r in records if VAL_KEY in r}
    last_train = [r for r in records if TRAIN_KEYS[0] in r][-1]
    return {"curve": {str(k): v for k, v in sorted(curve.items())}, "first": curve[min(curve)],
            "last": curve[max(curve)], "max": max(curve.values()),
            **{f"last_train_{k.split('/')[1]}": last_train[k] for k in TRAIN_KEYS}}


def render(result: dict) -> str:
    lines = [
        "# GDPO vs the plain sum on a gameable two-reward task (built-in arithmetic)",
        "",
        f"Made by `{result['command']}` on {result['date']} ({result['machine']}), commit {result['commit']}.",
        f"Options: {json.dumps(result['options'])}.",
        "",
        "Greedy validation accuracy (correctness only) on the 40 held-out problems, every 2 steps. "
        f"A policy that does exactly what `format` pays for scores {result['odd_answer_share']:.3f} "
        "(the share of odd right answers).",
        "",
        "| arm | seed | first | max | last | last step's train correct | last step's train format (0-10) | seconds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arm, runs in result["runs"].items():
        for seed, s in runs.items():
            lines.append(f"| {arm} | {seed} | {s['first']:.3f} | {s['max']:.3f} | {s['last']:.3f} | "
                         f"{s['last_train_correct']:.3f} | {s['last_train_format']:.2f} | {s['seconds']} |")
    lines += ["", "Curves (step: accuracy):", ""]
    for arm, runs in result["runs"].items():
        for seed, s in runs.items():
            lines.append(f"- {arm}, seed {seed}: " + ", ".join(f"{k}: {v:.3f}" for k, v in s["curve"].items()))
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds 1..N")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "gdpo_task"))
    args = parser.parse_args()
    threads = max(1, (os.cpu_count() or 1) // args.jobs) if args.jobs > 1 else None
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    result = {"command": "python bench/gdpo_task.py " + " ".join(sys.argv[1:]), "commit": commit,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "options": {"seeds": args.seeds, "steps": args.steps, "jobs": args.jobs, "arms": ARMS,
                          "torch_threads_per_run": threads or "default",
                          "builtin_settings": OmegaConf.to_container(OmegaConf.load(BUILTIN_SETTINGS))},
              "odd_answer_share": odd_answer_share(), "runs": {arm: {} for arm in ARMS}}

    def one(arm: str, seed: int, tmp: str) -> None:
        started = time.perf_counter()
        summary = summarise(run_arm(arm, args.steps, seed, Path(tmp) / f"{arm}-{seed}", threads))
        result["runs"][arm][str(seed)] = {**summary, "seconds": round(time.perf_counter() - started, 1)}
        print(f"{arm} seed {seed}: last {summary['last']:.3f}, max {summary['max']:.3f}", flush=True)

    with tempfile.TemporaryDirectory(prefix="hflow-gdpo-") as tmp, ThreadPoolExecutor(args.jobs) as pool:
        for run in [pool.submit(one, arm, seed, tmp) for seed in range(1, args.seeds + 1) for arm in ARMS]:
            run.result()
    for arm in ARMS:
        result["runs"][arm] = dict(sorted(result["runs"][arm].items(), key=lambda kv: int(kv[0])))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(render(result))
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
