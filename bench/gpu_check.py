"""What only a GPU can show: hflow's CUDA path, measured on one GPU, written to bench/results/gpu_check.md.

    python bench/gpu_check.py [--parts a,b,c,d] [--out bench/results/gpu_check.md]

(`scripts/gpu_check.sh` installs what the machine lacks, runs the tests marked `gpu`, then this.)
It uses the machine's own torch and needs neither Ray nor vLLM: it imports neither, and checks that.

  a. learning: the built-in task trained by `python -m hflow.trainer.main_ppo trainer.backend=local
     actor_rollout_ref.rollout.name=hf trainer.n_gpus_per_node=1` (a subprocess; fp32 master weights,
     bf16 compute, HF generation on the training module): greedy validation score before and after.
     Target: as on CPU (tests/trainer/test_builtin_default.py), <= 0.2 before and >= 0.8 after.
  b. log-prob parity: the built-in model in FSDP2 (bf16 mixed precision, a 1-rank mesh) samples with
     HFRollout; DataParallelPPOActor.compute_log_prob then scores the same tokens with the training
     forward. Mean and max |p_sampler - p_trainer| over the response tokens. Target: mean <= 1e-2.
  c. speed: actor update and log-prob pass of a Qwen2.5-1.5B-shaped model with random weights (built
     from a config, no download) at 4k and 16k tokens per micro-batch (sequences of 1024 tokens, 256
     prompt + 768 response): tokens/s, MFU (hflow.utils.flops_counter), peak GPU memory. Target:
     update MFU >= 35 % at both sizes.
  d. memory: log-probs and entropy (the functions the actor uses) of 32 x 1024 x 151936 bf16 logits,
     without and with autograd. Target: the forward passes (and what autograd keeps for backward) need
     under 4 GiB beyond the logits; the backward's extra (beyond one logits-sized gradient) is reported.

Each part reports PASS or FAIL against its target (ERROR with the traceback if it raised); the exit
status is non-zero when a part (or the gpu tests, given with --tests-rc) did not pass, after the
file is written. Without a CUDA device it refuses to run. `--smoke-cpu` runs every part with tiny
sizes on the CPU, only to test this script's plumbing (tests/bench/test_gpu_check.py): its numbers
mean nothing and only an ERROR fails it.

This file parses the command line, runs the parts and writes the report; each part lives in its own module
of bench/gpu_check_parts/ (learning, logprob_parity, speed, memory; environment and report for the file).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent

if "--smoke-cpu" in sys.argv:  # before hflow's device helper makes its choice
    os.environ["HFLOW_DEVICE"] = "cpu"
if str(REPO) not in sys.path:  # `python bench/gpu_check.py` from a checkout where hflow is not installed
    sys.path.append(str(REPO))
if str(BENCH) not in sys.path:  # the parts' package, beside this file (sys.path[0] when run as a script)
    sys.path.insert(0, str(BENCH))

from gpu_check_parts import PARTS  # noqa: E402
from gpu_check_parts.common import Part  # noqa: E402
from gpu_check_parts.environment import environment  # noqa: E402
from gpu_check_parts.learning import run_trainer  # noqa: E402
from gpu_check_parts.report import write_report  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_trainer"]:
        return run_trainer(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="a,b,c,d", help="comma-separated subset of a,b,c,d")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "gpu_check.md"))
    parser.add_argument("--smoke-cpu", action="store_true", help="tiny sizes on the CPU (tests of this script only)")
    parser.add_argument("--tests-rc", type=int, default=None, help="exit status of `pytest -m gpu` (from gpu_check.sh)")
    parser.add_argument("--tests-summary", default="", help="its summary line")
    args = parser.parse_args(argv)

    import torch

    if not args.smoke_cpu and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device found (torch {torch.__version__}, built for CUDA {torch.version.cuda}); "
              "this check needs an NVIDIA GPU", file=sys.stderr)
        return 2
    if args.smoke_cpu:
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    # Fail loudly if anything below reaches for Ray or vLLM (the GPU machines have neither).
    preloaded = {m for m in ("ray", "vllm") if m in sys.modules}

    env = environment()
    parts: list[Part] = []
    with tempfile.TemporaryDirectory(prefix="hflow-gpu-check-") as tmp:
        for key in [k.strip() for k in args.parts.split(",") if k.strip()]:
            module = PARTS[key]
            part = Part(key, module.TITLE, module.TARGET)
            parts.append(part)
            print(f"gpu_check: part {key}: {part.title} ...", file=sys.stderr, flush=True)
            started = time.perf_counter()
            try:
                module.run(part, args.smoke_cpu, Path(tmp))
            except Exception:  # noqa: BLE001 - reported in the file, and the exit status
                part.status = "ERROR"
                part.result = part.result or traceback.format_exc().strip().splitlines()[-1]
                part.details.append(f"```\n{traceback.format_exc().strip()}\n```")
            part.seconds = time.perf_counter() - started
            print(f"gpu_check: part {key}: {part.status}: {part.result}", file=sys.stderr, flush=True)
    imported = {m for m in ("ray", "vllm") if m in sys.modules} - preloaded
    env["Ray / vLLM imported by this check"] = ", ".join(sorted(imported)) or "neither"
    tests = (args.tests_rc, args.tests_summary or f"exit status {args.tests_rc}") if args.tests_rc is not None else None
    out = Path(args.out)
    write_report(out, env, parts, tests, args.smoke_cpu)
    print(f"gpu_check: wrote {out}", file=sys.stderr)
    if args.smoke_cpu:
        failed = [p.key for p in parts if p.status == "ERROR"]
    else:
        failed = [p.key for p in parts if p.status != "PASS"]
        if tests is not None and tests[0] != 0:
            failed.append("gpu tests")
        if imported:
            failed.append("imports")
    if failed:
        print(f"gpu_check: not passed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
