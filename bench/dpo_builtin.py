"""DPO on the built-in preference pairs, against its control (the same pairs with their labels shuffled).

    python bench/dpo_builtin.py --out bench/results/dpo_builtin.json [--seeds 1 2 3] [--steps 39]

Per seed, two runs (all at once, a process each) of the README's command (`python -m hflow.trainer.main_dpo`, the built-in model and task,
one local rank), `--steps` optimizer steps each (39 = one epoch of the 1265 training pairs):

* learn: the built-in training pairs;
* control: the same pairs with chosen and rejected swapped in a random half of the rows
  (`rlhf_task.write_shuffled_labels`, seeded by the seed), so the labels carry no preference.

Then, on the held-out questions, with plain transformers (not the trainer's code): the implicit reward's
accuracy on the held-out pairs, per kind (beta x log-ratio to the reference, the built-in model: chosen
strictly above rejected), and the greedy answers' exact-correct rate and house-style share
(`examples/rlhf_pipeline/evaluate.py`). Writes one JSON file and prints a table.
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
from collections import defaultdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from examples.rlhf_pipeline.evaluate import evaluate_policy  # noqa: E402
from hflow.tasks.builtin_task import ensure_builtin_assets  # noqa: E402
from hflow.tasks.rlhf_task import ensure_rlhf_task_data, write_shuffled_labels  # noqa: E402


def start_dpo(out: Path, seed: int, steps: int, train_files: str | None) -> subprocess.Popen:
    command = [sys.executable, "-m", "hflow.trainer.main_dpo", "trainer.backend=local", "trainer.n_gpus_per_node=1",
               f"trainer.seed={seed}", f"data.seed={seed}", f"trainer.total_training_steps={steps}",
               "trainer.logger=[jsonl]", f"trainer.default_local_dir={out}", f"trainer.log_dir={out}/logs"]
    if train_files:
        command.append(f"data.train_files={train_files}")
    return subprocess.Popen(command, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.DEVNULL, stderr=open(out.with_suffix(".log"), "w"))


@torch.no_grad()
def pair_accuracy(policy_path: str, ref_path: str) -> dict[str, float]:
    """The implicit reward's accuracy on the held-out pairs, per kind: log pi/pi_ref of the chosen reply
    above that of the rejected one (beta > 0 does not change the order)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import pyarrow.parquet as pq

    tokenizer = AutoTokenizer.from_pretrained(ref_path)
    models = [AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for p in (policy_path, ref_path)]

    def log_ratio(chat, text):
        prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        reply = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        ids = torch.tensor([prompt + reply])
        logps = []
        for model in models:
            logp = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1:-1].double(), -1)
            logps.append(logp.gather(-1, torch.tensor(reply)[:, None]).sum().item())
        return logps[0] - logps[1]

    hits: dict[str, list[bool]] = defaultdict(list)
    for row in pq.read_table(ensure_rlhf_task_data().rm_val).to_pylist():
        right = log_ratio(row["prompt"], row["chosen"]) > log_ratio(row["prompt"], row["rejected"])
        hits[row["kind"]].append(right)
        hits["all"].append(right)
    return {kind: sum(v) / len(v) for kind, v in sorted(hits.items())}


def measure(policy: str) -> dict:
    result = evaluate_policy(policy, None)
    return {key: result[key] for key in ("exact_correct", "house_style", "styles", "samples")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=39)
    args = parser.parse_args()
    base = ensure_builtin_assets().model_path
    report = {"command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]), "steps": args.steps,
              "machine": f"{platform.machine()}, {os.cpu_count()} cores", "base_model": measure(base), "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        # every run at once (one process each: on a shared machine they finish together rather than in turn)
        started, runs = time.perf_counter(), {}
        for seed in args.seeds:
            shuffled = write_shuffled_labels(ensure_rlhf_task_data().rm_train, Path(tmp) / f"shuffled-{seed}.parquet",
                                             seed=seed)
            for arm, files in (("learn", None), ("control", shuffled)):
                out = Path(tmp) / f"{arm}-{seed}"
                out.mkdir()
                runs[seed, arm] = out, start_dpo(out, seed, args.steps, files)
        for (seed, arm), (out, proc) in runs.items():
            if proc.wait():
                raise SystemExit(f"seed {seed} {arm} failed: {out.with_suffix('.log').read_text()[-3000:]}")
        report["seconds_all_runs"] = round(time.perf_counter() - started, 1)
        for (seed, arm), (out, _) in runs.items():
            records = [json.loads(line) for line in open(out / "logs" / "metrics.jsonl")]
            val = [r for r in records if "val/rewards/accuracies" in r]
            row = {"seed": seed, "arm": arm, "val_before": {k: v for k, v in val[0].items() if k.startswith("val/")},
                   "val": {k: v for k, v in val[-1].items() if k.startswith("val/")},
                   "heldout_pair_accuracy": pair_accuracy(str(out / "huggingface"), base),
                   **measure(str(out / "huggingface"))}
            report["runs"].append(row)
            print(f"seed {seed} {arm:8s} pairs {row['heldout_pair_accuracy']} exact_correct "
                  f"{row['exact_correct']:.3f} house {row['house_style']:.3f}", flush=True)
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    report["load_average_after"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
