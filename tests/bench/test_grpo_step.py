"""bench/grpo_step.py end to end on the built-in model, for hflow and the minimal loop (TRL needs its own
environment and is left to the benchmark itself): both run, do the same work, and the table compares them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from transformers import AutoTokenizer

pytestmark = pytest.mark.slow  # bench plumbing (timed training steps)

ROOT = Path(__file__).resolve().parents[2]


def _tokens_per_iteration(spec: dict, iterations: int) -> list[int]:
    """The tokens each iteration processes, from the prompt file's rows as the benchmark orders them
    (iteration i reads whole batches i*B ... i*B+B-1 of the built-in training file, cycling)."""
    from hflow.tasks.builtin_task import ensure_builtin_assets

    assets = ensure_builtin_assets()
    tokenizer = AutoTokenizer.from_pretrained(assets.model_path)
    rows = pd.read_parquet(assets.train_file)
    B, n, L = spec["batch_prompts"], spec["n"], spec["response_length"]
    counts = []
    for i in range(iterations):
        first = (i % (len(rows) // B)) * B
        prompts = [tokenizer.apply_chat_template(list(p), add_generation_prompt=True)["input_ids"]
                   for p in rows["prompt"][first:first + B]]
        counts.append(n * sum(len(p) for p in prompts) + B * n * L)
    return counts


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
    spec = results["spec"]
    B, n, L = spec["batch_prompts"], spec["n"], spec["response_length"]
    for system in ("hflow", "minimal"):
        entry = results[system]
        assert len(entry["iteration_s"]) == 2, entry
        summary = entry["summary"]
        assert summary["measured_iterations"] == 1 and summary["iteration_s"] > 0 and summary["tokens_per_s"] > 0
        for phase in ("gen", "weight_sync", "ref", "update_actor"):
            assert summary[phase] > 0, (system, phase)
        assert summary.get("old_log_prob", 0.0) == 0.0  # on-policy: no pass of its own (reuse_update_log_probs)
        # the same prompts and the same 0/1 rule: each mean is a whole number of right answers out of B x n
        assert all(abs(r * B * n - round(r * B * n)) < 1e-6 for r in entry["reward_mean"]), entry["reward_mean"]
    # fixed-length responses: both count exactly the work done, the prompts' tokens (counted here with the
    # chat template, as the trainer's dataset applies it) + n x L response tokens per prompt
    tokens = _tokens_per_iteration(spec, iterations=2)
    assert results["hflow"]["tokens_per_iteration"] == results["minimal"]["tokens_per_iteration"] == tokens
    assert results["hflow"]["summary"]["response_length"] == L
    # the table row of hflow carries its time per token relative to the minimal loop: both did the same
    # tokens, so it is the ratio of their measured (second) iterations' times
    table_path = tmp_path / "grpo_step_builtin.md"
    table = table_path.read_text()
    hflow_row = next(line for line in table.splitlines() if line.startswith("| builtin | hflow |"))
    hflow_s, minimal_s = results["hflow"]["iteration_s"][1], results["minimal"]["iteration_s"][1]
    assert f"| {hflow_s / minimal_s:.2f}x |" in hflow_row, (hflow_s, minimal_s, hflow_row)
    assert f"{hflow_s:.2f} [{hflow_s:.2f}-{hflow_s:.2f}]" in hflow_row
    # the actor update's FLOP rate against this CPU's measured peak: hflow's from its perf/mfu/actor, the
    # minimal loop's from its own count of the same update's FLOPs (hflow's counter) over its update time
    peak = report["peak_flops"]
    assert peak == max(report["run_peak_flops"]) and len(report["run_peak_flops"]) == 2  # start and end of run
    hflow = results["hflow"]
    mfu = hflow["mfu_actor"][1]
    # perf/mfu/actor is each worker's rate over the cached peak of its own threads (one each here), averaged
    assert hflow["workers"] == 2 and hflow["cpus_per_worker"] == 1
    rate = mfu * hflow["worker_peak_flops"] * 2
    assert 0 < mfu <= 1 and f"| {rate / 1e9:.0f} ({100 * rate / peak:.0f} %) |" in hflow_row, hflow_row
    minimal = results["minimal"]
    minimal_rate = minimal["update_flops"][1] / minimal["phases_s"]["update_actor"][1]
    minimal_row = next(line for line in table.splitlines() if line.startswith("| builtin | minimal |"))
    assert f"| {minimal_rate / 1e9:.0f} ({100 * minimal_rate / peak:.0f} %) |" in minimal_row, minimal_row
    assert f"peak is {peak / 1e9:.0f} GFLOP/s" in table
    # generation: generated tokens (B x n x L, fixed length) per second of generation, and hflow's ratio
    gen_rates = {k: B * n * L / results[k]["phases_s"]["gen"][1] for k in ("hflow", "minimal")}
    for system, rate in gen_rates.items():
        assert abs(results[system]["summary"]["gen_tokens_per_s"] - rate) < 1e-6 * rate, system
    assert f"| {gen_rates['minimal'] / gen_rates['hflow']:.2f}x |" in hflow_row, hflow_row
    assert "Smoke run" in table  # one measured iteration is not a result, and says so
    # --render rewrites the same report from the stored run, measuring nothing
    table_path.unlink()
    subprocess.run([sys.executable, str(ROOT / "bench" / "grpo_step.py"), "--render", str(report_path),
                    "--workloads", "builtin", "--out", str(tmp_path / "rendered")], cwd=ROOT, check=True,
                   capture_output=True, timeout=120)
    assert (tmp_path / "rendered_builtin.md").read_text().split("\n", 3)[3] == table.split("\n", 3)[3]
