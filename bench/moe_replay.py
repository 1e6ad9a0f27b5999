"""GRPO with router replay on the built-in MoE model (`MOE_SPEC`: a Qwen3-MoE, 4 experts, 2 per token, pre-trained
on the built-in sloppy corpus): the real reward against the inverted control, greedy validation every 2 steps.

    .venv/bin/python bench/moe_replay.py                  # real + inverted, 10 steps each (~5 min on 2 cores)
    .venv/bin/python bench/moe_replay.py --steps 20
    .venv/bin/python bench/moe_replay.py --rollout vllm   # the vLLM engine samples (weights synced every step)

The built-in recipe (config/builtin_task.yaml's settings, spelled out since the model is given), the HF rollout
(or vLLM's, `--rollout vllm`), the local backend, `actor.router_replay=true`. Writes
bench/results/moe_replay.{md,json} (`moe_replay_vllm.*` with vLLM); each run's routing_match and expert load are in
the table too, and with vLLM the largest |sampler - trainer| log-prob on the steps the trainer checks it
(`training/rollout_log_probs_diff_max`, both fp32: the engine scores the weights it was sent).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hflow.tasks.builtin_task import MOE_SPEC, ensure_builtin_assets  # noqa: E402

RESULTS = ROOT / "bench" / "results"
CONTROLS = ROOT / "tests" / "trainer" / "reward_controls.py"
VAL_KEY = "val-core/hflow/arithmetic/reward/mean@1"
DIFF_KEY = "training/rollout_log_probs_diff_max"
RECIPE = ["data.train_batch_size=32", "data.max_prompt_length=32", "data.max_response_length=8",
          "actor_rollout_ref.rollout.n=8", "actor_rollout_ref.actor.ppo_mini_batch_size=32",
          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", "actor_rollout_ref.actor.optim.lr=2e-4",
          "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.3"]


def command(reward: str, steps: int, rollout: str) -> list[str]:
    assets = ensure_builtin_assets(spec=MOE_SPEC)
    return [sys.executable, "-m", "hflow.trainer.main_ppo", "algorithm.adv_estimator=grpo", "trainer.backend=local",
            "trainer.n_gpus_per_node=1", f"actor_rollout_ref.rollout.name={rollout}",
            f"actor_rollout_ref.model.path={assets.model_path}", f"data.train_files={assets.train_file}",
            f"data.val_files={assets.val_file}", *RECIPE, "actor_rollout_ref.actor.router_replay=true",
            f"trainer.total_training_steps={steps}", "trainer.test_freq=2", "trainer.logger=[jsonl]",
            f"custom_reward_function.path={CONTROLS}", f"custom_reward_function.name={reward}",
            "custom_reward_function.timeout_s=null"]


def run(reward: str, steps: int, rollout: str, work: Path) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with open(work / "log.txt", "w") as log:
        subprocess.run(command(reward, steps, rollout), cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT,
                       check=True)
    return [json.loads(line) for line in open(work / "logs" / "hflow" / "default" / "metrics.jsonl")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rollout", choices=["hf", "vllm"], default="hf")
    args = parser.parse_args()
    result = {"command": "python bench/moe_replay.py " + " ".join(sys.argv[1:]), "runs": {}}
    for reward in ("real", "inverted"):
        with tempfile.TemporaryDirectory() as tmp:
            records = run(reward, args.steps, args.rollout, Path(tmp))
        train = [r for r in records if "actor/moe/routing_match" in r]
        result["runs"][reward] = {
            "validation": {r["step"]: r[VAL_KEY] for r in records if VAL_KEY in r},
            "routing_match": [round(r["actor/moe/routing_match"], 4) for r in train],
            "expert_load_max": [round(r["actor/moe/expert_load_max"], 3) for r in train],
            "aux_loss": [round(r["actor/moe/aux_loss"], 4) for r in train],
        }
        if args.rollout == "vllm":
            result["runs"][reward]["rollout_log_probs_diff_max"] = {  # on the trainer's check steps
                r["step"]: float(f"{r[DIFF_KEY]:.2e}") for r in records if DIFF_KEY in r}
    stem = "moe_replay" if args.rollout == "hf" else f"moe_replay_{args.rollout}"
    (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# GRPO with router replay on the built-in MoE model ({args.rollout} rollout)", "",
             f"Command: `{result['command']}`", "",
             "Greedy validation on the 40 held-out problems (step: score); per training step the share of",
             "(token, layer) pairs where the trainer's own top-k equals the sampler's (`actor/moe/routing_match`),",
             "the busiest expert's load (E x share, 1 = balanced) and the load-balancing loss.", ""]
    for reward, run_result in result["runs"].items():
        curve = ", ".join(f"{s}: {v:.3f}" for s, v in run_result["validation"].items())
        lines += [f"## {reward}", "", f"- validation: {curve}", f"- routing_match: {run_result['routing_match']}",
                  f"- expert_load_max: {run_result['expert_load_max']}", f"- aux_loss: {run_result['aux_loss']}"]
        if "rollout_log_probs_diff_max" in run_result:
            lines.append(f"- max |sampler - trainer| log-prob (step: value): {run_result['rollout_log_probs_diff_max']}")
        lines.append("")
    (RESULTS / f"{stem}.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
