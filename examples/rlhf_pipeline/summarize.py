"""Write OUT_DIR/summary.json for examples/rlhf_pipeline/run.sh from the stages' logs and a fresh
evaluation of the policy before (SFT) and after PPO on the held-out questions."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from evaluate import evaluate


def val_history(metrics_file: Path, key: str) -> list[float]:
    return [row[key] for row in map(json.loads, metrics_file.read_text().splitlines()) if key in row]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--ppo-policy", required=True)
    parser.add_argument("--seconds", type=float, default=None)
    args = parser.parse_args()
    out = args.out_dir
    sft_loss = val_history(out / "logs/sft/metrics.jsonl", "val/loss")
    rm_accuracy = val_history(out / "logs/rm/metrics.jsonl", "val/accuracy")
    reward_model = str(out / "rm/huggingface")
    before = evaluate(str(out / "sft/huggingface"), reward_model)
    after = evaluate(args.ppo_policy, reward_model)
    summary = {
        "sft": {"val_loss_before": sft_loss[0], "val_loss_after": sft_loss[-1]},
        "rm": {"val_accuracy": rm_accuracy[-1]},
        "ppo": {"true_score_before": before["true_score"], "true_score_after": after["true_score"],
                "rm_score_before": before["rm_score"], "rm_score_after": after["rm_score"]},
        "details": {"styles_before": before["styles"], "styles_after": after["styles"],
                    "samples_after": after["samples"], "seconds": args.seconds},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
