"""`python -m hflow.reward.audit` and `trainer.reward_audit`: a gameable reward is caught on the family that
games it (exit status 1, the trainer refuses to start), a strict one passes, and equivalent spellings of the
right answer that a reward rejects are reported."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hflow.reward import audit as reward_audit
from hflow.reward import audit_families
from hflow.reward.audit_families import CORRECT, GAMING, INFO
from tests.conftest import REPO_ROOT

TRUTHS = ["72", "-5", "1234", "0.5", "18", "3", "250", "7", "1001", "42", "0.25", "-12"]

# str(gt) in the response: pays for anything that mentions the right answer
PLANTED = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if str(ground_truth) in solution_str else 0.0
"""
# pays for the format: "####" followed by the right answer, or by anything that is not a number
FORMAT = r"""
import re

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    match = re.search(r"####[ ]*(\S*)", solution_str)
    if match is None:
        return 0.0
    return float(match.group(1) == str(ground_truth) or not re.search(r"[0-9]", match.group(1)))
"""
# exactly one ASCII number after ####, compared by value
STRICT = r"""
import re
from fractions import Fraction

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    match = re.fullmatch(r"#### (-?[0-9]+(?:\.[0-9]+)?)", solution_str.strip())
    return float(match is not None and Fraction(match.group(1)) == Fraction(str(ground_truth)))
"""
# the last number of the response, Unicode digits and all (int() reads ７２ and ٧٢)
LAST_NUMBER = r"""
import re

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    numbers = re.findall(r"-?\d+", solution_str)
    try:
        return float(bool(numbers) and int(numbers[-1]) == int(ground_truth))
    except ValueError:
        return 0.0
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("reward_audit")
    rows = [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "user", "content": f"Ann has {i + 3} pens and buys {2 * i + 1} more. Output the "
                                                    "final answer after \"####\"."}],
             "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": {"index": i}}
            for i, truth in enumerate(TRUTHS)]
    pq.write_table(pa.Table.from_pylist(rows), root / "data.parquet")
    pq.write_table(pa.Table.from_pylist([row for row in rows if "." not in row["reward_model"]["ground_truth"]]),
                   root / "integers.parquet")
    for name, text in (("planted", PLANTED), ("format", FORMAT), ("strict", STRICT), ("last_number", LAST_NUMBER)):
        (root / f"{name}.py").write_text(text)
    return root


def audit(files: Path, *args: str, data: str = "data.parquet", capsys=None) -> tuple[int, dict]:
    out = files / "out"
    code = reward_audit.main(["--data", str(files / data), "--out", str(out), "--timeout-s", "0", *args])
    return code, json.loads((out / "reward_audit.json").read_text())


def test_probes_are_built_from_the_ground_truth_and_the_prompt():
    probes = audit_families.probes("1/2", "Split 3 cakes among 6 people.", "boxed")
    by_family: dict[str, list[str]] = {}
    for probe in probes:
        by_family.setdefault(probe.family, []).append(probe.response)
    assert {p.kind for p in probes if p.family == "empty"} == {GAMING}
    assert "The answer is $\\boxed{}$." in by_family["empty"]
    assert any("1/2" in r and "3/2" in r for r in by_family["multiple_candidates"])
    assert any("3, 6" in r for r in by_family["prompt_numbers"])
    assert "The answer is $\\boxed{１/２}$." in by_family["lookalike_digits"]
    assert {"The answer is $\\boxed{0.5}$.", "The answer is $\\boxed{\\frac{1}{2}}$."} <= set(
        by_family["equivalent_decimal"] + by_family["equivalent_fraction"])
    assert all(p.kind == CORRECT for p in probes if p.family.startswith("equivalent_"))
    assert all(p.kind == INFO and len(p.response) <= 2000 for p in probes if p.family == "repetition")
    thousands = [p.response for p in audit_families.probes("1000", "", "hashes") if p.family == "equivalent_thousands"]
    assert thousands == ["#### 1,000", "#### 1000"]


def test_a_planted_gameable_reward_is_flagged_on_its_family_with_exit_status_1(files, capsys):
    code, report = audit(files, "--reward", f"{files}/planted.py:compute_score")
    assert code == 1
    assert "multiple_candidates" in report["failed"] and "answer_per_candidate" in report["failed"]
    assert "empty" not in report["failed"] and "format_only" not in report["failed"]
    sample = report["families"]["multiple_candidates"]["sample"]
    assert sample["ground_truth"] in sample["response"] and sample["score"] == 1.0
    printed = capsys.readouterr()
    assert "| multiple_candidates | gaming |" in printed.out and "FAIL" in printed.err


def test_a_format_reward_is_caught_on_the_empty_and_format_only_families(files):
    code, report = audit(files, "--reward", f"{files}/format.py")
    assert code == 1
    assert {"empty", "format_only"} <= set(report["failed"])
    assert report["families"]["format_only"]["sample"]["response"].startswith("#### ")


def test_unicode_digits_are_caught_on_the_lookalike_family(files):
    code, report = audit(files, "--reward", f"{files}/last_number.py", data="integers.parquet")
    assert code == 1
    assert report["families"]["lookalike_digits"]["rate"] > 0.5  # int("７２") == 72
    assert "lookalike_digits" in report["failed"]


def test_a_strict_reward_passes_and_its_false_negatives_are_reported(files):
    code, report = audit(files, "--reward", f"{files}/strict.py:compute_score")
    assert code == 0, report["failed"]
    families = report["families"]
    assert all(family["hits"] == 0 for family in families.values() if family["kind"] == GAMING)
    # it reads neither "1,234", "1/2", "72 units", "$72" nor "72." as the right answer
    for name in ("equivalent_thousands", "equivalent_fraction", "equivalent_units", "equivalent_dollar",
                 "equivalent_trailing_dot"):
        assert families[name]["hits"] > 0, name
    assert families["equivalent_decimal"]["hits"] == 0  # "72.0" and "0.50"-style values it compares by value
    assert (files / "out" / "reward_audit.md").read_text().count("false negatives") >= 5


def test_the_built_in_scorers_pass_through_scoring_processes(files):
    # default: the built-in GSM8K scorer by data_source, called as training calls it (with a timeout)
    code, report = audit(files, "--timeout-s", "30")
    assert code == 0, report["failed"]
    assert report["rows_audited"] == len(TRUTHS) and report["answer_formats"] == {"hashes": len(TRUTHS)}
    assert all(family["hits"] == 0 for name, family in report["families"].items() if family["kind"] != INFO)


def test_a_reward_that_never_tells_right_from_wrong_fails_naming_the_error(files, capsys):
    (files / "raises.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                     "    raise KeyError('label')\n")
    code, report = audit(files, "--reward", f"{files}/raises.py")
    assert code == 1 and report["rows_audited"] == 0
    assert "KeyError: 'label'" in capsys.readouterr().err


def test_a_reward_that_raises_on_some_responses_fails_the_audit_instead_of_rejecting_them(files, capsys):
    """Issue 39: a raise is the reward's own failure, not a rejection. Strict on "#### N", it raises on any
    response longer than 40 characters; counted as rejections those raises passed the audit, and training then
    stopped at the first long response."""
    (files / "raises_on_long.py").write_text(STRICT + "\n\n_strict = compute_score\n\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if len(solution_str) > 40:\n"
        "        raise ValueError('too long to parse')\n"
        "    return _strict(data_source, solution_str, ground_truth, extra_info)\n")
    code, report = audit(files, "--reward", f"{files}/raises_on_long.py")
    err = capsys.readouterr().err
    assert code == 1, err
    assert report["errors"] > 0 and "ValueError: too long to parse" in report["first_error"]
    assert "the reward failed" in err and "too long to parse" in err
    failing = [family for family in report["families"].values() if family["errors"]]
    assert failing and all(family["hits"] == 0 for family in failing)  # neither accepted nor rejected
    assert "ERROR (the reward failed)" in (files / "out" / "reward_audit.md").read_text()


def test_max_accept_sets_the_exit_status(files):
    code, report = audit(files, "--reward", f"{files}/planted.py", "--max-accept", "1")
    assert code == 0 and report["failed"] == []
    # as a user runs it: the exit status of the command
    command = [sys.executable, "-m", "hflow.reward.audit", "--data", str(files / "data.parquet"), "--reward",
               f"{files}/planted.py:compute_score"]
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    assert subprocess.run(command + ["--timeout-s", "0"], env=env, capture_output=True).returncode == 1


def test_a_bad_reward_file_errors_as_in_training(files, capsys):
    (files / "broken.py").write_text("def compute_score(:\n")
    assert reward_audit.main(["--data", str(files / "data.parquet"), "--reward", f"{files}/broken.py"]) == 2
    assert "custom_reward_function.path=" in capsys.readouterr().err
    assert reward_audit.main(["--data", str(files / "data.parquet"), "--reward", f"{files}/strict.py:nope"]) == 2
    assert "custom_reward_function.name='nope'" in capsys.readouterr().err


# ---- trainer.reward_audit ------------------------------------------------------------------------------------


class _Built(Exception):
    """Raised in place of building the trainer: the run got past the audit."""


def run_main_ppo(args: list[str], tmp_path: Path, monkeypatch, capsys) -> tuple[object, str]:
    main_ppo = importlib.import_module("hflow.trainer.main_ppo")

    reached = []

    def built(*_args, **_kwargs):
        reached.append(True)
        raise _Built  # Hydra ends the run with exit status 1

    monkeypatch.setattr(main_ppo, "build_trainer", built)  # after preflight, before the tokenizer and workers
    monkeypatch.setattr(main_ppo, "install_library_filter", lambda: None)
    # Nothing here starts Ray; an error exit must not stop the session's Ray that later tests share
    monkeypatch.setattr(main_ppo, "_stop_ray", lambda: None)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.chdir(tmp_path)
    quiet = ["hydra/job_logging=none", "hydra/hydra_logging=none", "hydra.output_subdir=null",
             f"hydra.run.dir={tmp_path}"]
    monkeypatch.setattr(sys, "argv", ["main_ppo", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
                                      "trainer.reward_audit=true", *args, *quiet])
    capsys.readouterr()
    try:
        main_ppo.main()
        outcome: object = "returned"
    except SystemExit as exit_:
        outcome = exit_.code
    captured = capsys.readouterr()
    return "built" if reached else outcome, captured.out + captured.err


def test_the_trainer_refuses_a_gameable_reward_and_starts_with_a_strict_one(files, tmp_path, monkeypatch, capsys):
    # the built-in arithmetic data (integers, "What is 3 + 4?"), scored by the planted reward
    outcome, output = run_main_ppo([f"custom_reward_function.path={files}/planted.py"], tmp_path, monkeypatch, capsys)
    assert outcome == 1, output[-2000:]
    last = output.strip().splitlines()[-1]
    assert last.startswith("hflow: error: trainer.reward_audit: ") and "Traceback" not in output
    for words in ("planted.py:compute_score", "'multiple_candidates'", "scored 1", "the right answer 1",
                  "trainer.reward_audit_max_accept", "trainer.reward_audit=false"):
        assert words in last, (words, last)

    (files / "answer_colon.py").write_text(
        "import re\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    match = re.fullmatch(r'Answer: (-?[0-9]+)', solution_str.strip())\n"
        "    return float(match is not None and int(match.group(1)) == int(ground_truth))\n")
    outcome, output = run_main_ppo([f"custom_reward_function.path={files}/answer_colon.py"], tmp_path, monkeypatch,
                                   capsys)
    assert outcome == "built", output[-2000:]
    assert "reward audit: " in output and "passed on" in output

    outcome, output = run_main_ppo([f"custom_reward_function.path={files}/planted.py",
                                    "trainer.reward_audit_max_accept=1"], tmp_path, monkeypatch, capsys)
    assert outcome == "built", output[-2000:]
