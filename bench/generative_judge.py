"""The tiny arithmetic judge's agreement with the true rule on held-out pairs, through the vLLM judge.

Builds (or finds) the judge of `hflow.tasks.judge_task`, scores every held-out pair (the 40 validation
problems, each with its right answer and the answers off by -2, -1, +1, +2) with `VLLMJudge`'s exact
yes/no probability, and counts the pairs where ``P(yes) > 0.5`` is the truth. Controls, each a deliberate
break: the verdict words swapped (``yes_word=no``, ``no_word=yes``), and the reference answer left out of
the prompt. With ``--grpo-steps N`` (default 20; 0 = skip) it also runs GRPO on the built-in task with
the judge as the only training reward (``main_ppo ... reward_model.style=generative``, local backend,
vLLM rollout) and records the greedy validation score (the true rule) every 2 steps. Writes
bench/results/generative_judge.{md,json}.

    OMP_NUM_THREADS=1 python bench/generative_judge.py
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
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hflow.trainer.config import default_config  # noqa: E402
from hflow.tasks.judge_task import ensure_judge_assets, judge_pairs  # noqa: E402
from hflow.reward.judge_worker import VLLMJudge  # noqa: E402


def agreement(judge: VLLMJudge, pairs, with_reference: bool = True) -> dict:
    started = time.perf_counter()
    probs, _ = judge.score([p.user_message(with_reference) for p in pairs])
    elapsed = time.perf_counter() - started
    right = [(p > 0.5) == pair.correct for p, pair in zip(probs, pairs)]
    by_offset = {}
    for pair, ok in zip(pairs, right):
        by_offset.setdefault(pair.candidate - pair.problem.answer, []).append(ok)
    return {"pairs": len(pairs), "agreement": round(sum(right) / len(right), 4),
            "by_offset": {str(k): round(sum(v) / len(v), 4) for k, v in sorted(by_offset.items())},
            "mean_p_yes_right": round(sum(p for p, q in zip(probs, pairs) if q.correct) / sum(q.correct for q in pairs), 4),
            "mean_p_yes_wrong": round(sum(p for p, q in zip(probs, pairs) if not q.correct)
                                      / sum(not q.correct for q in pairs), 4),
            "score_s": round(elapsed, 2)}


def grpo_curve(model_path: str, steps: int) -> dict:
    """Greedy validation score (true rule) every 2 steps of GRPO whose only training reward is the judge."""
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        cmd = [sys.executable, "-m", "hflow.trainer.main_ppo", "algorithm.adv_estimator=grpo", "trainer.backend=local",
               "trainer.n_gpus_per_node=1", f"trainer.total_training_steps={steps}", "reward_model.enable=true",
               "reward_model.style=generative", f"reward_model.model.path={model_path}"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        subprocess.run(cmd, cwd=tmp, env=env, check=True, capture_output=True, text=True)
        records = [json.loads(line) for line in open(Path(tmp) / "logs" / "hflow" / "default" / "metrics.jsonl")]
    key, rm_key = "val-core/hflow/arithmetic/reward/mean@1", "val-aux/hflow/arithmetic/rm_score/mean@1"
    return {"command": " ".join(cmd[1:]), "wall_s": round(time.perf_counter() - started, 1),
            "val_score": {int(r["step"]): round(r[key], 4) for r in records if key in r},
            "val_judge_score": {int(r["step"]): round(r[rm_key], 4) for r in records if rm_key in r}}


def render(result: dict) -> str:
    rows = ["| case | pairs | agreement | P(yes) right / wrong | by offset (-2, -1, 0, +1, +2) |", "|---|---|---|---|---|"]
    for name, r in result["cases"].items():
        rows.append(f"| {name} | {r['pairs']} | {r['agreement']:.3f} | {r['mean_p_yes_right']:.3f} / "
                    f"{r['mean_p_yes_wrong']:.3f} | {', '.join(f'{v:.2f}' for v in r['by_offset'].values())} |")
    return "\n".join([
        "# Generative judge: held-out agreement (built-in arithmetic)",
        "",
        f"Made by `OMP_NUM_THREADS=1 python bench/generative_judge.py` on {result['date']} "
        f"({result['machine']}), commit {result['commit']}.",
        "",
        "The tiny judge (`hflow.tasks.judge_task`, trained on the 115 training problems' 575 pairs) scores the "
        "40 held-out validation problems x 5 candidates (the answer, and -2, -1, +1, +2 off) through `VLLMJudge` "
        "(vLLM, exact P(yes) / (P(yes) + P(no)) from prompt log-probs); agreement = share of pairs where "
        "P(yes) > 0.5 is the truth. The last two rows are deliberate breaks.",
        "",
        *rows,
        "",
        f"Judge build: {json.dumps(result['judge_info'])}",
        "",
        *grpo_lines(result.get("grpo")),
    ])


def grpo_lines(grpo: dict | None) -> list[str]:
    if not grpo:
        return []
    return [
        "## GRPO with the judge as the only training reward",
        "",
        f"`python {grpo['command']}` ({grpo['wall_s']} s). Greedy validation score on the 40 held-out problems by the "
        "true rule (step: score), and the judge's mean P(yes) on the same greedy answers:",
        "",
        "- true rule: " + ", ".join(f"{k}: {v:.3f}" for k, v in grpo["val_score"].items()),
        "- judge: " + ", ".join(f"{k}: {v:.3f}" for k, v in grpo["val_judge_score"].items()),
        "",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--grpo-steps", type=int, default=20, help="GRPO steps with the judge as reward (0 = skip)")
    args = parser.parse_args()
    assets = ensure_judge_assets()
    pairs = judge_pairs("val")
    config = default_config().reward_model.judge
    judge = VLLMJudge(assets.model_path, config)
    cases = {"judge (template with reference)": agreement(judge, pairs)}
    config.yes_word, config.no_word = "no", "yes"
    cases["break: yes/no words swapped"] = agreement(judge, pairs)
    config.yes_word, config.no_word = "yes", "no"
    cases["break: reference left out of the prompt"] = agreement(judge, pairs, with_reference=False)
    judge.close()
    info = json.loads(Path(assets.info_file).read_text())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "commit": commit, "cases": cases,
              "judge_info": {k: info[k] for k in ("spec", "num_train", "num_val", "pretrain", "base_model")},
              "grpo": grpo_curve(assets.model_path, args.grpo_steps) if args.grpo_steps > 0 else None}
    text = render(result)
    for suffix, content in ((".json", json.dumps(result, indent=1) + "\n"), (".md", text)):
        (ROOT / "bench" / "results" / f"generative_judge{suffix}").write_text(content)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
