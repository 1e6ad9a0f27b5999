"""bench/grpo_step.py end to end on the built-in model, for hflow and the minimal loop (TRL needs its own
environment and is left to the benchmark itself): both run, do the same work, and the table compares them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_grpo_step_builtin_hflow_and_minimal(tmp_path):
    out = tmp_path / "grpo_step"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "grpo_step.py"), "--workloads", "builtin", "--systems", "hflow,minimal",
         "--iterations", "2", "--warmup", "1", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report_path = tmp_path / "grpo_step_builtin.json"  # one report per workload
    report = json.loads(report_path.read_text())
    results = report["results"]["builtin"]
    for system in ("hflow", "minimal"):
        entry = results[system]
        assert len(entry["iteration_s"]) == 2, entry
        summary = entry["summary"]
        assert summary["measured_iterations"] == 1 and summary["iteration_s"] > 0 and summary["tokens_per_s"] > 0
        for phase in ("gen", "weight_sync", "ref", "update_actor"):
            assert summary[phase] > 0, (system, phase)
        assert summary.get("old_log_prob", 0.0) == 0.0  # on-policy: no pass of its own (reuse_update_log_probs)
        # the same prompts and the same rewards function: both saw rewards in [0, 1]
        assert all(0 <= r <= 1 for r in entry["reward_mean"])
    # fixed-length responses: both count the same work (the prompts' tokens + n x 8 per prompt)
    assert results["hflow"]["tokens_per_iteration"] == results["minimal"]["tokens_per_iteration"]
    assert results["hflow"]["summary"]["response_length"] == 8
    # the table row of hflow carries its time per token relative to the minimal loop
    table_path = tmp_path / "grpo_step_builtin.md"
    table = table_path.read_text()
    hflow_row = next(line for line in table.splitlines() if line.startswith("| builtin | hflow |"))
    ratio = results["minimal"]["summary"]["tokens_per_s"] / results["hflow"]["summary"]["tokens_per_s"]
    assert f"{ratio:.2f}x" in hflow_row
    spread = results["hflow"]["summary"]
    assert f"[{spread['iteration_min_s']:.2f}-{spread['iteration_max_s']:.2f}]" in hflow_row
    assert "Smoke run" in table  # one measured iteration is not a result, and says so
    # --render rewrites the same report from the stored run, measuring nothing
    table_path.unlink()
    subprocess.run([sys.executable, str(ROOT / "bench" / "grpo_step.py"), "--render", str(report_path),
                    "--workloads", "builtin", "--out", str(tmp_path / "rendered")], cwd=ROOT, check=True,
                   capture_output=True, timeout=120)
    assert (tmp_path / "rendered_builtin.md").read_text().split("\n", 3)[3] == table.split("\n", 3)[3]
