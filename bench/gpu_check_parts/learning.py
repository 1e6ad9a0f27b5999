"""Part a, learning: does hflow's CUDA path learn? The built-in task trained by `python -m
hflow.trainer.main_ppo` with the local backend and the HF rollout on one GPU (a subprocess: fp32 master
weights, bf16 compute), its greedy validation score before and after, and whether it imported Ray or vLLM
(the GPU machines have neither). Target: as on CPU, <= 0.2 before and >= 0.8 after."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .common import ENTRY, REPO, Part

TITLE = "built-in task, local backend, HF rollout, bf16"
TARGET = "val score <= 0.2 before, >= 0.8 after"
VAL_KEY = "val-core/hflow/arithmetic/reward/mean@1"


def run(part: Part, smoke: bool, workdir: Path) -> None:
    run_dir = workdir / "builtin_run"
    run_dir.mkdir(parents=True, exist_ok=True)
    overrides = [
        "trainer.backend=local",
        "actor_rollout_ref.rollout.name=hf",
        "trainer.n_gpus_per_node=1",
        "algorithm.adv_estimator=grpo",
        f"trainer.log_dir={run_dir / 'logs'}",
        f"trainer.default_local_dir={run_dir / 'checkpoints'}",
        "trainer.logger=[console,jsonl]",
        "trainer.resume_mode=disable",
    ]
    if smoke:
        overrides += ["trainer.total_training_steps=1", "trainer.test_freq=1"]
    command = [sys.executable, str(ENTRY), "--_trainer", *overrides]
    part.details.append("command: `python -m hflow.trainer.main_ppo " + " ".join(overrides) + "`")
    log_path = run_dir / "train.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    started = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run(command, cwd=run_dir, stdout=log, stderr=subprocess.STDOUT, env=env,
                              timeout=1800)
    train_s = time.perf_counter() - started
    log_text = log_path.read_text(errors="replace")
    imported = [line for line in log_text.splitlines() if line.startswith("GPU_CHECK_IMPORTED")]
    metrics_file = run_dir / "logs" / "metrics.jsonl"
    records = [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
    keys = [VAL_KEY] if any(VAL_KEY in r for r in records) else sorted(
        {k for r in records for k in r if k.startswith("val-core/") and "/reward/mean@" in k})
    scores = [(r.get("step", r.get("training/global_step")), r[keys[0]]) for r in records if keys and keys[0] in r]
    part.data.update(returncode=proc.returncode, train_seconds=train_s, scores=scores,
                     imports=imported[-1] if imported else None)
    mfu = [r["perf/mfu/actor"] for r in records if "perf/mfu/actor" in r]
    if mfu:
        part.data["perf/mfu/actor"] = statistics.median(mfu)
    if proc.returncode != 0 or not scores:
        tail = "\n".join(log_text.splitlines()[-40:])
        part.status = "ERROR"
        part.result = f"trainer exited with {proc.returncode}, {len(scores)} validation scores"
        part.details.append(f"last lines of the trainer's output:\n\n```\n{tail}\n```")
        return
    before, after = scores[0][1], scores[-1][1]
    part.result = f"validation score {before:.3f} -> {after:.3f} ({len(records)} log lines, {train_s:.0f} s)"
    ok = before <= 0.2 and after >= 0.8
    if imported and ("ray=True" in imported[-1] or "vllm=True" in imported[-1]):
        ok = False
        part.details.append(f"the trainer imported Ray or vLLM: {imported[-1]}")
    part.status = "PASS" if ok else "FAIL"
    part.details.append("validation curve (step, score): " + ", ".join(f"({s}, {v:.3f})" for s, v in scores))
    if imported:
        part.details.append(f"modules: {imported[-1].removeprefix('GPU_CHECK_IMPORTED ')}")
    if mfu:
        part.details.append(f"perf/mfu/actor (median over steps, a 0.4M-parameter model): {statistics.median(mfu):.4f}")


def run_trainer(overrides: list[str]) -> int:
    """The subprocess of part a: main_ppo with these overrides, then which of Ray and vLLM it imported."""
    import runpy

    sys.argv = ["hflow.trainer.main_ppo", *overrides]
    code = 0
    try:
        runpy.run_module("hflow.trainer.main_ppo", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        print(f"GPU_CHECK_IMPORTED ray={'ray' in sys.modules} vllm={'vllm' in sys.modules}", flush=True)
    return code

