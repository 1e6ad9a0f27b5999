"""Check the memory plan against the real run's tensors on CPU, and plan Qwen2.5-7B on 8 x 80 GB.

    python bench/memory_plan.py [--models builtin,smollm2] [--out bench/results/memory_plan.md]

For each model and setting (batch, lengths, micro-batches, gradient checkpointing, remove-padding, world
size) the plan (`hflow.cli.memory_plan.plan_memory`, fake tensors in a fake process group) gives, per
phase that torch runs, the pass's peak as the memory tracker counts it. The same tracker
(`FSDPMemTracker`; torch's `MemTracker` where `apply_fsdp2` leaves one rank's model plain) then counts the
real run: W gloo processes on this CPU, the model's real weights read by hflow's loader, sharded by
`apply_fsdp2`, and hflow's own `DataParallelPPOActor` / `DataParallelPPOCritic`
doing `compute_log_prob`, `compute_values`, `update_policy` and `update_critic` on a batch of full-length
sequences (each update is counted on its second step: AdamW's moments exist). The table gives plan,
counted and their ratio per phase; the check is |ratio - 1| <= 10 %.

Then the plan of Qwen2.5-7B (config.json written from its public values; no weights exist here) on
8 GPUs of 80 GB with the settings of examples/gsm8k/run_qwen2_5_3b_grpo.sh, the command and its output.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GIB = 2**30
TOLERANCE = 0.10

# (name, world, overrides) per model; sizes in sequences per rank
SETTINGS = {
    "builtin": [
        ("P64 L64, micro 16/8", 1, ["data.max_prompt_length=64", "data.max_response_length=64",
                                    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
                                    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16",
                                    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
                                    "critic.ppo_micro_batch_size_per_gpu=8"]),
        ("P128 L256, micro 8/4, checkpointing", 1, [
            "data.max_prompt_length=128", "data.max_response_length=256",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "critic.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.model.enable_gradient_checkpointing=true",
            "critic.model.enable_gradient_checkpointing=true"]),
        ("P256 L512, micro 4/2, remove-padding, 2 ranks", 2, [
            "data.max_prompt_length=256", "data.max_response_length=512",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "critic.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.model.use_remove_padding=true", "critic.model.use_remove_padding=true"]),
    ],
    "smollm2": [
        ("P64 L64, micro 8/4", 1, ["data.max_prompt_length=64", "data.max_response_length=64",
                                   "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
                                   "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
                                   "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"]),
        ("P128 L256, micro 4/2, checkpointing", 1, [
            "data.max_prompt_length=128", "data.max_response_length=256",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.model.enable_gradient_checkpointing=true"]),
        ("P128 L384, micro 2/1, remove-padding, entropy, 2 ranks", 2, [
            "data.max_prompt_length=128", "data.max_response_length=384",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "actor_rollout_ref.actor.entropy_coeff=0.001",
            "actor_rollout_ref.model.use_remove_padding=true"]),
    ],
}
COMMON = {"builtin": [], "smollm2": ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4",
                                      "actor_rollout_ref.actor.use_kl_loss=true", "data.train_batch_size=8",
                                      "actor_rollout_ref.actor.ppo_mini_batch_size=4"]}

# Qwen2.5-7B's config.json (public values: huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json)
QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
    "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
    "max_position_embeddings": 131072, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "hidden_act": "silu",
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False, "sliding_window": 131072,
    "max_window_layers": 28, "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151643,
    "initializer_range": 0.02, "use_cache": True,
}
# examples/gsm8k/run_qwen2_5_3b_grpo.sh's settings, with Qwen2.5-7B
GSM8K_GRPO = [
    "algorithm.adv_estimator=grpo", "data.train_batch_size=1024", "data.max_prompt_length=512",
    "data.max_response_length=1024", "actor_rollout_ref.model.enable_gradient_checkpointing=true",
    "actor_rollout_ref.actor.ppo_mini_batch_size=256", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.n=5",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32", "algorithm.use_kl_in_reward=false",
    "trainer.n_gpus_per_node=8", "trainer.nnodes=1",
]

# verl's examples/grpo_trainer/run_qwen2_5-7b_math.sh (Qwen2.5-7B-Instruct, 16 GPUs), in hflow's keys
VERL_7B_MATH = [
    "algorithm.adv_estimator=grpo", "data.train_batch_size=1024", "data.max_prompt_length=1024",
    "data.max_response_length=1024", "actor_rollout_ref.model.use_remove_padding=true",
    "actor_rollout_ref.actor.ppo_mini_batch_size=256", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.model.enable_gradient_checkpointing=true",
    "actor_rollout_ref.actor.fsdp_config.param_offload=false", "actor_rollout_ref.actor.fsdp_config.optimizer_offload=false",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.6", "actor_rollout_ref.rollout.n=5",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16", "actor_rollout_ref.ref.fsdp_config.param_offload=true",
    "algorithm.use_kl_in_reward=false", "trainer.n_gpus_per_node=16", "trainer.nnodes=1",
]
QWEN_RUNS = [
    ("hflow's GSM8K GRPO example settings (examples/gsm8k/run_qwen2_5_3b_grpo.sh) with Qwen2.5-7B, 8 x 80 GB",
     GSM8K_GRPO),
    ("verl's examples/grpo_trainer/run_qwen2_5-7b_math.sh settings in hflow's keys, 16 x 80 GB", VERL_7B_MATH),
]


def qwen_folder() -> Path:
    from hflow.utils.cache import default_cache_root

    folder = default_cache_root() / "memory_plan" / "qwen2.5-7b"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(QWEN25_7B, indent=2))
    return folder


def smollm2_path() -> str:
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "smollm2_arith" / "prepare_model.py")],
                         check=True, text=True, capture_output=True).stdout
    return out.strip().splitlines()[-1]


# ----------------------------------------------------------------------------------------- counting


def _count_worker(rank: int, world: int, jobs: list[dict], port: int, out_file: str) -> None:
    """One of `world` gloo ranks: every job's real pass under the memory tracker; rank 0 writes the counts."""
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    from hflow.cli.memory_trace import PassSpec, count_real_pass

    results = []
    for job in jobs:
        spec = PassSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in job["spec"].items()})
        results.append(count_real_pass(job["phase"], spec, OmegaConf.create(job["config"]), mesh))
    if rank == 0:
        Path(out_file).write_text(json.dumps(results))
    dist.destroy_process_group()


def count_jobs(world: int, jobs: list[dict]) -> list[dict[str, int]]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "counts.json")
        mp.spawn(_count_worker, args=(world, jobs, port, out), nprocs=world, join=True)
        return json.loads(Path(out).read_text())


# ------------------------------------------------------------------------------------------------ main


def check_model(name: str, model_path: str | None, rows: list, settings=None) -> None:
    from dataclasses import asdict

    from omegaconf import OmegaConf

    from hflow.cli import memory_plan as mp

    for label, world, overrides in settings or SETTINGS[name]:
        args = [*COMMON[name], *overrides, "trainer.backend=ray" if world > 1 else "trainer.backend=local",
                f"trainer.n_gpus_per_node={world}"]
        if model_path:
            args.append(f"actor_rollout_ref.model.path={model_path}")
        config = mp.compose(args)
        start = time.perf_counter()
        plan = mp.plan_memory(config, "cpu")
        plan_s = time.perf_counter() - start
        phases = [p for p in plan.phases if p.spec is not None]
        jobs = [{"phase": p.name, "spec": asdict(p.spec), "config": OmegaConf.to_container(config, resolve=True)}
                for p in phases]
        start = time.perf_counter()
        counts = count_jobs(world, jobs)
        count_s = time.perf_counter() - start
        for phase, counted in zip(phases, counts):
            rows.append({"model": name, "setting": label, "world": world, "phase": phase.name,
                         "plan": phase.traced, "counted": counted["Total"], "ratio": phase.traced / counted["Total"],
                         "plan_by_category": {k: v for k, v in _by_cat(phase)}, "counted_by_category": counted,
                         "plan_s": plan_s, "count_s": count_s, "overrides": args})
            print(f"{name:8s} {label:50s} {phase.name:14s} plan {phase.traced / 2**20:9.1f} MiB  counted "
                  f"{counted['Total'] / 2**20:9.1f} MiB  ratio {rows[-1]['ratio']:.3f}", flush=True)


def _by_cat(phase):
    from hflow.cli.memory_facts import trace

    return trace(phase.spec).items()


def qwen_plan(args: list[str]) -> tuple[str, str]:
    """The CLI's plan of Qwen2.5-7B with `args`: (the command, its output)."""
    folder = qwen_folder()
    args = [*args, f"actor_rollout_ref.model.path={folder}"]
    command = ["python", "-m", "hflow.cli.memory_plan", "--target", "cuda", "--device-memory-gb", "80", *args]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    start = time.perf_counter()
    result = subprocess.run([sys.executable, *command[1:]], cwd=ROOT, env=env, text=True, capture_output=True)
    seconds = time.perf_counter() - start
    shown = " ".join(command).replace(str(folder), "$HFLOW_CACHE/memory_plan/qwen2.5-7b")
    return shown, result.stdout.strip() + f"\n\n(exit status {result.returncode}, {seconds:.0f} s)"


def write_md(rows: list, qwen: list | None, out: Path, argv: list[str]) -> None:
    lines = ["# Memory plan vs the real run's tensors on CPU", "",
             f"Command: `{' '.join(['OMP_NUM_THREADS=1 python bench/memory_plan.py', *argv])}`", "",
             "Plan: `hflow.cli.memory_plan.plan_memory(config, 'cpu')`, the traced part of each phase (the pass "
             "on fake tensors in a fake process group of the run's world size). Counted: the same tracker "
             "(`FSDPMemTracker`; at W = 1, where `apply_fsdp2` leaves a model that nothing casts plain, torch's "
             "`MemTracker`) around hflow's `DataParallelPPOActor` / `DataParallelPPOCritic` on real "
             "weights, sharded by `apply_fsdp2` over W gloo processes (rank 0's count); updates counted on "
             "their second step. Every sequence is full length (the plan's worst case). "
             f"Check: |plan / counted - 1| <= {TOLERANCE:.0%}. Both sides are the tracker's count of live tensor "
             "storage; neither is the allocator's reserved memory nor the process's RSS.", "",
             "| model | setting | W | phase | plan MiB | counted MiB | plan / counted |", "|---|---|---:|---|---:|---:|---:|"]
    for r in rows:
        flag = "" if abs(r["ratio"] - 1) <= TOLERANCE else " **out**"
        lines.append(f"| {r['model']} | {r['setting']} | {r['world']} | {r['phase']} | {r['plan'] / 2**20:.1f} | "
                     f"{r['counted'] / 2**20:.1f} | {r['ratio']:.3f}{flag} |")
    if rows:
        worst = max(rows, key=lambda r: abs(r["ratio"] - 1))
        lines += ["", f"Largest deviation: ratio {worst['ratio']:.3f} ({worst['model']}, {worst['setting']}, "
                      f"{worst['phase']}); {sum(abs(r['ratio'] - 1) <= TOLERANCE for r in rows)} of {len(rows)} "
                      "phases within 10 %.", "", "Overrides per setting (beside the model path):", ""]
        seen = set()
        for r in rows:
            key = (r["model"], r["setting"])
            if key not in seen:
                seen.add(key)
                lines.append(f"- {r['model']}, {r['setting']}: `{' '.join(r['overrides'])}`")
    lines += ["", NOT_CHECKED]
    if qwen:
        lines += ["", "## Qwen2.5-7B on 80 GB GPUs (plans only: no GPU here)", "",
                  "Model config: Qwen2.5-7B's public config.json values (hidden 3584, 28 layers, 28 heads, 4 KV heads, "
                  "intermediate 18944, vocab 152064, untied embeddings), written by this script to "
                  "`$HFLOW_CACHE/memory_plan/qwen2.5-7b/config.json`; no weights."]
        for title, (command, output) in qwen:
            lines += ["", f"### {title}", "", "```", command, "```", "", "```", output, "```"]
        lines += ["", VERL_NOTE]
    out.write_text("\n".join(lines) + "\n")


NOT_CHECKED = """## What the GPU figures rest on that this CPU check cannot see

- **The caching allocator.** torch's CUDA allocator rounds blocks and keeps freed ones; fragmentation can add
  10-30 % to `max_memory_reserved` over the tensors' peak. The plan adds an *assumed* 10 % (`allocator_slack`).
- **CUDA context, cuBLAS/cuDNN workspaces, NCCL communicators**: *assumed* 0.6 GiB and 0.5 GiB per process;
  NCCL's real buffers depend on NCCL_BUFFSIZE, channels and the number of peers.
- **vLLM's own accounting.** On a GPU vLLM takes `gpu_memory_utilization` x the device and sizes the KV cache
  from its own profiling run (weights, a dummy step of `max_num_batched_tokens`, CUDA graphs, its non-torch
  memory). The plan replaces that run by the HF model's forward on the same tokens (per-sequence attention)
  and an *assumed* 0.5 GiB of non-torch memory; the engine's total is exact by construction
  (`gpu_memory_utilization` x device), the split between activations and KV cache is not checked.
  What a sleeping engine keeps (level 2) is *assumed* 0.5 GiB.
- **Attention kernels.** On a GPU the plan traces PyTorch SDPA (flash-like memory: no T x T scores);
  flash-attention's varlen kernel and its workspace are not traced. On CPU `hflow_sdpa_varlen` is traced
  and counted alike.
- **AdamW's multi-tensor (foreach) path**, the default for CUDA tensors, is traced with `foreach=True` on fake
  CPU tensors; the CPU check runs the per-parameter path.
- **Offloading's pinned host buffers and the timing of overlapped all-gathers/prefetch** (FSDP2 prefetches the
  next layer during the current one's compute): the fake process group runs collectives synchronously; the
  tracker counts the all-gather buffers FSDP2 allocates, not the streams' timing.
- **vLLM on CPU** (weights prepacked by oneDNN, `kv_cache_memory_bytes`) is outside torch's dispatch: its figures
  are formulas here, not counted by the tracker.
"""


VERL_NOTE = """## verl's published figures for this setting (for comparison; not measured here)

- verl's `docs/perf/device_tuning.rst` ("Resource Needed for verl RL") lists, for 7B, Qwen2-7B GRPO at a
  **minimum of 2 x H800 (80 GB)** with FSDP + vLLM 0.8.2 (`examples/tuning/7b/qwen2-7b_grpo_2_h800_fsdp_vllm.sh`,
  the minimum-resource script: every memory saving on); no per-phase peak memory is given.
- verl's `examples/grpo_trainer/run_qwen2_5-7b_math.sh` runs Qwen2.5-7B-Instruct GRPO on 16 GPUs with batch 1024,
  prompt 1024 + response 1024, mini-batch 256, micro-batch 16 (log-prob micro-batches 16), gradient
  checkpointing, remove-padding, tensor parallel 2, `gpu_memory_utilization=0.6`, n=5, reference parameters
  offloaded; its plan in hflow's keys is the second Qwen2.5-7B plan above.
- verl's `docs/perf/perf_tuning.rst`: from vLLM 0.7 the engine uses `gpu_memory_utilization` of the *total*
  memory, and "a value between 0.5 and 0.7 often strikes a good balance between high throughput and avoiding
  OOM" when parameters and optimizer state are not offloaded (the plan's rollout row: the engine's 0.6 x 80 GB
  beside the trainer's resident shards).
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="builtin,smollm2")
    parser.add_argument("--no-qwen", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "memory_plan.md"))
    args = parser.parse_args()
    rows: list = []
    for name in [m for m in args.models.split(",") if m]:
        check_model(name, smollm2_path() if name == "smollm2" else None, rows)
    qwen = None if args.no_qwen else [(title, qwen_plan(run)) for title, run in QWEN_RUNS]
    for title, (command, output) in qwen or []:
        print(f"{title}\n{command}\n{output}")
    out = Path(args.out)
    write_md(rows, qwen, out, sys.argv[1:])
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
