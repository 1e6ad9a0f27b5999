"""The tiny arithmetic judge's agreement with the true rule on held-out pairs, through the vLLM judge.

Builds (or finds) the judge of `hflow.tasks.judge_task`, scores every held-out pair (the 40 validation
problems, each with its right answer and the answers off by -2, -1, +1, +2) with `VLLMJudge`'s exact
yes/no probability, and counts the pairs where ``P(yes) > 0.5`` is the truth. Controls, each a deliberate
break: the verdict words swapped (``yes_word=no``, ``no_word=yes``), and the reference answer left out of
the prompt. Writes bench/results/generative_judge.{md,json}.

    OMP_NUM_THREADS=1 python bench/generative_judge.py
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hflow.config_schema import default_config  # noqa: E402
from hflow.tasks.judge_task import ensure_judge_assets, judge_pairs  # noqa: E402
from hflow.workers.generative_judge import VLLMJudge  # noqa: E402


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
    ])


def main() -> int:
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
              "judge_info": {k: info[k] for k in ("spec", "num_train", "num_val", "pretrain", "base_model")}}
    text = render(result)
    for suffix, content in ((".json", json.dumps(result, indent=1) + "\n"), (".md", text)):
        (ROOT / "bench" / "results" / f"generative_judge{suffix}").write_text(content)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
