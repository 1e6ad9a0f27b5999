"""Reward audit of hflow's own GSM8K and MATH scorers on synthetic rows in their schemas (no downloads).

    .venv/bin/python bench/reward_audit.py [--rows 200] [--out bench/results]

Writes 200 GSM8K-like rows (integer answers, negatives, thousands, decimals) and 200 MATH-like rows
(integers, negatives, decimals, fractions, ``\\frac``, ``\\sqrt``, intervals, tuples, ``\\pi``, text), runs
``python -m hflow.reward.audit`` on each with the built-in scorers (by data_source) and writes
``reward_audit.md`` / ``.json`` with the command, the commit and both tables.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
GSM8K_INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def gsm8k_rows(count: int, rng: random.Random) -> list[dict]:
    rows = []
    for index in range(count):
        a, b, c = rng.randint(2, 60), rng.randint(2, 40), rng.randint(2, 9)
        kind = index % 5
        if kind == 0:
            question, answer = f"Tom has {a} apples and buys {b} bags of {c} apples. How many apples does he have?", a + b * c
        elif kind == 1:
            question, answer = f"A tank holds {a} liters. {a + b} liters are drained from it. What is its level now?", -b
        elif kind == 2:
            price = rng.randint(120, 990)
            question, answer = f"A laptop costs ${price} and {c + 3} are sold. How many dollars is that?", price * (c + 3)
        elif kind == 3:
            question, answer = f"{c * 2} friends share {c} pizzas equally. How many pizzas does each get?", 0.5
        else:
            question, answer = f"A pen costs ${a}.25 and Ann buys {c} pens. How much does she pay?", (a + 0.25) * c
        truth = str(int(answer)) if float(answer).is_integer() else f"{answer:g}"
        rows.append(_row("openai/gsm8k", f"{question} {GSM8K_INSTRUCTION}", truth, index))
    return rows


MATH_ANSWERS = [
    ("What is $3 \\cdot 4 + 5$?", "17"), ("Solve $x + 9 = 2$.", "-7"), ("Compute $1.5 \\times 3$.", "4.5"),
    ("What is $\\frac{3}{6}$ in lowest terms?", "\\frac{1}{2}"), ("What is $6/8$ in lowest terms?", "\\frac{3}{4}"),
    ("Simplify $\\sqrt{8}/2$.", "\\sqrt{2}"), ("Find $\\sqrt{12}$ in simplest form.", "2\\sqrt{3}"),
    ("Solve $x^2 < 4$.", "(-2,2)"), ("For which $x$ is $x \\ge 3$?", "[3,\\infty)"),
    ("What is the midpoint of $(0,0)$ and $(4,6)$?", "(2,3)"), ("Area of a circle of radius 3?", "9\\pi"),
    ("What is $\\frac{1}{4} + \\frac{1}{4} + \\frac{1}{4}$?", "\\frac{3}{4}"), ("What is $2^{10}$?", "1024"),
    ("How many seconds in 2 hours?", "7200"), ("What is $-\\frac{2}{3} \\cdot 3 / 4$?", "-\\frac{1}{2}"),
    ("What is $0.2 + 0.05$?", "0.25"), ("Which day comes after Monday?", "\\text{Tuesday}"),
    ("Solve $x^2 = 9$ (both roots).", "-3, 3"), ("What is $\\frac{7}{2}$ as a mixed number's value?", "\\frac{7}{2}"),
    ("What is $12 \\cdot 11$?", "132"),
]


def math_rows(count: int, rng: random.Random) -> list[dict]:
    rows = []
    for index in range(count):
        question, truth = MATH_ANSWERS[index % len(MATH_ANSWERS)]
        if truth.lstrip("-").isdigit() and index >= len(MATH_ANSWERS):  # vary the integers
            shift = rng.randint(1, 40)
            question, truth = f"{question[:-1]} plus {shift}?", str(int(truth) + shift)
        rows.append(_row("lighteval/MATH", f"{question} {MATH_INSTRUCTION}", truth, index))
    return rows


def _row(data_source: str, prompt: str, truth: str, index: int) -> dict:
    return {"data_source": data_source, "prompt": [{"role": "user", "content": prompt}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": {"split": "test", "index": index}}


BEFORE_WRAPPER = """
import importlib.util

def _load(name):
    spec = importlib.util.spec_from_file_location("before_" + name, __file__.rsplit("/", 1)[0] + f"/{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

_GSM8K, _MATH = _load("gsm8k"), _load("math")

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    scorer = _GSM8K if data_source == "openai/gsm8k" else _MATH
    return float(scorer.compute_score(solution_str, ground_truth))
"""


def scorers_at(rev: str, folder: Path) -> str:
    """A reward file that scores with the GSM8K and MATH scorers as they were at `rev`."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("gsm8k", "math"):
        source = subprocess.run(["git", "show", f"{rev}:hflow/reward/score/{name}.py"], cwd=ROOT, check=True,
                                capture_output=True, text=True).stdout
        (folder / f"{name}.py").write_text(source)
    (folder / "before_reward.py").write_text(BEFORE_WRAPPER)
    return f"{folder / 'before_reward.py'}:compute_score"


def run_audit(path: Path, out: Path, reward: str | None) -> tuple[int, dict, str]:
    command = [sys.executable, "-m", "hflow.reward.audit", "--data", str(path), "--out", str(out)]
    proc = subprocess.run(command + (["--reward", reward] if reward else []), cwd=ROOT, capture_output=True, text=True)
    if proc.returncode not in (0, 1):
        sys.exit(proc.stderr)
    return proc.returncode, json.loads((out / "reward_audit.json").read_text()), (out / "reward_audit.md").read_text()


NOTES = """What the audit found before (at the --before commit) and what changed:

- GSM8K paid for several answers: `#### 264 or 265` (the first number after the marker counted) and one
  `####` per candidate (the last marker counted). Now a marker followed by more digits on its line, or markers
  with different numbers, earn `format_score`. `tests/reward/test_score.py` changed with it: "First guess
  #### 10, corrected: #### 72" scored 1 and now scores 0 (two different answers).
- GSM8K rejected `#### 1/2` (and `\\frac{1}{2}`) for a ground truth of 0.5; it now compares fractions by value.
- MATH paid for one `\\boxed{}` per candidate (the last box counted); several different boxed answers now score 0.
- MATH rejected `17.0`, `17.`, `9/2` for 4.5 and `1,024` for 1024 (string comparison after normalisation;
  the test that `0.25` differs from `\\frac14` was the documented old behaviour and is now an equivalence):
  answers that normalise to plain numbers are compared by value.
- Look-alike digits (fullwidth, Arabic-Indic, ...) were already rejected by both (their patterns are ASCII
  `[0-9]`); the audit counts accepting them as gaming. `repetition` (the right answer repeated to the
  maximum length) is reported, never failing: a correctness reward is right to accept it.

"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--data-dir", help="where to write the parquet files (default: a temporary folder)")
    parser.add_argument("--before", default="6451234",
                        help="also audit the scorers as they were at this commit (default: before the audit's fixes)")
    args = parser.parse_args()
    rng = random.Random(0)
    data_dir = Path(args.data_dir or tempfile.mkdtemp(prefix="reward_audit_"))
    data_dir.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "hflow/reward/score"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    before = scorers_at(args.before, data_dir / "before") if args.before else None
    sections, results = [], {}
    for name, rows in (("gsm8k", gsm8k_rows(args.rows, rng)), ("math", math_rows(args.rows, rng))):
        path = data_dir / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
        runs = ([("before", f"the scorers at {args.before}", before)] if before else []) + [
            ("after", f"the scorers at {commit}{'+' if dirty else ''} (built-in, by data_source)", None)]
        for label, what, reward in runs:
            code, report, table = run_audit(path, data_dir / f"{name}_{label}", reward)
            results.setdefault(name, {})[label] = {"exit_status": code, **report}
            sections.append(f"## {name}, {label}: {what} (exit status {code})\n\n{table}")
    header = (f"# Reward audit of the built-in GSM8K and MATH scorers\n\n"
              f"`.venv/bin/python bench/reward_audit.py --rows {args.rows} --before {args.before}` at commit "
              f"{commit}{' (with uncommitted changes in hflow/reward/score)' if dirty else ''}: {args.rows} "
              "synthetic rows each (bench/reward_audit.py writes them), `python -m hflow.reward.audit --data "
              "FILE` with the built-in scorers (after) and with the scorers before the audit's fixes (before).\n\n")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "reward_audit.md").write_text(header + NOTES + "\n".join(sections))
    (out_dir / "reward_audit.json").write_text(json.dumps({"commit": commit, "rows": args.rows, **results}, indent=2,
                                                          default=str))
    print(header + "\n".join(sections))


if __name__ == "__main__":
    main()
