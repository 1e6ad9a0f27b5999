"""bench/actor_speed.py's plumbing on the CPU (tiny shape): a plain arm and hflow arms run on the same weights and
batch, each row has its times, profile counts, MFU in both conventions and its log-prob difference to the plain
loop; an arm whose needs are missing is recorded, not run; the table and the JSON are written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # bench plumbing

ROOT = Path(__file__).resolve().parents[2]


def test_actor_speed_runs_on_cpu(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HFLOW_DEVICE": "cpu"}
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "actor_speed.py"), "--device", "cpu", "--arms",
                          "P0,H1,H4", "--repeats", "1", "--out", str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "actor_speed.json").read_text())
    rows = {r["arm"]: r for r in result["rows"]}
    assert rows["H4"]["status"] == "SKIPPED" and "CUDA" in rows["H4"]["note"]
    for key in ("P0", "H1"):
        row = rows[key]
        assert row["status"] == "OK", row
        for metric in ("update_s", "logprob_s", "logprob_entropy_s", "update_mfu_hflow", "update_mfu_verl"):
            assert row[metric] > 0, (key, metric)
        assert row["aten_ops"] > 100 and row["cpu_op_s"] > 0
        # verl counts the LM head and the embedding on every token: more FLOPs for the same time
        assert row["update_mfu_verl"] > row["update_mfu_hflow"]
    assert rows["P0"]["max_abs_logprob_diff"] == 0.0  # the reference itself
    # hflow (fp32 on CPU) against the plain loop under bf16 autocast: the same model, bf16 rounding apart
    assert 0 < rows["H1"]["max_abs_logprob_diff"] < 0.05
    table = (tmp_path / "actor_speed.md").read_text()
    assert "| H1 |" in table and "| H4 |" in table and "SKIPPED" in table


def test_the_gsm8k_workload_runs_on_cpu(tmp_path):
    """`--workload gsm8k` end to end on the tiny shape: every arm the CPU can run measures its three phases (old
    and reference log-probs, the two-mini-batch update with the KL loss), the FSDP2 arm really wraps the one
    rank and the defaults' arm does not, the memory plan's figure sits beside the measurement, and the arms
    that need CUDA are recorded as skipped."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HFLOW_DEVICE": "cpu"}
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "actor_speed.py"), "--workload", "gsm8k",
                          "--device", "cpu", "--out", str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "actor_speed_gsm8k.json").read_text())
    rows = {r["arm"]: r for r in result["rows"]}
    assert list(rows) == ["G0", "G1", "G2", "G3", "P", "G0b"]
    assert rows["G2"]["status"] == rows["G3"]["status"] == "SKIPPED"
    for key in ("G0", "G1", "P", "G0b"):
        row = rows[key]
        assert row["status"] == "OK", row
        for phase in ("old_log_prob_s", "ref_log_prob_s", "update_actor_s"):
            assert row[phase] > 0, (key, phase)
        assert row["step_s"] == row["old_log_prob_s"] + row["ref_log_prob_s"] + row["update_actor_s"]
        assert row["update_mfu"] > 0
    assert rows["G1"]["fsdp2"] and not rows["G0"]["fsdp2"]
    assert rows["G0"]["kl_loss"] != 0  # the KL loss is on (the reference differs after the first update)
    assert rows["G0"]["predicted_update_gib"] > 0
    assert result["workload"]["tokens"] < result["workload"]["sequences"] * 64  # variable lengths, not padded rows
    assert "| G1 |" in (tmp_path / "actor_speed_gsm8k.md").read_text()
