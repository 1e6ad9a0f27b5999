"""The built-in stateful task (hflow/tasks/vault_task.py) over seeds: GRPO with the real environment against
the same run with the environment's state reset at every turn and with its feedback shuffled (the controls),
held-out greedy episodes with the real environment every 2 steps (`val-core/hflow/vault/reward/mean@1`).

    .venv/bin/python bench/stateful_task.py --seeds 3 --jobs 2              # 3 arms x 3 seeds, two runs at a time
    .venv/bin/python bench/stateful_task.py --seeds 1 --arms look_token look_turn_return --out ...  # turn rewards
    .venv/bin/python bench/stateful_task.py --seeds 3 --jobs 2 --via endpoint  # an openai-client agent drives it

Each run is the README's command, `python -m hflow.trainer.main_ppo algorithm.adv_estimator=grpo
data.builtin_task=<arm's task>`, on the local backend (one process, the vLLM engine, hflow's own multi-turn
loop), with seed s given to the data order, the workers and the sampler (the environment draws its
codes from its own seed, 0). With `--via endpoint` the episodes are run by an external agent instead
(`examples/agent/vault_agent.py`, the `openai` client against hflow's endpoint, owning its `VaultEnv`):
the same command with `actor_rollout_ref.rollout.multi_turn.endpoint.enable=true` and `.agent_path`. Arms:

    learns             data.builtin_task=vault
    reset_every_turn   data.builtin_task=vault_reset_every_turn (control)
    shuffled           data.builtin_task=vault_shuffled (control)
    look_token         the vault with a step reward of 0.5 for looking first, algorithm.turn_rewards=token
    look_turn_return   the same reward, algorithm.turn_rewards=turn_return

Writes `--out`.{md,json} with the command, the commit, each curve, the training score and wall time, again
after every finished run (a bench stopped early leaves the runs that finished). Targets
(issue 34): held-out greedy score from <= 0.2 to >= 0.8; the controls never above 0.2.
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
VAL_KEY = "val-core/hflow/vault/reward/mean@1"
TASKS = {"learns": "vault", "reset_every_turn": "vault_reset_every_turn", "shuffled": "vault_shuffled",
         "look_token": "vault", "look_turn_return": "vault"}
TURN_REWARDS = {"look_token": "token", "look_turn_return": "turn_return"}
LOOK_REWARD = 0.5
AGENT = ROOT / "examples" / "agent" / "vault_agent.py"
DEFAULT_OUT = {"loop": ROOT / "bench" / "results" / "stateful_task",
               "endpoint": ROOT / "bench" / "results" / "stateful_task_endpoint"}


def env_file(path: Path, seed: int) -> Path:
    path.write_text(f"envs:\n  - name: vault\n    class_name: hflow.tasks.vault_task.VaultEnv\n"
                    f"    config: {{look_reward: {LOOK_REWARD}, seed: {seed}}}\n    data_sources: [hflow/vault]\n")
    return path


def run_one(arm: str, seed: int, steps: int, work: Path, threads: int, via: str) -> dict:
    work.mkdir(parents=True)
    cmd = [sys.executable, "-m", "hflow.trainer.main_ppo", "algorithm.adv_estimator=grpo",
           f"data.builtin_task={TASKS[arm]}", "trainer.backend=local", "trainer.n_gpus_per_node=1",
           f"trainer.total_training_steps={steps}", f"data.seed={seed}", f"trainer.seed={seed}",
           f"actor_rollout_ref.rollout.seed={seed}", "trainer.logger=[jsonl]"]
    if via == "endpoint":
        cmd += ["actor_rollout_ref.rollout.multi_turn.endpoint.enable=true",
                f"actor_rollout_ref.rollout.multi_turn.endpoint.agent_path={AGENT}"]
    if arm in TURN_REWARDS:
        cmd += [f"algorithm.turn_rewards={TURN_REWARDS[arm]}",
                f"actor_rollout_ref.rollout.multi_turn.env_config_path={env_file(work / 'envs.yaml', seed)}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": str(threads)}
    started = time.perf_counter()
    with open(work / "log.txt", "w") as log:
        subprocess.run(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    wall_s = time.perf_counter() - started
    records = [json.loads(line) for line in open(work / "logs" / "hflow" / "default" / "metrics.jsonl")]
    curve = {r["step"]: r[VAL_KEY] for r in records if VAL_KEY in r}
    train = [r["critic/score/mean"] for r in records if "critic/score/mean" in r]
    reached = [s for s in sorted(curve) if curve[s] >= 0.8]
    return {"arm": arm, "seed": seed, "curve": curve, "wall_s": round(wall_s, 1), "max": max(curve.values()),
            "first_step_at_0.8": reached[0] if reached else None, "train_score_first": train[0],
            "train_score_last": train[-1]}


def render(result: dict) -> str:
    endpoint = result.get("via") == "endpoint"
    title = "driven by an external openai-client agent through the endpoint" if endpoint else \
        "the real environment against its two controls"
    driver = ("an external agent (`examples/agent/vault_agent.py`: the `openai` client against hflow's "
              "OpenAI-compatible endpoint, owning each episode's environment) on the vLLM engine" if endpoint
              else "hflow's multi-turn loop on the vLLM engine")
    finished = len(result["runs"])
    lines = [f"# The built-in stateful task (vault): {title}", "",
             f"`{result['command']}` (commit {result['commit']}, load {result['load_1min']:.1f} on 2 cores); GRPO, "
             f"{result['steps']} steps, {driver} (local backend); held-out greedy "
             "episodes with the real environment every 2 steps (`val-core/hflow/vault/reward/mean@1`; the controls "
             "act on training rows only). Targets: start <= 0.2, end >= 0.8; the controls never above 0.2.", "",
             *([f"**{finished} of {result['planned']} runs finished**; the others did not run to their end.", ""]
               if finished < result.get("planned", finished) else []),
             "| arm | seed | start | max | first step >= 0.8 | end | training score, first -> last step | wall s |",
             "|---|---|---|---|---|---|---|---|"]
    for run in result["runs"]:
        curve = {int(k): v for k, v in run["curve"].items()}
        reached = run["first_step_at_0.8"]
        lines.append(f"| {run['arm']} | {run['seed']} | {curve[0]:.3f} | {run['max']:.3f} | "
                     f"{reached if reached is not None else '-'} | {curve[max(curve)]:.3f} | "
                     f"{run['train_score_first']:.3f} -> {run['train_score_last']:.3f} | {run['wall_s']:.0f} |")
    lines += ["", "Curves (step: held-out greedy score):", ""]
    for run in result["runs"]:
        curve = " ".join(f"{k}:{v:.2f}" for k, v in sorted((int(k), v) for k, v in run["curve"].items()))
        lines.append(f"- {run['arm']} seed {run['seed']}: {curve}")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time")
    parser.add_argument("--arms", nargs="+", default=["learns", "reset_every_turn", "shuffled"], choices=list(TASKS))
    parser.add_argument("--via", choices=["loop", "endpoint"], default="loop",
                        help="who runs the episodes: hflow's loop, or an external agent through the endpoint")
    parser.add_argument("--out", type=Path, default=None, help="default: bench/results/stateful_task[_endpoint]")
    args = parser.parse_args()
    if args.via == "endpoint" and set(args.arms) & set(TURN_REWARDS):
        parser.error("the turn-reward arms credit the look on its own turn; an external agent's reward lands on the "
                     "episode's last token, so run them with --via loop")
    out = args.out or DEFAULT_OUT[args.via]
    out.parent.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    result = {"command": "python bench/stateful_task.py " + " ".join(sys.argv[1:]), "commit": commit.strip(),
              "steps": args.steps, "via": args.via, "planned": args.seeds * len(args.arms), "runs": []}
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(run_one, arm, seed, args.steps, Path(tmp) / f"{arm}-{seed}", args.threads, args.via)
                   for seed in range(args.seeds) for arm in args.arms]
        order = {(seed, arm): i for i, (seed, arm) in enumerate((s, a) for s in range(args.seeds) for a in args.arms)}
        for future in as_completed(futures):
            result["runs"].append(future.result())
            print(json.dumps(result["runs"][-1]), flush=True)
            result["runs"].sort(key=lambda run: order[run["seed"], run["arm"]])
            result["load_1min"] = os.getloadavg()[0]
            out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
            out.with_suffix(".md").write_text(render(result))
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
