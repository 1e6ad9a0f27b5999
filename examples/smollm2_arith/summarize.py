"""Before/after held-out accuracy of several seeds of run_grpo.sh, as one table, one JSON and one plot.

    python examples/smollm2_arith/summarize.py logs/hflow_smollm2_arith/grpo_seed{1,2}/metrics.jsonl \
        --out bench/results/smollm2_arith

Reads each run's metrics.jsonl (the trainer's jsonl logger): held-out greedy accuracy
(`val-core/hflow/arithmetic/reward/mean@1`) at every validation, training score, response length and
step time. Writes OUT.md (table), OUT.json (every number) and OUT.png (learning curves of all runs, via
`hflow.cli.plot`). The noise it reports: the spread of the final accuracy between seeds, and the
binomial standard error sqrt(p(1-p)/n) of one accuracy measured on the n held-out problems.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

VAL_KEY = "val-core/hflow/arithmetic/reward/mean@1"


def read_run(path: Path) -> dict:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    vals = {r["step"]: r[VAL_KEY] for r in rows if VAL_KEY in r}
    if not vals or 0 not in vals:
        raise SystemExit(f"{path}: no validation at step 0 ({VAL_KEY}); run with trainer.val_before_train=true")
    steps = [r for r in rows if "timing_s/step" in r]
    return {
        "metrics": str(path),
        "val_by_step": vals,
        "before": vals[0],
        "after": vals[max(vals)],
        "steps": max(vals),
        "train_score_first_last": [steps[0].get("critic/score/mean"), steps[-1].get("critic/score/mean")],
        "response_length_first_last": [steps[0].get("response_length/mean"), steps[-1].get("response_length/mean")],
        "median_step_s": statistics.median(r["timing_s/step"] for r in steps),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", nargs="+", type=Path, help="metrics.jsonl of each seed")
    parser.add_argument("--out", type=Path, required=True, help="output path without suffix")
    parser.add_argument("--labels", nargs="*", help="one label per run (default: its folder name)")
    parser.add_argument("--problems", type=int, default=200, help="held-out problems per validation")
    parser.add_argument("--wall", nargs="*", default=[], help="wall time of each run, for the table (e.g. 22m28s)")
    args = parser.parse_args(argv)
    labels = args.labels or [p.parent.name for p in args.metrics]
    runs = {label: read_run(path) for label, path in zip(labels, args.metrics, strict=True)}
    for label, wall in zip(labels, args.wall):
        runs[label]["wall"] = wall

    afters = [r["after"] for r in runs.values()]
    befores = [r["before"] for r in runs.values()]
    gains = [r["after"] - r["before"] for r in runs.values()]
    p = statistics.mean(afters)
    summary = {
        "runs": runs,
        "mean_before": statistics.mean(befores),
        "mean_after": p,
        "mean_gain": statistics.mean(gains),
        "min_gain": min(gains),
        "seed_spread_after": max(afters) - min(afters),
        "binomial_se_after": math.sqrt(p * (1 - p) / args.problems),
    }

    lines = ["| run | before | after | gain | steps | accuracy at each validation | median s/step | wall |",
             "|---|---|---|---|---|---|---|---|"]
    for label, r in runs.items():
        curve = ", ".join(f"{s}: {v:.3f}" for s, v in sorted(r["val_by_step"].items()))
        lines.append(f"| {label} | {r['before']:.3f} | {r['after']:.3f} | {r['after'] - r['before']:+.3f} | "
                     f"{r['steps']} | {curve} | {r['median_step_s']:.0f} | {r.get('wall', '-')} |")
    text = "\n".join(lines) + (
        f"\n\nMean {summary['mean_before']:.3f} -> {summary['mean_after']:.3f} (gain {summary['mean_gain']:+.3f}, "
        f"smallest {summary['min_gain']:+.3f}); spread of the final accuracy between seeds "
        f"{summary['seed_spread_after']:.3f}; binomial standard error of one accuracy on {args.problems} problems "
        f"{summary['binomial_se_after']:.3f}.\n")
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=1))

    from hflow.cli.plot import main as plot

    plot([*map(str, args.metrics), "-o", str(args.out.with_suffix(".png")), "--labels", *labels])
    return summary


if __name__ == "__main__":
    main()
