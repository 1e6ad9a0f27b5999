"""On-policy distillation over seeds: the built-in student distilled from the clean built-in teacher, and the
control with the student as its own teacher, with no task reward (tests/trainer/test_distillation.py's recipe),
greedy validation every 2 steps.

    .venv/bin/python bench/distill_controls.py                       # 2 arms x 3 seeds x 30 steps
    .venv/bin/python bench/distill_controls.py --jobs 2 --steps 12   # shorter, two runs at a time
    .venv/bin/python bench/distill_controls.py --jsd --steps 10      # GKD's JSD term alone, no reward at all
    .venv/bin/python bench/distill_controls.py --opsd --steps 10     # self-distillation: privileged answer vs wrong

The issue's targets (issue 35): with the teacher, the student's held-out greedy score goes from <= 0.2 to >= 0.9
within the run's steps; with itself as the teacher it stays <= 0.2. Writes bench/results/distill_controls.{md,json}
(`--jsd`: bench/results/distill_jsd.{md,json}, the reverse-KL reward off and `algorithm.distill.jsd_coef=1`;
`--opsd`: bench/results/opsd_task.{md,json}, tests/trainer/test_opsd.py's arms: the policy as its own teacher shown
the answer, and the control shown a wrong answer).
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
from tests.trainer.test_distillation import RECIPE, distill, metrics, teacher_paths  # noqa: E402
from tests.trainer.test_opsd import TEMPLATES, opsd  # noqa: E402

RESULTS = ROOT / "bench" / "results"
ARMS = ("teacher", "self")
TARGETS = {"teacher": "first <= 0.2, reaches >= 0.9", "self": "max <= 0.2"}
OPSD_ARMS = ("answer", "wrong")  # --opsd: the arm that learns first, as above
TARGETS.update(answer=TARGETS["teacher"], wrong=TARGETS["self"])
JSD = ("algorithm.distill.coef=0.0", "algorithm.distill.jsd_coef=1.0")  # --jsd: the JSD term is all that trains


def met(arm: str, curve: dict[int, float]) -> bool:
    if arm in ("teacher", "answer"):
        return curve[0] <= 0.2 and max(curve.values()) >= 0.9
    return max(curve.values()) <= 0.2


def render(result: dict) -> str:
    signal = ("GKD's JSD term alone, no reward of any kind" if result["options"].get("overrides")
              else "no task reward")
    arms = ("Arm `teacher`: the built-in model pre-trained without the wrong habit; arm `self`: the student's own "
            "folder as the teacher.")
    if result["options"].get("opsd"):
        signal = "self-distillation (teacher.source=self), no task reward"
        arms = ("The student: the built-in model pre-trained also to answer a hint (HINT_SPEC). Arm `answer`: "
                f"teacher.privileged_template={TEMPLATES['answer']!r}; arm `wrong`: "
                f"{TEMPLATES['wrong']!r} (the answer + 2).")
    lines = [
        f"# On-policy distillation and its control over seeds (built-in task, {signal})",
        "",
        f"Made by `{result['command']}` on {result['date']} ({result['machine']}), commit {result['commit']}.",
        f"Options: {json.dumps(result['options'])}.",
        f"Greedy validation score on the 40 held-out problems (the student's own prompts), every 2 steps. {arms}",
        "",
        "Reverse KL: `distill/reverse_kl`, the mean over the step's sampled tokens of log pi_student - "
        "log pi_teacher (first and last step).",
        "",
        "| arm | seed | first | first step >= 0.9 | max | last | target | met | reverse KL first -> last | seconds |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, runs in result["runs"].items():
        for seed, run in runs.items():
            curve = {int(k): v for k, v in run["curve"].items()}
            reached = next((s for s in sorted(curve) if curve[s] >= 0.9), None)
            lines.append(f"| {arm} | {seed} | {curve[0]:.3f} | {'-' if reached is None else reached} | "
                         f"{max(curve.values()):.3f} | {curve[max(curve)]:.3f} | {TARGETS[arm]} | "
                         f"{'yes' if met(arm, curve) else 'NO'} | {run.get('reverse_kl', '-')} | {run['seconds']} |")
    lines += ["", "Curves (step: score):", ""]
    for arm, runs in result["runs"].items():
        for seed, run in runs.items():
            curve = ", ".join(f"{k}: {v:.2f}" for k, v in sorted((int(k), v) for k, v in run["curve"].items()))
            lines.append(f"- {arm}, seed {seed}: {curve}")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds 1..N")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default=str(RESULTS / "distill_controls"))
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (each is one process)")
    parser.add_argument("--jsd", action="store_true", help="GKD's JSD term alone in place of the reverse-KL reward")
    parser.add_argument("--opsd", action="store_true", help="self-distillation: privileged answer vs wrong answer")
    args = parser.parse_args()
    overrides = JSD if args.jsd else ()
    if args.out == str(RESULTS / "distill_controls") and (args.jsd or args.opsd):
        args.out = str(RESULTS / ("distill_jsd" if args.jsd else "opsd_task"))
    arms = OPSD_ARMS if args.opsd else ARMS
    threads = max(1, (os.cpu_count() or 1) // args.jobs) if args.jobs > 1 else None
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    paths = {} if args.opsd else teacher_paths()  # built before the runs start (the teacher once, a few minutes)
    result = {"command": "python bench/distill_controls.py " + " ".join(sys.argv[1:]), "commit": commit,
              "date": time.strftime("%Y-%m-%d %H:%M"),
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average "
                         f"{os.getloadavg()[0]:.1f} at the start",
              "options": {"seeds": args.seeds, "steps": args.steps, "jobs": args.jobs,
                          "torch_threads_per_run": threads or "default", "recipe": RECIPE,
                          "overrides": list(overrides), "opsd": args.opsd},
              "runs": {arm: {} for arm in arms}}

    def one(arm: str, seed: int, tmp: str) -> None:
        started = time.perf_counter()
        work = Path(tmp) / f"{arm}-{seed}"
        if args.opsd:
            curve = opsd(work, arm, args.steps, seed, threads)
        else:
            curve = distill(work, paths[arm], args.steps, seed, threads, overrides)
        kl = [r["distill/reverse_kl"] for r in metrics(work) if "distill/reverse_kl" in r]
        result["runs"][arm][str(seed)] = {"curve": {str(k): v for k, v in curve.items()},
                                          "reverse_kl": f"{kl[0]:.3f} -> {kl[-1]:.3f}",
                                          "seconds": round(time.perf_counter() - started, 1)}
        print(f"{arm} seed {seed}: {curve}", flush=True)

    with tempfile.TemporaryDirectory(prefix="hflow-distill-") as tmp, ThreadPoolExecutor(args.jobs) as pool:
        runs = [pool.submit(one, arm, seed, tmp) for seed in range(1, args.seeds + 1) for arm in arms]
        for run in runs:
            run.result()
    for arm in arms:
        result["runs"][arm] = dict(sorted(result["runs"][arm].items(), key=lambda kv: int(kv[0])))
    result["all_met"] = all(met(arm, {int(k): v for k, v in run["curve"].items()})
                            for arm, runs in result["runs"].items() for run in runs.values())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(render(result))
    print(render(result))
    return 0 if result["all_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
