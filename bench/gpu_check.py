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
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
VAL_KEY = "val-core/hflow/arithmetic/reward/mean@1"
GiB = 2**30

if "--smoke-cpu" in sys.argv:  # before hflow's device helper makes its choice
    os.environ["HFLOW_DEVICE"] = "cpu"
if str(REPO) not in sys.path:  # `python bench/gpu_check.py` from a checkout where hflow is not installed
    sys.path.append(str(REPO))


@dataclass
class Part:
    key: str
    title: str
    target: str
    status: str = "SKIPPED"  # PASS | FAIL | ERROR | SKIPPED
    result: str = ""
    details: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


# ------------------------------------------------------------------------------------------ helpers


def _smi(query: str) -> str:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60).stdout.strip()
        return out.splitlines()[0] if out else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _git_commit() -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=30).stdout.strip()
        return (commit + (" + uncommitted changes" if dirty else "")) if commit else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _environment() -> dict[str, str]:
    import torch
    import transformers

    from hflow.utils import device
    from hflow.utils.flops_counter import device_peak_flops
    from hflow.utils.fsdp_utils import default_attn_implementation

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "CUDA (torch build)": str(torch.version.cuda),
        "transformers": transformers.__version__,
        "hflow commit": _git_commit(),
        "attention implementation": default_attn_implementation(),
    }
    if device.is_cuda():
        peak = device_peak_flops()
        env = {
            "device": f"{torch.cuda.get_device_name(0)} ({torch.cuda.device_count()} visible)",
            "GPU memory": f"{torch.cuda.get_device_properties(0).total_memory / GiB:.1f} GiB",
            "NVIDIA driver": _smi("driver_version"),
            **env,
            "peak bf16 (hflow.utils.flops_counter)": f"{peak / 1e12:.0f} TFLOP/s" if peak else "unknown: no MFU",
        }
    else:
        env = {"device": f"CPU ({os.cpu_count()} cores): --smoke-cpu, numbers are meaningless", **env}
    try:
        from importlib import metadata

        env["flash-attn"] = metadata.version("flash-attn")
    except Exception:  # noqa: BLE001
        env["flash-attn"] = "not installed"
    return env


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_MESH = None


def _mesh():
    """A torch.distributed world of this one process (FSDP2 needs one) and its 1-rank mesh."""
    global _MESH
    if _MESH is None:
        import torch.distributed as dist

        from hflow.utils import device
        from hflow.utils.fsdp_utils import build_device_mesh

        device.set_device()
        if not dist.is_initialized():
            dist.init_process_group(device.dist_backend(), init_method=f"tcp://127.0.0.1:{_free_port()}",
                                    rank=0, world_size=1)
        _MESH = build_device_mesh(1)
    return _MESH


def _sync() -> None:
    from hflow.utils import device

    device.synchronize()


def _cuda_memory() -> tuple[int, int] | None:
    """(allocated, peak allocated) bytes on the GPU; None on CPU."""
    import torch

    from hflow.utils import device

    if not device.is_cuda():
        return None
    return torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()


def _reset_peak() -> None:
    import torch

    from hflow.utils import device

    gc.collect()
    if device.is_cuda():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _actor_config(**overrides):
    """The actor section at the schema's defaults as a worker of one rank normalises it (with the derived
    `ppo_mini_batch_size_per_rank`, in sequences), with `overrides`."""
    from omegaconf import OmegaConf

    from hflow.config_schema import default_section
    from hflow.workers.config import resolved_copy

    config = resolved_copy(default_section("actor_rollout_ref.actor"))
    for key, value in overrides.items():
        OmegaConf.update(config, key, value)
    return config


def _gib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / GiB:.2f} GiB"


# ------------------------------------------------------------------------------- a. learning


def part_a(part: Part, smoke: bool, workdir: Path) -> None:
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
    command = [sys.executable, str(Path(__file__).resolve()), "--_trainer", *overrides]
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


def _run_trainer(overrides: list[str]) -> int:
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


# --------------------------------------------------------------------------- b. log-prob parity


def part_b(part: Part, smoke: bool, workdir: Path) -> None:
    import torch
    from transformers import AutoTokenizer

    from hflow.config_schema import default_section
    from hflow.protocol import DataProto
    from hflow.utils import device
    from hflow.tasks.builtin_task import ensure_builtin_assets
    from hflow.utils.dataset.rl_dataset import RLHFDataset, collate_fn
    from hflow.utils.fsdp_utils import apply_fsdp2, load_causal_lm
    from hflow.workers.actor import DataParallelPPOActor
    from hflow.workers.rollout import HFRollout

    assets = ensure_builtin_assets()
    tokenizer = AutoTokenizer.from_pretrained(assets.model_path)
    n_samples, response_length = (2, 8) if smoke else (8, 8)
    dataset = RLHFDataset(assets.val_file, tokenizer, default_section("data", max_prompt_length=32),
                          files_key="data.val_files")
    items = [dataset[i] for i in range(min(len(dataset), 8 if smoke else 40))]
    prompts = DataProto.from_single_dict(collate_fn(items))
    prompts = prompts.select(batch_keys=["input_ids", "attention_mask", "position_ids"])

    torch.manual_seed(0)
    model = load_causal_lm(assets.model_path, dtype=torch.float32)
    apply_fsdp2(model, _mesh())  # the actor's set-up: fp32 master weights, bf16 compute on GPU
    eos = getattr(model.generation_config, "eos_token_id", None)
    prompts.meta_info.update(eos_token_id=eos if eos is not None else tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
    rollout_config = default_section("actor_rollout_ref.rollout", response_length=response_length, n=n_samples,
                                     temperature=1.0)
    # Not ignore_eos: HF implements it as min_new_tokens, which takes EOS out of the distribution the
    # sampler's log-probs come from, so they would differ from the trainer's by design.
    rollout = HFRollout(model, rollout_config)
    output = rollout.generate_sequences(prompts.to(device.get_device()))
    actor = DataParallelPPOActor(_actor_config(), model)
    output.meta_info.update(temperature=1.0, micro_batch_size=64)
    log_probs, _ = actor.compute_log_prob(output)

    mask = output.batch["attention_mask"][:, -response_length:].bool()
    sampler = output.batch["rollout_log_probs"].float()[mask]
    trainer = log_probs.float()[mask]
    dp = (sampler.exp() - trainer.exp()).abs()
    dlogp = (sampler - trainer).abs()
    mean_dp, max_dp = float(dp.mean()), float(dp.max())
    part.data.update(tokens=int(mask.sum()), mean_abs_dp=mean_dp, max_abs_dp=max_dp,
                     mean_abs_dlogp=float(dlogp.mean()), max_abs_dlogp=float(dlogp.max()),
                     param_dtype=str(next(iter(model.parameters())).dtype))
    part.result = f"mean |Δp| {mean_dp:.2e}, max |Δp| {max_dp:.2e} over {int(mask.sum())} tokens"
    part.status = "PASS" if mean_dp <= 1e-2 else "FAIL"
    part.details += [
        f"model: the built-in model ({assets.model_path}), {len(items)} validation prompts x {n_samples} samples "
        f"x up to {response_length} tokens at temperature 1; the response tokens up to and including EOS count",
        "sampler: `HFRollout` (HF `generate`, KV cache) on the FSDP2 module; trainer: "
        "`DataParallelPPOActor.compute_log_prob` on the same module (full forward); both in "
        f"{'bf16 (FSDP2 mixed precision)' if device.is_cuda() else 'fp32'}",
        f"|Δ log p|: mean {float(dlogp.mean()):.2e}, max {float(dlogp.max()):.2e}",
    ]
    del model, actor, rollout


# ------------------------------------------------------------------------------------ c. speed


def _qwen_1_5b_config(smoke: bool):
    from transformers import Qwen2Config

    if smoke:
        return Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=128, vocab_size=512, max_position_embeddings=256,
                           tie_word_embeddings=True)
    return Qwen2Config(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                       intermediate_size=8960, vocab_size=151936, max_position_embeddings=32768,
                       rope_theta=1_000_000.0, tie_word_embeddings=True, rms_norm_eps=1e-6)


def _speed_once(config, seqs_per_micro: int, micro_batches: int, prompt_len: int, response_len: int,
                checkpointing: bool, repeats: int) -> dict[str, Any]:
    import torch
    from transformers import Qwen2ForCausalLM

    from hflow.protocol import DataProto
    from hflow.utils import device
    from hflow.utils.flops_counter import device_peak_flops, forward_flops, mfu, training_flops
    from hflow.utils.fsdp_utils import apply_fsdp2, build_optimizer, default_attn_implementation, \
        enable_gradient_checkpointing
    from hflow.utils.torch_functional import compute_position_id_with_mask
    from hflow.workers.actor import DataParallelPPOActor

    dev = device.get_device()
    _reset_peak()
    torch.manual_seed(0)
    with torch.device(dev):
        model = Qwen2ForCausalLM._from_config(config, attn_implementation=default_attn_implementation(),
                                              dtype=torch.float32)
    if checkpointing:
        enable_gradient_checkpointing(model)
    apply_fsdp2(model, _mesh())
    actor_cfg = _actor_config(ppo_mini_batch_size_per_rank=seqs_per_micro * micro_batches,
                              ppo_micro_batch_size_per_gpu=seqs_per_micro, shuffle=False, ppo_epochs=1)
    optimizer = build_optimizer(model.parameters(), actor_cfg.optim)
    actor = DataParallelPPOActor(actor_cfg, model, optimizer)

    n, seq = seqs_per_micro * micro_batches, prompt_len + response_len
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, config.vocab_size, (n, seq), generator=gen)
    attention_mask = torch.ones(n, seq, dtype=torch.long)
    data = DataProto.from_dict({
        "input_ids": input_ids,
        "responses": input_ids[:, prompt_len:],
        "attention_mask": attention_mask,
        "position_ids": compute_position_id_with_mask(attention_mask),
        "response_mask": attention_mask[:, prompt_len:],
        "advantages": torch.randn(n, response_len, generator=gen),
    }, meta_info={"temperature": 1.0, "micro_batch_size": seqs_per_micro}).to(dev)

    def timed(fn):
        times = []
        for i in range(repeats + 1):  # the first is a warm-up
            _sync()
            t0 = time.perf_counter()
            out = fn()
            _sync()
            if i:
                times.append(time.perf_counter() - t0)
        return statistics.median(times), out

    _reset_peak()
    # as the worker's old-log-prob pass does: with the entropy metric
    logprob_s, (old_log_probs, _) = timed(lambda: actor.compute_log_prob(data, calculate_entropy=True))
    logprob_mem = _cuda_memory()
    data.batch["old_log_probs"] = old_log_probs
    _reset_peak()
    update_s, _ = timed(lambda: actor.update_policy(data))
    update_mem = _cuda_memory()

    peak = device_peak_flops()
    seqlens = [seq] * n
    fwd = forward_flops(config, seqlens, lm_head_tokens=n * response_len)
    train = training_flops(config, seqlens, lm_head_tokens=n * response_len)
    result = {
        "tokens_per_micro_batch": seqs_per_micro * seq, "sequences": n, "micro_batches": micro_batches,
        "gradient_checkpointing": checkpointing,
        "logprob_s": logprob_s, "logprob_tokens_per_s": n * seq / logprob_s, "logprob_mfu": mfu(fwd, logprob_s, peak),
        "logprob_peak_bytes": logprob_mem[1] if logprob_mem else None,
        "update_s": update_s, "update_tokens_per_s": n * seq / update_s, "update_mfu": mfu(train, update_s, peak),
        "update_peak_bytes": update_mem[1] if update_mem else None,
    }
    del actor, optimizer, model, data, old_log_probs
    _reset_peak()
    after = _cuda_memory()
    result["allocated_after_bytes"] = after[0] if after else None  # should be ~0: the next size needs the room
    return result


def part_c(part: Part, smoke: bool, workdir: Path) -> None:
    import torch

    from hflow.utils.flops_counter import TransformerShape, device_peak_flops

    config = _qwen_1_5b_config(smoke)
    prompt_len, response_len = (16, 48) if smoke else (256, 768)
    seq = prompt_len + response_len
    sizes = [(1, 2), (2, 2)] if smoke else [(4, 4), (16, 2)]  # (sequences per micro-batch, micro-batches)
    repeats = 1 if smoke else 3
    shape = TransformerShape.from_hf_config(config)
    params = shape.num_layers * shape.layer_matmul_params + shape.vocab_size * shape.hidden_size
    part.details.append(
        f"model: Qwen2 (hidden {config.hidden_size}, {config.num_hidden_layers} layers, {config.num_attention_heads} "
        f"heads, {config.num_key_value_heads} KV heads, MLP {config.intermediate_size}, vocab {config.vocab_size}, "
        f"tied embeddings), {params / 1e9:.2f}B matmul parameters, random weights; fp32 master weights, FSDP2 bf16 "
        f"compute, AdamW; sequences of {seq} tokens ({prompt_len} prompt + {response_len} response, no padding); "
        f"median of {repeats} after a warm-up")
    part.details.append("MFU = model FLOPs (hflow/utils/flops_counter.py: 6 x matmul params x tokens, LM head on "
                        "response positions only, causal attention) / (time x peak: the GPU's dense bf16 data-sheet "
                        "figure, on CPU this machine's measured fp32 matmul peak); log-prob pass = forward only")
    rows, ok = [], True
    for seqs_per_micro, micro_batches in sizes:
        out_of_memory = False
        try:
            r = _speed_once(config, seqs_per_micro, micro_batches, prompt_len, response_len, False, repeats)
        except torch.OutOfMemoryError:
            out_of_memory = True  # retried below, once the traceback (and the tensors it holds) is gone
        if out_of_memory:
            part.details.append(f"{seqs_per_micro * seq} tokens per micro-batch ran out of memory without "
                                "gradient checkpointing; measured with it (its recomputation is not model FLOPs)")
            _reset_peak()
            r = _speed_once(config, seqs_per_micro, micro_batches, prompt_len, response_len, True, repeats)
        rows.append(r)
        if r["update_mfu"] is None or r["update_mfu"] < 0.35:
            ok = False
    part.data["rows"] = rows

    def pct(v):
        return "n/a" if v is None else f"{100 * v:.1f} %"

    table = ["| tokens / micro-batch | pass | tokens/s | MFU | peak GPU memory | time |", "|---|---|---|---|---|---|"]
    for r in rows:
        gc_note = " (grad. ckpt.)" if r["gradient_checkpointing"] else ""
        table.append(f"| {r['tokens_per_micro_batch']}{gc_note} | update ({r['sequences']} seqs, "
                     f"{r['micro_batches']} micro-batches, 1 optimizer step) | {r['update_tokens_per_s']:,.0f} | "
                     f"{pct(r['update_mfu'])} | {_gib(r['update_peak_bytes'])} | {r['update_s']:.3f} s |")
        table.append(f"| {r['tokens_per_micro_batch']}{gc_note} | log-prob | {r['logprob_tokens_per_s']:,.0f} | "
                     f"{pct(r['logprob_mfu'])} | {_gib(r['logprob_peak_bytes'])} | {r['logprob_s']:.3f} s |")
    part.details.append("\n".join(table))
    leftover = [r["allocated_after_bytes"] for r in rows if r.get("allocated_after_bytes")]
    if leftover and max(leftover) > GiB:
        part.details.append(f"GPU memory still allocated after a size's run: {_gib(max(leftover))}")
    part.result = "update MFU " + ", ".join(
        f"{pct(r['update_mfu'])} at {r['tokens_per_micro_batch']} tokens" for r in rows)
    if device_peak_flops() is None:
        part.result += " (peak FLOP/s of this device unknown)"
    part.status = "PASS" if ok else "FAIL"


# ----------------------------------------------------------------------------------- d. memory


def _actor_entropy_fn():
    """The entropy function the actor calls, whatever its name in hflow.utils.torch_functional today."""
    from hflow.workers.actor import dp_actor

    found = {name: fn for name, fn in vars(dp_actor).items()
             if "entropy" in name and callable(fn) and getattr(fn, "__module__", "") == "hflow.utils.torch_functional"}
    if not found:
        raise RuntimeError("hflow.workers.actor.dp_actor imports no entropy function from hflow.utils.torch_functional")
    name = sorted(found)[0]
    return name, found[name]


def part_d(part: Part, smoke: bool, workdir: Path) -> None:
    import torch

    from hflow.utils import device
    from hflow.utils.torch_functional import logprobs_from_logits

    entropy_name, entropy_fn = _actor_entropy_fn()
    b, l, v = (2, 16, 1000) if smoke else (32, 1024, 151936)
    dev = device.get_device()
    limit = 4 * GiB
    logits_bytes = b * l * v * 2
    part.details.append(
        f"logits {b} x {l} x {v} in bf16 ({logits_bytes / GiB:.2f} GiB); `logprobs_from_logits` and "
        f"`{entropy_name}` (what DataParallelPPOActor calls) on the same logits. Extra = peak allocated GPU memory "
        "minus what was allocated before the call (the logits); for backward, minus one logits-sized gradient too. "
        "Target: forward extra (peak, and what autograd keeps for backward) < 4 GiB; backward is reported")

    def measure(grad: bool) -> dict[str, int] | None:
        _reset_peak()
        logits = torch.randn(b, l, v, device=dev, dtype=torch.bfloat16).requires_grad_(grad)
        labels = torch.randint(0, v, (b, l), device=dev)
        _sync()
        _reset_peak()
        base = _cuda_memory()
        with torch.set_grad_enabled(grad):
            log_probs = logprobs_from_logits(logits, labels)
            entropy = entropy_fn(logits).float()
            _sync()
            forward = _cuda_memory()
            if grad:
                _reset_peak()
                (log_probs.sum() + entropy.sum()).backward()
                _sync()
        backward = _cuda_memory()
        if base is None:  # CPU smoke: no allocator statistics
            return None
        entry = {"forward_peak_extra": forward[1] - base[0]}
        if grad:
            entry["held_for_backward"] = forward[0] - base[0]
            entry["backward_peak_extra"] = backward[1] - base[0] - logits_bytes
        return entry

    results: dict[str, Any] = {}
    for label, grad in (("no grad (compute_log_prob)", False), ("autograd (update with entropy_coeff != 0)", True)):
        out_of_memory = False
        try:
            results[label] = measure(grad)
        except torch.OutOfMemoryError:
            out_of_memory = True  # handled below, once the traceback (and the tensors it holds) is gone
        if out_of_memory:
            _reset_peak()
            results[label] = "out of memory"
    part.data.update(results)
    ok, lines, forward_extras = True, [], []
    for label, entry in results.items():
        if entry is None:
            lines.append(f"- {label}: no allocator statistics on CPU")
            continue
        if entry == "out of memory":
            ok = False
            lines.append(f"- {label}: **out of memory**")
            continue
        for key, value in entry.items():
            if key != "backward_peak_extra":
                forward_extras.append(value)
                ok = ok and value < limit
        lines.append(f"- {label}: " + ", ".join(f"{k.replace('_', ' ')} {_gib(val)}" for k, val in entry.items()))
        backward = entry.get("backward_peak_extra")
        if backward is not None and backward >= logits_bytes / 2:
            lines.append(f"  - backward holds about {1 + backward / logits_bytes:.1f} logits-sized gradients at "
                         "once: each function's backward builds its own, and autograd then adds them")
    part.details.append("\n".join(lines))
    part.result = (f"forward extra at most {_gib(max(forward_extras))}" if forward_extras
                   else "no measurement" if not ok else "no allocator statistics on CPU")
    part.status = "PASS" if ok else "FAIL"


# ------------------------------------------------------------------------------------------ report

PARTS = {
    "a": ("built-in task, local backend, HF rollout, bf16", "val score <= 0.2 before, >= 0.8 after", part_a),
    "b": ("log-prob parity: HF generation vs FSDP2 bf16 forward", "mean |Δp| <= 1e-2", part_b),
    "c": ("actor update and log-prob pass, Qwen2.5-1.5B shape", "update MFU >= 35 % at 4k and 16k tokens", part_c),
    "d": ("log-prob + entropy memory, 32 x 1024 x 152k logits", "< 4 GiB extra (forward)", part_d),
}


def write_report(path: Path, env: dict[str, str], parts: list[Part], tests: tuple[int, str] | None,
                 smoke: bool) -> None:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# GPU check",
        "",
        f"Written by `scripts/gpu_check.sh` (`bench/gpu_check.py`) on {now}."
        + (" **Smoke run on CPU (`--smoke-cpu`): tiny sizes, the numbers mean nothing.**" if smoke else ""),
        "",
        "| | |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in env.items()],
        "",
        "## Summary",
        "",
        "| part | result | target | status |",
        "|---|---|---|---|",
    ]
    if tests is not None:
        rc, summary = tests
        status = "PASS" if rc == 0 else "FAIL"
        lines.append(f"| tests marked `gpu` (`pytest -m gpu`) | {summary} | all pass | {status} |")
    for p in parts:
        lines.append(f"| {p.key}. {p.title} | {p.result} | {p.target} | {p.status} |")
    for p in parts:
        lines += ["", f"## {p.key}. {p.title}", "", f"Status: **{p.status}** ({p.seconds:.0f} s). {p.result}", ""]
        for detail in p.details:
            lines += [detail, ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines).rstrip() + "\n")
    path.with_suffix(".json").write_text(json.dumps(
        {"environment": env, "tests": tests, "parts": {p.key: {"status": p.status, "result": p.result, **p.data}
                                                       for p in parts}}, indent=1, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_trainer"]:
        return _run_trainer(argv[1:])
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

    env = _environment()
    parts: list[Part] = []
    with tempfile.TemporaryDirectory(prefix="hflow-gpu-check-") as tmp:
        for key in [k.strip() for k in args.parts.split(",") if k.strip()]:
            title, target, fn = PARTS[key]
            part = Part(key, title, target)
            parts.append(part)
            print(f"gpu_check: part {key}: {title} ...", file=sys.stderr, flush=True)
            started = time.perf_counter()
            try:
                fn(part, args.smoke_cpu, Path(tmp))
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
