"""Reward controls over seeds: the built-in task trained by GRPO with the real reward, a seeded coin flip and an
inverted reward, 5 seeds each, the full built-in run (30 steps), greedy validation every 2 steps.

    .venv/bin/python bench/reward_controls.py                      # 3 rewards x 5 seeds x 30 steps (~25 min)
    .venv/bin/python bench/reward_controls.py --jobs 2             # two runs at a time
    .venv/bin/python bench/reward_controls.py --seeds 1 --steps 12 # a quick look

Each run is `python -m hflow.trainer.main_ppo algorithm.adv_estimator=grpo trainer.backend=local
actor_rollout_ref.rollout.name=hf` on the built-in task with the reward functions of tests/trainer/
reward_controls.py (training rows get the control's reward; validation rows always the true score), the
rewards computed in the driver so the coin is reproducible, and seed s given to the data order, the workers,
the sampler and the coin. Writes bench/results/reward_controls.{md,json}.

Every run uses the built-in settings (config/builtin_task.yaml, recorded in the results' options),
among them GRPO's KL anchor to the pre-trained model. The issue's targets (issue 24): real >= 0.95 mean validation after step 10; coin never above 0.3; inverted
never above 0.1. The table says, per reward, which of them this task meets.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
CONTROLS = ROOT / "tests" / "trainer" / "reward_controls.py"
VAL_KEY = "val-core/hflow/arithmetic/reward/mean@1"
REWARDS = ("real", "coin_flip", "inverted")
BUILTIN_SETTINGS = ROOT / "config" / "builtin_task.yaml"  # the recipe every run here uses


def run_one(reward: str, seed: int, steps: int, work: Path, threads: int | None = None) -> dict[int, float]:
    work.mkdir(parents=True)
    cmd = [sys.executable, "-m", "hflow.trainer.main_ppo", "algorithm.adv_estimator=grpo", "trainer.backend=local",
           "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.name=hf", f"trainer.total_training_steps={steps}",
           f"custom_reward_function.path={CONTROLS}", f"custom_reward_function.name={reward}",
           "custom_reward_function.timeout_s=null", f"+custom_reward_function.reward_kwargs.coin_seed={seed}",
           f"data.seed={seed}", f"trainer.seed={seed}", f"actor_rollout_ref.rollout.seed={seed}",
           "trainer.logger=[jsonl]"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if threads:  # several runs at a time: one torch thread each, or their thread pools fight over the cores
        env["OMP_NUM_THREADS"] = str(threads)
    with open(work / "log.txt", "w") as log:
        subprocess.run(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    records = [json.loads(line) for line in open(work / "logs" / "hflow" / "default" / "metrics.jsonl")]
    return {r["step"]: r[VAL_KEY] for r in records if VAL_KEY in r}


def summarise(reward: str, curve: dict[int, float]) -> dict:
    after10 = [v for s, v in curve.items() if s > 10]
    return {"first": curve[min(curve)], "max": max(curve.values()), "last": curve[max(curve)],
            "mean_after_10": statistics.mean(after10) if after10 else None}


def target_met(reward: str, s: dict) -> bool | None:
    if reward == "real":
        return None if s["mean_after_10"] is None else s["mean_after_10"] >= 0.95
    return s["max"] <= (0.3 if reward == "coin_flip" else 0.1)


TARGETS = {"real": "mean after step 10 >= 0.95", "coin_flip": "max <= 0.3", "inverted": "max <= 0.1"}


def render(result: dict) -> str:
    o = result["options"]
    lines = [
        "# Reward controls over seeds (built-in task, GRPO)",
        "",
        f"Made by `{result['command']}` on {result['date']} ({result['machine']}), commit {result['commit']}.",
        f"Options: {json.dumps(o)}. Greedy validation score on the 40 held-out problems, every 2 steps.",
        "",
        "| reward | seed | first | max | last | mean after step 10 | target | met |",
        "|---|---|---|---|---|---|---|---|",
    ]
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    for reward, runs in result["runs"].items():
        for seed, run in runs.items():
            s = run["summary"]
            met = target_met(reward, s)
            lines.append(f"| {reward} | {seed} | {fmt(s['first'])} | {fmt(s['max'])} | {fmt(s['last'])} | "
                         f"{fmt(s['mean_after_10'])} | {TARGETS[reward]} | {'-' if met is None else 'yes' if met else 'NO'} |")
    lines += ["", "Curves (step: score):", ""]
    for reward, runs in result["runs"].items():
        for seed, run in runs.items():
            curve = ", ".join(f"{k}: {v:.2f}" for k, v in sorted((int(k), v) for k, v in run["curve"].items()))
            lines.append(f"- {reward}, seed {seed}: {curve}")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=5, help="seeds 1..N")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rewards", default=",".join(REWARDS))
    parser.add_argument("--out", default=str(RESULTS / "reward_controls"))
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (each is one process)")
    args = parser.parse_args()
    rewards = args.rewards.split(",")
    threads = max(1, (os.cpu_count() or 1) // args.jobs) if args.jobs > 1 else None
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    result = {"command": "python bench/reward_controls.py " + " ".join(sys.argv[1:]), "commit": commit,
              "date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} cores", "options": {"seeds": args.seeds, "steps": args.steps, "rewards": rewards,
              "jobs": args.jobs, "torch_threads_per_run": threads or "default", "builtin_settings": OmegaConf.to_container(OmegaConf.load(BUILTIN_SETTINGS))},
              "runs": {r: {} for r in rewards}}

    def one(reward: str, seed: int, tmp: str) -> None:
        started = time.perf_counter()
        curve = run_one(reward, seed, args.steps, Path(tmp) / f"{reward}-{seed}", threads)
        result["runs"][reward][str(seed)] = {"curve": {str(k): v for k, v in curve.items()},
                                             "summary": summarise(reward, curve),
                                             "seconds": round(time.perf_counter() - started, 1)}
        print(f"{reward} seed {seed}: {result['runs'][reward][str(seed)]['summary']}", flush=True)

    with tempfile.TemporaryDirectory(prefix="hflow-controls-") as tmp, ThreadPoolExecutor(args.jobs) as pool:
        # seeds outermost: the rewards of one seed run close together, under the same machine load
        runs = [pool.submit(one, reward, seed, tmp) for seed in range(1, args.seeds + 1) for reward in rewards]
        for run in runs:
            run.result()
    for reward in rewards:  # the table in seed order, whatever order the runs finished in
        result["runs"][reward] = dict(sorted(result["runs"][reward].items(), key=lambda kv: int(kv[0])))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(render(result))
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
