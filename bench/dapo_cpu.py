"""DAPO's recipe on the built-in task, measured: runs `examples/dapo/run_dapo_cpu.sh` as shipped (plus a
log folder of its own) and writes what examples/dapo/README.md quotes to bench/results/dapo_cpu.{md,json}:
the greedy validation score at each validation, and per step the generation batches drawn
(`train/num_gen_batches`), the share of prompt groups dropped (`train/filtered_groups_frac`) and the share
of responses the overlong buffer penalised (`response/overlong_frac`), with the wall time, the commit, the
date and the machine's 1-minute load average before and after.

    .venv/bin/python bench/dapo_cpu.py [extra key=value overrides for the example]
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
SCRIPT = "examples/dapo/run_dapo_cpu.sh"
VAL_KEY = "val-core/hflow/arithmetic/reward/mean@1"
STEP_KEYS = ("train/num_gen_batches", "train/filtered_groups_frac", "response/overlong_frac")


def load_1min() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def git_commit() -> str:
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = git("status", "--porcelain", "--", "hflow", "examples/dapo", "config")
    return git("rev-parse", "--short", "HEAD") + ("+changes" if dirty else "")


def summarize(records: list[dict]) -> dict:
    """Validation scores by step and the per-step DAPO metrics, from the run's metrics.jsonl records."""
    validation = {r["step"]: r[VAL_KEY] for r in records if VAL_KEY in r}
    steps = sorted((r for r in records if "timing_s/step" in r), key=lambda r: r["step"])
    per_step = {key: [r.get(key) for r in steps] for key in STEP_KEYS}
    return {"validation": validation, "steps": [r["step"] for r in steps], **per_step}


def markdown(report: dict) -> str:
    s = report["summary"]
    fmt = lambda values, f: ", ".join("-" if v is None else f.format(v) for v in values)  # noqa: E731
    frac = [v for v in s["train/filtered_groups_frac"] if v is not None]
    return "\n".join([
        "# DAPO on the built-in task (`examples/dapo/run_dapo_cpu.sh`)",
        "",
        f"Made by `{report['command']}` at commit {report['commit']} on {report['date']} ({report['machine']}); "
        f"the example ran `{report['example_command']}` and took {report['wall_s']:.0f} s (start-up, {len(s['steps'])} steps and "
        f"{len(s['validation'])} validations); 1-minute load average {report['load_before']:.1f} before, {report['load_after']:.1f} after.",
        "",
        "| metric | values |",
        "|---|---|",
        "| greedy validation score (`" + VAL_KEY + "`) at steps " + ", ".join(str(k) for k in s["validation"]) + " | "
        + ", ".join(f"{v:.3f}" for v in s["validation"].values()) + " |",
        "| `train/num_gen_batches`, steps " + f"{s['steps'][0]}-{s['steps'][-1]} | "
        + fmt(s["train/num_gen_batches"], "{:.0f}") + " |",
        "| `train/filtered_groups_frac` | " + fmt(s["train/filtered_groups_frac"], "{:.2f}")
        + (f" (range {min(frac):.0%}-{max(frac):.0%})" if frac else "") + " |",
        "| `response/overlong_frac` | " + fmt(s["response/overlong_frac"], "{:.2f}") + " |",
        "",
    ])


def main(argv: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="dapo_cpu_") as tmp:
        extra = [f"trainer.log_dir={tmp}/logs", f"trainer.default_local_dir={tmp}/ckpt", "trainer.save_freq=-1",
                 "trainer.logger=[console,jsonl]", *argv]
        before, started = load_1min(), time.perf_counter()
        with open(Path(tmp) / "run.log", "w") as log:
            proc = subprocess.run(["bash", SCRIPT, *extra], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        wall, after = time.perf_counter() - started, load_1min()
        if proc.returncode:
            sys.exit(f"{SCRIPT} failed ({proc.returncode}):\n" + (Path(tmp) / "run.log").read_text()[-3000:])
        records = [json.loads(line) for line in (Path(tmp) / "logs" / "metrics.jsonl").read_text().splitlines()
                   if line.strip()]
    report = {
        "command": " ".join(["python bench/dapo_cpu.py", *argv]), "example_command": " ".join(["bash", SCRIPT, *argv]),
        "commit": git_commit(), "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores", "wall_s": wall, "load_before": before,
        "load_after": after, "overrides": argv, "summary": summarize(records),
        "records": [{k: v for k, v in r.items() if k == "step" or k == VAL_KEY or k in STEP_KEYS} for r in records],
    }
    RESULTS.mkdir(exist_ok=True)
    text = markdown(report)
    (RESULTS / "dapo_cpu.md").write_text(text)
    (RESULTS / "dapo_cpu.json").write_text(json.dumps(report, indent=1) + "\n")
    print(text)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
