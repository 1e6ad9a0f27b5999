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
