"""The built-in agentic task over seeds: GRPO with the real calculator against the same run with a calculator
that always fails (the control), the full built-in run (30 steps), greedy validation with tools every 2 steps.

    .venv/bin/python bench/agent_task.py --seeds 3 --jobs 2      # 2 tools x 3 seeds x 30 steps
    .venv/bin/python bench/agent_task.py --seeds 1 --steps 10    # a quick look

Each run is the README's command, `python -m hflow.trainer.main_ppo algorithm.adv_estimator=grpo
actor_rollout_ref.rollout.multi_turn.enable=true`, on the local backend (one process, the vLLM engine), with
seed s given to the data order, the workers and the sampler; the control adds
`multi_turn.tool_config_path` of tests/trainer/agent_controls.py. Writes bench/results/agent_task.{md,json}
with the command, the commit, each curve and wall time. Targets (issue 20): held-out greedy score from
<= 0.3 to >= 0.8 within 15 minutes; the control never above 0.3.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.trainer.agent_controls import write_broken_tools  # noqa: E402

VAL_KEY = "val-core/hflow/multiply/reward/mean@1"
TOOLS = ("calculator", "broken_calculator")


def run_one(tools: str, seed: int, steps: int, work: Path, threads: int | None) -> dict:
    work.mkdir(parents=True)
    cmd = [sys.executable, "-m", "hflow.trainer.main_ppo", "algorithm.adv_estimator=grpo",
           "actor_rollout_ref.rollout.multi_turn.enable=true", "trainer.backend=local", "trainer.n_gpus_per_node=1",
           f"trainer.total_training_steps={steps}", f"data.seed={seed}", f"trainer.seed={seed}",
           f"actor_rollout_ref.rollout.seed={seed}", "trainer.logger=[jsonl]"]
    if tools == "broken_calculator":
        cmd.append(f"actor_rollout_ref.rollout.multi_turn.tool_config_path={write_broken_tools(work / 'tools.yaml')}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if threads:  # several runs at a time: one torch thread each, or their thread pools fight over the cores
        env["OMP_NUM_THREADS"] = str(threads)
    started = time.perf_counter()
    with open(work / "log.txt", "w") as log:
        subprocess.run(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    wall_s = time.perf_counter() - started
    records = [json.loads(line) for line in open(work / "logs" / "hflow" / "default" / "metrics.jsonl")]
    curve = {r["step"]: r[VAL_KEY] for r in records if VAL_KEY in r}
    calls = [r["agent/tool_calls/mean"] for r in records if "agent/tool_calls/mean" in r]
    reached = [s for s in sorted(curve) if curve[s] >= 0.8]
    return {"tools": tools, "seed": seed, "curve": curve, "wall_s": round(wall_s, 1),
            "first_step_at_0.8": reached[0] if reached else None, "max": max(curve.values()),
            "tool_calls_first_step": calls[0], "tool_calls_last_step": calls[-1]}


def render(result: dict) -> str:
    lines = ["# The built-in agentic task: the real calculator against a broken one", "",
             f"`{result['command']}` (commit {result['commit']}); GRPO, {result['steps']} steps, held-out greedy "
             "episodes with the tool every 2 steps (`val-core/hflow/multiply/reward/mean@1`), measured. Targets: "
             "start <= 0.3, reach >= 0.8 within 15 minutes; the control never above 0.3.", "",
             "| tools | seed | step 0 | max | first step >= 0.8 | last | tool calls/sample, first -> last step | wall s |",
             "|---|---|---|---|---|---|---|---|"]
    for run in result["runs"]:
        curve = {int(k): v for k, v in run["curve"].items()}
        last = curve[max(curve)]
        lines.append(f"| {run['tools']} | {run['seed']} | {curve[0]:.3f} | {run['max']:.3f} | "
                     f"{run['first_step_at_0.8'] if run['first_step_at_0.8'] is not None else '-'} | {last:.3f} | "
                     f"{run['tool_calls_first_step']:.2f} -> {run['tool_calls_last_step']:.2f} | {run['wall_s']:.0f} |")
    lines += ["", "Curves (step: score):", ""]
    for run in result["runs"]:
        curve = " ".join(f"{k}:{v:.2f}" for k, v in sorted((int(k), v) for k, v in run["curve"].items()))
        lines.append(f"- {run['tools']} seed {run['seed']}: {curve}")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "agent_task")
    args = parser.parse_args()
    threads = 1 if args.jobs > 1 else None
    runs = []
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        jobs = [(tools, seed) for seed in range(args.seeds) for tools in TOOLS]
        futures = [pool.submit(run_one, tools, seed, args.steps, Path(tmp) / f"{tools}-{seed}", threads)
                   for tools, seed in jobs]
        runs = [f.result() for f in futures]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    result = {"command": "python bench/agent_task.py " + " ".join(sys.argv[1:]), "commit": commit.strip(),
              "steps": args.steps, "load_1min": os.getloadavg()[0], "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(render(result))
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
