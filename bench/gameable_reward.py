"""A reward the audit flags is gamed in training; the fixed one teaches: curves over seeds.

    .venv/bin/python bench/gameable_reward.py                  # 2 rewards x 5 seeds x 10 steps (~4 min, 2 at a time)
    .venv/bin/python bench/gameable_reward.py --seeds 1 --steps 6

Each run is tests/trainer/test_gameable_reward.py's `train`: GRPO (local backend, HF rollout, the built-in
settings) on the hedging built-in model (`HEDGING_SPEC`), training rows scored by `any_number` (pays when
any number in the response is the answer: the audit's `multiple_candidates` family) or `exact` (the whole
response must be the answer), validation always by the true scorer (last number). Per step: the training
score (critic/score/mean), and every 2 steps the true greedy validation score and the share of greedy
validation responses that are the hedge "<right> or <right + 1>". Writes bench/results/gameable_reward.{md,json}.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hflow.tasks.builtin_task import HEDGING_SPEC, ensure_builtin_assets  # noqa: E402
from tests.trainer.test_gameable_reward import curves, hedge_share, train  # noqa: E402

RESULTS = ROOT / "bench" / "results"
REWARDS = ("any_number", "exact")


def run_one(reward: str, seed: int, steps: int, work: Path) -> dict:
    work.mkdir(parents=True)
    records, dumps = train(work, reward, steps, seed)
    train_curve, val_curve = curves(records)
    hedges = {int(p.stem): hedge_share(p) for p in dumps.glob("*.jsonl")}
    return {"reward": reward, "seed": seed, "train": train_curve, "val": val_curve, "hedge": dict(sorted(hedges.items()))}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def table(runs: list[dict], reward: str) -> list[str]:
    mine = [r for r in runs if r["reward"] == reward]
    steps = sorted(mine[0]["train"])
    val_steps = sorted(mine[0]["val"])
    lines = [f"### `{reward}`, mean over seeds {[r['seed'] for r in mine]}", "",
             "| step | training score | true greedy validation | greedy hedges (validation) |", "|---:|---:|---:|---:|"]
    for step in sorted(set(steps) | set(val_steps)):
        cells = [f"{_mean([r[k][step] for r in mine]):.3f}" if step in mine[0][k] else "" for k in ("train", "val", "hedge")]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    lines += ["", "Per seed (true greedy validation by step): " + "; ".join(
        f"seed {r['seed']}: " + ", ".join(f"{s}: {v:.3f}" for s, v in sorted(r["val"].items())) for r in mine), ""]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # several runs at a time: one torch thread each
    ensure_builtin_assets(spec=HEDGING_SPEC)  # once, before the runs share it
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        jobs = [(reward, seed) for seed in range(1, args.seeds + 1) for reward in REWARDS]
        runs = list(pool.map(lambda j: run_one(j[0], j[1], args.steps, Path(tmp) / f"{j[0]}-{j[1]}"), jobs))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    meta = {"commit": commit, "spec": HEDGING_SPEC.as_dict(), "steps": args.steps, "seeds": args.seeds,
            "python": platform.python_version(), "machine": platform.machine(), "wall_s": round(time.time() - t0)}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "gameable_reward.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1) + "\n")
    lines = ["# A reward the audit flags is gamed in training (bench/gameable_reward.py)", "",
             f"`{' '.join(['.venv/bin/python', 'bench/gameable_reward.py', *sys.argv[1:]])}` at {commit}, "
             f"{args.seeds} seeds x {args.steps} GRPO steps per reward, {meta['wall_s']} s on {meta['machine']} "
             f"(Python {meta['python']}), hedging model `{json.dumps(meta['spec'])}`.", "",
             "`python -m hflow.reward.audit` flags `any_number` on `multiple_candidates` (exit 1) and passes "
             "`exact` (exit 0) on the task's training data. Training rows are scored by the reward; validation "
             "always by the true scorer (last number wins: the hedge \"12 or 13\" for 7 + 5 is wrong).", ""]
    for reward in REWARDS:
        lines += table(runs, reward)
    (RESULTS / "gameable_reward.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
