"""How long a worker takes to build its in-process vLLM engine: hflow's `new_engine` (the GC heap frozen first)
against the same build without that freeze (vLLM alone, hflow before this bench), side by side in one run.

    python bench/engine_build.py [--reps 3] [--out bench/results/engine_build.md]

Each build happens where a worker does it: a fresh `python -m hflow.trainer.main_ppo` process on the built-in
task (`trainer.backend=local`, one rank, one GRPO step), so the heap the collections walk holds what a worker
holds by then (torch, transformers, vLLM's modules, the FSDP actor, its optimizer, the reference model). Only
the call that builds the engine is timed. The arms alternate, `--reps` processes each; reported: medians
[min-max] and the frozen arm's time over the other's.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ARMS = ("vllm-alone", "frozen-first")
MARK = "ENGINE_BUILD_S="
OBJECTS = "GC_TRACKED_OBJECTS="


def child(arm: str, run_dir: str) -> None:
    """One trainer process whose engine build is timed; `vllm-alone` builds it without the freeze."""
    import runpy

    from hflow.workers.rollout import vllm_rollout

    if arm == "vllm-alone":  # new_engine with its one difference undone
        vllm_rollout.freeze_gc_heap = lambda: None
    build = vllm_rollout.new_engine

    def timed(engine_kwargs):
        print(f"{OBJECTS}{len(gc.get_objects())}", file=sys.stderr, flush=True)  # what a full collection walks
        start = time.perf_counter()
        engine = build(engine_kwargs)
        print(f"{MARK}{time.perf_counter() - start:.4f}", file=sys.stderr, flush=True)
        return engine

    vllm_rollout.new_engine = timed
    sys.argv = ["main_ppo", "algorithm.adv_estimator=grpo", "trainer.backend=local", "trainer.n_gpus_per_node=1",
                "trainer.total_training_steps=1", "trainer.val_before_train=false", "trainer.test_freq=-1",
                "trainer.save_freq=-1", "trainer.logger=[console]", f"trainer.default_local_dir={run_dir}/ckpt",
                f"trainer.log_dir={run_dir}/logs"]
    runpy.run_module("hflow.trainer.main_ppo", run_name="__main__")


def measure(arm: str) -> tuple[float, int]:
    with tempfile.TemporaryDirectory() as run_dir:
        out = subprocess.run([sys.executable, __file__, "--child", arm, "--run-dir", run_dir], cwd=run_dir,
                             capture_output=True, text=True, timeout=600)
    times = [float(line[len(MARK):]) for line in out.stderr.splitlines() if line.startswith(MARK)]
    if out.returncode != 0 or len(times) != 1:
        raise SystemExit(f"{arm}: exit {out.returncode}, {len(times)} engine builds\n{out.stderr[-3000:]}")
    objects = next(int(line[len(OBJECTS):]) for line in out.stderr.splitlines() if line.startswith(OBJECTS))
    return times[0], objects


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "engine_build.md"))
    parser.add_argument("--child", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.run_dir)

    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    objects: list[int] = []
    for rep in range(args.reps):
        for arm in ARMS:
            seconds, tracked = measure(arm)
            times[arm].append(seconds)
            objects.append(tracked)
            print(f"rep {rep + 1}/{args.reps} {arm}: {times[arm][-1]:.2f} s", flush=True)
    median = {arm: statistics.median(t) for arm, t in times.items()}
    command = f"python bench/engine_build.py --reps {args.reps}"
    lines = [
        "# Engine build in a worker: GC heap frozen first vs vLLM alone",
        "",
        f"`{command}` ({platform.processor() or platform.machine()}, Python {platform.python_version()}; built-in "
        "task, `trainer.backend=local`, one rank; each build in its own trainer process, arms alternating).",
        f"Objects the garbage collector tracks when the build starts: {statistics.median(objects):,.0f} (median).",
        "",
        "| arm | engine build, s: median [min-max] | vs vLLM alone |",
        "|---|---|---|",
    ]
    for arm in ARMS:
        t = times[arm]
        lines.append(f"| {arm} | {median[arm]:.2f} [{min(t):.2f}-{max(t):.2f}] | "
                     f"{median[arm] / median['vllm-alone']:.2f}x |")
    lines += ["", f"Raw times (s): `{json.dumps({arm: [round(x, 3) for x in t] for arm, t in times.items()})}`", ""]
    report = "\n".join(lines)
    print(report)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(report)


if __name__ == "__main__":
    main()
