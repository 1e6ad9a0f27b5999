"""Time and peak memory of `logprobs_from_logits` + backward against `log_softmax` + `gather`.

    python bench/logprobs.py            # (8, 1024, 32000) fp32 logits (1 GiB); writes bench/results/logprobs.md
    python bench/logprobs.py --quick    # (2, 256, 32000); prints only
    python bench/logprobs.py --device cuda

Each variant runs in its own subprocess so that its peak memory is its own. On CPU the peak is the
process's maximum resident set size (`getrusage`) minus the resident size just before the measured call
(the logits and labels are already allocated, so the number is the *extra* memory of forward +
backward); on CUDA it is `max_memory_allocated` minus the allocated memory before the call. The logits
are a leaf that requires grad, like the output of the LM head; the gradient is returned by
`torch.autograd.grad` and dropped. Times are the median of `--repeats` runs after the measured one.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from hflow.utils.torch_functional import logprobs_from_logits  # noqa: E402

FULL_SHAPE = (8, 1024, 32000)
QUICK_SHAPE = (2, 256, 32000)
MIB = 1 << 20


def naive_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The textbook version: full log-softmax, then pick the label column."""
    return torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


VARIANTS = {"naive": naive_logprobs, "fused": logprobs_from_logits}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def run_variant(name: str, shape: tuple[int, int, int], repeats: int, device: str) -> dict:
    """Measure one variant in this process: peak extra memory of the first call, then timings."""
    fn = VARIANTS[name]
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(shape, generator=gen, device=device).requires_grad_()
    labels = torch.randint(0, shape[-1], shape[:-1], generator=gen, device=device)
    grad_out = torch.randn(shape[:-1], generator=gen, device=device)

    def step() -> None:
        out = fn(logits, labels)
        (grad,) = torch.autograd.grad(out, logits, grad_out)
        del grad

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    if device == "cuda":
        step()  # CUDA: warm up kernels first; the allocator's peak counter is reset below
        sync()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        sync()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        before = _rss_bytes()
        step()
        peak = _max_rss_bytes() - before

    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return {"variant": name, "peak_bytes": peak, "median_s": statistics.median(times), "times_s": times}


def measure_in_subprocess(name: str, shape: tuple[int, int, int], repeats: int, device: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", name, "--shape", *map(str, shape), "--repeats", str(repeats)]
    out = subprocess.run([*cmd, "--device", device], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def markdown_table(shape: tuple[int, int, int], device: str, results: dict[str, dict]) -> str:
    logits_mib = shape[0] * shape[1] * shape[2] * 4 / MIB
    naive, fused = results["naive"], results["fused"]
    where = torch.cuda.get_device_name() if device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    lines = [
        f"logits {tuple(shape)} float32 ({logits_mib:.0f} MiB), forward + backward, {where}, torch {torch.__version__}",
        "",
        "| variant | time, median (min) | peak extra memory |",
        "|---|---:|---:|",
    ]
    for label, r in (("`log_softmax` + `gather` (naive)", naive), ("`logprobs_from_logits` (fused)", fused)):
        times = f"{r['median_s'] * 1e3:.0f} ms ({min(r['times_s']) * 1e3:.0f} ms)"
        lines.append(f"| {label} | {times} | {r['peak_bytes'] / MIB:.0f} MiB |")
    lines.append(
        f"| naive / fused | {naive['median_s'] / fused['median_s']:.2f}x "
        f"({min(naive['times_s']) / min(fused['times_s']):.2f}x) | "
        f"{naive['peak_bytes'] / max(fused['peak_bytes'], 1):.2f}x |"
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"small shape {QUICK_SHAPE}, no results file")
    parser.add_argument("--shape", type=int, nargs=3, metavar=("B", "T", "V"), help="override the logits shape")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per variant (median reported)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--output", type=Path, help="markdown results file (default run: bench/results/logprobs.md)")
    parser.add_argument("--worker", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args()

    shape = tuple(args.shape or (QUICK_SHAPE if args.quick else FULL_SHAPE))
    if args.worker:
        print(json.dumps(run_variant(args.worker, shape, args.repeats, args.device)))
        return

    results = {name: measure_in_subprocess(name, shape, args.repeats, args.device) for name in VARIANTS}
    table = markdown_table(shape, args.device, results)
    print(table)
    output = args.output or (None if args.quick or args.shape else REPO_ROOT / "bench/results/logprobs.md")
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text("# `logprobs_from_logits` benchmark\n\n" + table)
        print(f"written to {output}")


if __name__ == "__main__":
    main()
