"""What `ppo_max_token_len_per_gpu: null` resolves to on a GPU for a Qwen2.5-1.5B-shaped model (issue 33):
the memory plan of a GRPO run (1024-token prompts + responses, 8 ranks of 80 GiB) for each budget tried, and the
budget chosen (hflow.trainer.memory.defaults), without reading any weight (config.json only).

    python bench/token_budget_plan.py [--device-memory-gb 80] [--out bench/results/token_budget_plan.md]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

QWEN2_5_1_5B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 1536,
                "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
                "intermediate_size": 8960, "vocab_size": 151936, "max_position_embeddings": 32768,
                "rope_theta": 1000000.0, "tie_word_embeddings": True, "rms_norm_eps": 1e-06, "hidden_act": "silu"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device-memory-gb", type=float, default=80.0)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "token_budget_plan.md"))
    args = parser.parse_args(argv)
    from omegaconf import open_dict

    from hflow.trainer.config import default_config, validate_config
    from hflow.trainer.memory.defaults import BUDGET_PHASES, plan_token_budget
    from hflow.trainer.memory.plan import plan_memory
    from hflow.workers.config import GPU_TOKEN_BUDGETS, resolve_device_defaults

    gib = 2**30
    device_bytes = args.device_memory_gb * gib
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "config.json").write_text(json.dumps(QWEN2_5_1_5B))
        config = validate_config(default_config())
        with open_dict(config):
            config.actor_rollout_ref.model.path = folder
            config.algorithm.adv_estimator = "grpo"
            config.actor_rollout_ref.rollout.n = 8
            config.data.max_prompt_length, config.data.max_response_length = 512, 512
            config.data.train_batch_size = config.actor_rollout_ref.actor.ppo_mini_batch_size = 128
            config.trainer.n_gpus_per_node = 8
        lines = [f"# Token budget on a {args.device_memory_gb:g} GiB GPU, Qwen2.5-1.5B shape (memory plan)", "",
                 f"`python bench/token_budget_plan.py --device-memory-gb {args.device_memory_gb:g}`", "",
                 "GRPO, n = 8, 128 prompts per step, 512 + 512 tokens, 8 ranks; remove-padding and token-budget "
                 "micro-batches; no gradient checkpointing.", "",
                 "| budget (tokens) | " + " | ".join(f"{p} GiB" for p in BUDGET_PHASES) + " | fits |",
                 "|---|" + "---|" * (len(BUDGET_PHASES) + 1)]
        for budget in GPU_TOKEN_BUDGETS:
            trial = config.copy()
            with open_dict(trial):
                resolve_device_defaults(trial.actor_rollout_ref, True, budget, critic=trial.get("critic"))
            plan = plan_memory(trial, "cuda", device_bytes)
            figures = {p.name: p.total for p in plan.phases}
            fits = all(figures[p] <= device_bytes for p in BUDGET_PHASES if p in figures)
            lines.append(f"| {budget} | " + " | ".join(
                f"{figures[p] / gib:.2f}" if p in figures else "-" for p in BUDGET_PHASES) + f" | {fits} |")
            print(lines[-1], flush=True)
        chosen, why = plan_token_budget(config, "cuda", device_bytes)
        lines += ["", f"`ppo_max_token_len_per_gpu: null` resolves to **{chosen}** ({why})."]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
