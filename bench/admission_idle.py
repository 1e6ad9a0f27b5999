"""The engines' idle share in tests/trainer/test_async.py's continuous-admission run, with continuous admission
and with static admission (the same settings otherwise), to see whether the test could tell them apart by it.

    python bench/admission_idle.py [--repeats 1]

Each run: the built-in task, split, two standalone vLLM engines and one training device, two steps off,
4 steps, in this process with its own Ray. Writes bench/results/admission_idle.{json,md}.
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
from tests.conftest import WORKER_ENV  # noqa: E402
from tests.trainer.test_async import CONTINUOUS_RUN  # noqa: E402  (the test's settings, written once)
from tests.trainer.test_placement import run_builtin  # noqa: E402

ENGINES = (0, 1)


def run(admission: str) -> dict:
    with tempfile.TemporaryDirectory() as work:
        records = run_builtin(Path(work), *CONTINUOUS_RUN, f"actor_rollout_ref.rollout.admission={admission}")
    steps = [r for r in records if "actor/pg_loss" in r]
    idle = [[r[f"perf/rollout_idle_s/engine{e}"] for e in ENGINES] for r in steps]
    share = [[r[f"perf/rollout_idle_share/engine{e}"] for e in ENGINES] for r in steps]
    # each step's window per engine is idle / share (a share of 0 leaves it unknown: counted as idle's 0 s)
    windows = [[i / s if s > 0 else 0.0 for i, s in zip(row_i, row_s)] for row_i, row_s in zip(idle, share)]
    total_idle, total_window = sum(map(sum, idle)), sum(map(sum, windows))
    return {"admission": admission, "idle_share_per_step": share, "idle_s_per_step": idle,
            "run_idle_share": total_idle / total_window if total_window else None,
            "rows_per_step": [[r.get(f"rollout/rows/engine{e}") for e in ENGINES] for r in steps]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    import ray

    env = {**WORKER_ENV, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    os.environ.update(WORKER_ENV)
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    load = os.getloadavg()
    rows = [run(admission) for _ in range(args.repeats) for admission in ("continuous", "static")]
    ray.shutdown()
    results = ROOT / "bench" / "results"
    (results / "admission_idle.json").write_text(json.dumps({"commit": commit, "runs": rows}, indent=1) + "\n")

    def fmt(pairs):
        return ", ".join("/".join(f"{v:.2f}" for v in pair) for pair in pairs)

    lines = [
        "# Engine idle share: continuous against static admission, the async test's settings",
        "",
        f"Made by `python bench/admission_idle.py --repeats {args.repeats}` at commit {commit} on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores, load average "
        f"{load[0]:.1f} at the start (shared with other work: loaded figures). Settings: "
        f"tests/trainer/test_async.py's `CONTINUOUS_RUN` ({' '.join(CONTINUOUS_RUN)}), admission as in the table.",
        "",
        "`perf/rollout_idle_share` per step (engine0/engine1), and over the run (idle seconds over window seconds,",
        "both engines, every step):",
        "",
        "| admission | per step | run | rows per step |",
        "|---|---|---|---|",
        *(f"| {r['admission']} | {fmt(r['idle_share_per_step'])} | {r['run_idle_share']:.2f} | "
          f"{', '.join('/'.join('-' if v is None else f'{v:.0f}' for v in p) for p in r['rows_per_step'])} |"
          for r in rows),
    ]
    (results / "admission_idle.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
