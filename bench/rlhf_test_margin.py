"""The reward model's score before and after PPO in tests/examples/test_rlhf_pipeline.py's short settings, over
seeds, and a control whose actor cannot move (learning rate 1e-12): the margin that test asserts comes from here.

    python bench/rlhf_test_margin.py [--seeds 1 2 3] [--control-seeds 1]

Each arm is examples/rlhf_pipeline/run.sh OUT SEED with the test's environment (SFT 6 epochs, RM 1 epoch, PPO 4
steps, one process per stage, HF generation), one after another. Writes bench/results/rlhf_test_margin.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.examples.test_rlhf_pipeline import PIPELINE_ENV  # noqa: E402  (the test's settings, written once)

CONTROL_ARGS = "actor_rollout_ref.actor.optim.lr=1e-12"


def run_arm(seed: int, control: bool) -> dict:
    env = {**os.environ, **PIPELINE_ENV}
    if control:
        env["RLHF_PPO_ARGS"] = f"{env['RLHF_PPO_ARGS']} {CONTROL_ARGS}"
    with tempfile.TemporaryDirectory() as out:
        started = time.time()
        run = subprocess.run(["bash", str(ROOT / "examples/rlhf_pipeline/run.sh"), out, str(seed)], env=env,
                             capture_output=True, text=True, timeout=3600)
        if run.returncode != 0:
            sys.exit(run.stdout[-3000:] + run.stderr[-3000:])
        ppo = json.loads((Path(out) / "summary.json").read_text())["ppo"]
    before, after = ppo["before"]["rm_score"], ppo["after"]["rm_score"]
    return {"arm": "control" if control else "ppo", "seed": seed, "rm_score_before": before,
            "rm_score_after": after, "rise": after - before, "seconds": round(time.time() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--control-seeds", type=int, nargs="+", default=[1])
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    load = os.getloadavg()
    command = "python bench/rlhf_test_margin.py " + " ".join(
        ["--seeds", *map(str, args.seeds), "--control-seeds", *map(str, args.control_seeds)])
    rows = []
    arms = [(seed, False) for seed in args.seeds] + [(seed, True) for seed in args.control_seeds]
    for seed, control in arms:  # written after each arm: a stopped run keeps what it measured
        rows.append(run_arm(seed, control))
        write(rows, commit, load, command, done=len(rows) == len(arms))


def write(rows: list[dict], commit: str, load: tuple, command: str, done: bool) -> None:
    results = ROOT / "bench" / "results"
    (results / "rlhf_test_margin.json").write_text(json.dumps({"commit": commit, "rows": rows}, indent=2) + "\n")
    lines = [
        "# RLHF pipeline, the test's short settings: reward-model score before and after PPO",
        "",
        f"Made by `{command}` at commit {commit} on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{os.cpu_count()} cores, load average {load[0]:.1f} at the start (shared with other work: loaded; the "
        "scores do not depend on it). Settings: tests/examples/test_rlhf_pipeline.py's `PIPELINE_ENV` "
        f"({json.dumps(PIPELINE_ENV)}); the control adds `{CONTROL_ARGS}` to the PPO stage.",
        "",
        *([] if done else ["**Incomplete**: the run was stopped before every arm ran.", ""]),
        "| arm | seed | rm_score before | after | rise | seconds |",
        "|---|---|---|---|---|---|",
        *(f"| {r['arm']} | {r['seed']} | {r['rm_score_before']:.4f} | {r['rm_score_after']:.4f} | "
          f"{r['rise']:+.4f} | {r['seconds']:.0f} |" for r in rows),
    ]
    (results / "rlhf_test_margin.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
