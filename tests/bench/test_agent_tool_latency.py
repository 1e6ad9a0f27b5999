"""bench/agent_tool_latency.py on the real engine: slow tools run side by side, and a slow tool delays
only its own sample (the numbers are the benchmark's; the bounds here only separate concurrent from serial)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.alone, pytest.mark.slow]  # tool overlap measured in wall time; slow: bench plumbing

ROOT = Path(__file__).resolve().parents[2]


def test_sleeping_tools_overlap_and_a_slow_tool_delays_only_its_sample(tmp_path):
    out = tmp_path / "latency"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "agent_tool_latency.py"), "--samples", "32", "--sleep-s", "1",
         "--slow-s", "3", "--repeats", "1", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    # 32 calls of 1 s: serial would add 32 s; side by side about 1 s (+ scheduling noise on 2 busy cores)
    assert result["added_s"] < 8, result
    # the 31 fast samples are done long before the slow call returns
    assert result["other_samples_end_s"] < result["one_slow_sample_end_s"] - 1.5, result
    assert "| **added by the sleeping tools** |" in out.with_suffix(".md").read_text()
