"""The built-in vision task (hflow/tasks/vision_task.py) over seeds: GRPO on pictures of two-digit numbers
against the same run with the training pictures blanked and with an inverted reward (the controls); held-out
greedy accuracy on other pictures of the 90 numbers (never shown in training), every 2 steps (`val-core/hflow/vision_digits/reward/mean@1`).

    .venv/bin/python bench/vision_task.py --seeds 3 --jobs 3     # 3 arms x 3 seeds, three runs at a time

Each run is the README's command, `python -m hflow.trainer.main_ppo algorithm.adv_estimator=grpo
data.builtin_task=vision_digits`, on the local backend with the HF rollout (vLLM's CPU build cannot run
Qwen2-VL), seed s given to the data order, the workers and the sampler. Arms:

    real       data.builtin_task=vision_digits
    blanked    data.builtin_task=vision_digits_blanked: every training picture one flat colour (control)
    inverted   the real pictures, training rows paid for a wrong answer (tests/trainer/vision_reward_controls.py;
               control)

The controls act on training rows only: validation always shows the real pictures and scores the true answer.
Writes `--out`.{md,json} with the command, the commit, each curve, the training score and wall time, again
after every finished run. Targets (issue 36): held-out greedy accuracy from <= 0.2 to >= 0.8; blanked stays
near where it starts (<= 0.2), inverted <= 0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VAL_KEY = "val-core/hflow/vision_digits/reward/mean@1"
CONTROLS = ROOT / "tests" / "trainer" / "vision_reward_controls.py"
TASKS = {"real": "vision_digits", "blanked": "vision_digits_blanked", "inverted": "vision_digits"}
TARGETS = {"real": "start <= 0.2, end >= 0.8", "blanked": "max <= 0.2", "inverted": "max <= 0.1"}


def command(arm: str, seed: int, steps: int) -> list[str]:
    cmd = [sys.executable, "-m", "hflow.trainer.main_ppo", "algorithm.adv_estimator=grpo",
           f"data.builtin_task={TASKS[arm]}", "trainer.backend=local", "trainer.n_gpus_per_node=1",
           f"trainer.total_training_steps={steps}", f"data.seed={seed}", f"trainer.seed={seed}",
           f"actor_rollout_ref.rollout.seed={seed}", "trainer.logger=[jsonl]"]
    if arm == "inverted":
        cmd += [f"custom_reward_function.path={CONTROLS}", "custom_reward_function.name=inverted"]
    return cmd


def run_one(arm: str, seed: int, steps: int, work: Path, threads: int) -> dict:
    work.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": str(threads)}
    started = time.perf_counter()
    with open(work / "log.txt", "w") as log:
        subprocess.run(command(arm, seed, steps), cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    wall_s = time.perf_counter() - started
    records = [json.loads(line) for line in open(work / "logs" / "hflow" / "default" / "metrics.jsonl")]
    curve = {r["step"]: r[VAL_KEY] for r in records if VAL_KEY in r}
    train = [r["critic/score/mean"] for r in records if "critic/score/mean" in r]
    reached = [s for s in sorted(curve) if curve[s] >= 0.8]
    return {"arm": arm, "seed": seed, "curve": curve, "wall_s": round(wall_s, 1), "max": max(curve.values()),
            "first_step_at_0.8": reached[0] if reached else None, "train_score_first": train[0],
            "train_score_last": train[-1]}


def target_met(run: dict) -> bool:
    curve = {int(k): v for k, v in run["curve"].items()}
    if run["arm"] == "real":
        return curve[0] <= 0.2 and curve[max(curve)] >= 0.8
    return run["max"] <= (0.2 if run["arm"] == "blanked" else 0.1)


def render(result: dict) -> str:
    finished = len(result["runs"])
    lines = ["# The built-in vision task: real pictures against blanked pictures and an inverted reward", "",
             f"`{result['command']}` (commit {result['commit']}, load {result['load_1min']:.1f} on 2 cores); GRPO, "
             f"{result['steps']} steps, HF rollout on the local backend, one torch thread a run; held-out greedy "
             "accuracy on 90 held-out pictures (one of each number, never shown in training), every 2 steps "
             f"(`{VAL_KEY}`; the controls act on training rows only). Targets: "
             + "; ".join(f"{arm}: {t}" for arm, t in TARGETS.items()) + ".", "",
             *([f"**{finished} of {result['planned']} runs finished**; the others did not run to their end.", ""]
               if finished < result["planned"] else []),
             "| arm | seed | start | max | first step >= 0.8 | end | target met | training score, first -> last step "
             "| wall s |", "|---|---|---|---|---|---|---|---|---|"]
    for run in result["runs"]:
        curve = {int(k): v for k, v in run["curve"].items()}
        reached = run["first_step_at_0.8"]
        lines.append(f"| {run['arm']} | {run['seed']} | {curve[0]:.3f} | {run['max']:.3f} | "
                     f"{reached if reached is not None else '-'} | {curve[max(curve)]:.3f} | "
                     f"{'yes' if target_met(run) else 'no'} | "
                     f"{run['train_score_first']:.3f} -> {run['train_score_last']:.3f} | {run['wall_s']:.0f} |")
    lines += ["", "Curves (step: held-out greedy accuracy):", ""]
    for run in result["runs"]:
        curve = " ".join(f"{k}:{v:.2f}" for k, v in sorted((int(k), v) for k, v in run["curve"].items()))
        lines.append(f"- {run['arm']} seed {run['seed']}: {curve}")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time")
    parser.add_argument("--arms", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "vision_task")
    args = parser.parse_args()
    from hflow.tasks.vision_task import ensure_vision_assets

    ensure_vision_assets()  # once, before the runs that share it
    args.out.parent.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    result = {"command": "python bench/vision_task.py " + " ".join(sys.argv[1:]), "commit": commit.strip(),
              "steps": args.steps, "planned": args.seeds * len(args.arms), "runs": [],
              "commands": {arm: " ".join(command(arm, 0, args.steps)[1:]) for arm in args.arms}}
    order = {(seed, arm): i for i, (seed, arm) in enumerate((s, a) for s in range(args.seeds) for a in args.arms)}
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(run_one, arm, seed, args.steps, Path(tmp) / f"{arm}-{seed}", args.threads)
                   for seed in range(args.seeds) for arm in args.arms]
        for future in as_completed(futures):
            result["runs"].append(future.result())
            print(json.dumps(result["runs"][-1]), flush=True)
            result["runs"].sort(key=lambda run: order[run["seed"], run["arm"]])
            result["load_1min"] = os.getloadavg()[0]
            args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
            args.out.with_suffix(".md").write_text(render(result))
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
