"""The suite's two tiers and its duration record (docs/testing.md): the fast tier keeps the README's job and
one real Ray + vLLM + FSDP2 run, a file's tests can sit in both tiers, and a record of a real pytest run
becomes scripts/suite_time.py's tables."""

import importlib
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from tests.conftest import REPO_ROOT

sys.path.insert(0, str(Path(REPO_ROOT) / "scripts"))
import suite_time  # noqa: E402

README_JOB = "tests/trainer/test_builtin_default.py::test_builtin_default_learns_and_prints_no_warning_twice"
END_TO_END = "tests/trainer/test_e2e.py::test_grpo_end_to_end_updates_the_policy"


def markers(node_id: str) -> set[str]:
    """The marks pytest sees on a test function: its own and its module's `pytestmark`."""
    file, name = node_id.split("::")
    module = importlib.import_module(file.removesuffix(".py").replace("/", "."))
    marks = list(getattr(getattr(module, name), "pytestmark", [])) + list(getattr(module, "pytestmark", []))
    return {mark.name for mark in marks}


def test_the_fast_tier_keeps_the_readme_job_and_one_real_end_to_end_run():
    assert "slow" not in markers(README_JOB) and "slow" not in markers(END_TO_END)
    # the end-to-end file's other runs are in the slow tier
    assert "slow" in markers("tests/trainer/test_e2e.py::test_ppo_with_a_critic_end_to_end")


def test_a_record_of_a_real_run_becomes_the_tables(tmp_path):
    # parallel.xml: a real run of pytest, in what pytest-xdist's worker gw1 sees (the variable xdist sets)
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "PYTEST_XDIST_WORKER": "gw1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                          f"--junitxml={tmp_path / 'parallel.xml'}", "tests/utils/test_device.py"],
                         cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    cases = list(ET.parse(tmp_path / "parallel.xml").getroot().iter("testcase"))
    assert len(cases) == 9
    for case in cases:  # tests/conftest.py marks each test's tier and worker
        properties = {p.get("name"): p.get("value") for p in case.iter("property")}
        assert properties == {"tier": "fast", "worker": "gw1"}, properties
    # the other worker's test (20 s), and alone.xml: a slow test (12.5 s), as pytest writes them
    tree = ET.parse(tmp_path / "parallel.xml")
    tree.getroot().find("testsuite").append(ET.fromstring(
        '<testcase classname="tests.test_protocol" name="test_other" time="20.0"><properties>'
        '<property name="tier" value="fast"/><property name="worker" value="gw0"/></properties></testcase>'))
    tree.write(tmp_path / "parallel.xml")
    (tmp_path / "alone.xml").write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" time="14.0">'
        '<testcase classname="tests.trainer.test_multinode" name="test_two_nodes" time="12.5">'
        '<properties><property name="tier" value="slow"/></properties></testcase></testsuite></testsuites>')
    (tmp_path / "run.json").write_text(json.dumps({"commit": "abc1234", "dirty": False, "tier": "whole",
                                                   "started": "then", "load_at_start": "1.0 1.0 1.0", "cpus": 2}))
    text = suite_time.tables(tmp_path, note="a test's own record.")
    assert "commit abc1234, whole run" in text and "a test's own record." in text
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in text.splitlines() if line.startswith("| ")}
    assert rows["parallel"][:4] == ["10", "10", "0", "0"] and rows["alone"][:4] == ["1", "1", "0", "0"]
    assert rows["fast"][0] == "10" and rows["slow"] == ["1", "0", "12", "12"], rows
    assert rows["`tests/utils/test_device.py`"][:2] == ["9", "0"]
    assert rows["`tests/test_protocol.py`"] == ["1", "0", "20.0", "0.0"]
    assert rows["`tests/trainer/test_multinode.py`"] == ["0", "1", "12.5", "12.5"]
    gw1 = sum(float(case.get("time")) for case in cases)
    assert f"parallel: seconds of tests per worker gw0 20, gw1 {gw1:.0f} in" in text, text
