"""The actor at the GPU's speed: one process, the same weights and batch through a plain-torch loop and through
hflow's actor with each speed option on and off (issue 33; design: ../shared/gpu-evidence/ANALYSIS.md §6).

    python bench/actor_speed.py                      # CUDA: Qwen2.5-1.5B shape, 16 x 1024 tokens (~4 min on an H100)
    python bench/actor_speed.py --device cpu         # a tiny shape on the CPU (plumbing; its numbers mean little)
    python bench/actor_speed.py --arms P0,H0,H1 --out /tmp/speed
    python bench/actor_speed.py --workload gsm8k     # a GRPO step's training side on GSM8K-like lengths (issue 49)

Per arm: the update (one optimizer step over the batch), the log-prob pass with and without entropy (median
of `--repeats` after a warm-up, synchronised), peak device memory, one profiled update (GPU: kernels per
step and the share of the update the GPU is busy; CPU: operators dispatched and their CPU time), MFU by
hflow's FLOP count (hflow/utils/flops_counter.py: LM head on the response positions only) and by verl's
convention (LM head and embedding on every token, ~1.19x higher for this batch), and the largest |log-prob|
difference to the first plain arm on the same weights (before any update). An arm that runs out of memory
is recorded as OOM and the next one runs. Writes `actor_speed.md` and `actor_speed.json` to `--out`.

Arms. `P*` are the plain loop (`plain_*` below); `H*` are hflow's actor built by the worker's own
`_build_trainable` from the trainer's config with the arm's overrides (dotted keys of ppo_trainer.yaml), so
an option that the worker reads from the config is measured as users get it. Adding an arm is one line in
ARMS; an arm whose `needs` is not met (a package, CUDA) is recorded as SKIPPED with the reason.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1:][:1] == ["cpu"]:
    os.environ["HFLOW_DEVICE"] = "cpu"  # before hflow's device helper makes its choice
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

# The hflow arms' common ground: part c's batch layout (padded rows counted in sequences), T = 1.
H_BASE = {"actor_rollout_ref.model.use_remove_padding": False, "actor_rollout_ref.actor.use_dynamic_bsz": False}
PACKED = {"actor_rollout_ref.model.use_remove_padding": True}
NO_RESHARD = {"actor_rollout_ref.actor.fsdp_config.reshard_after_forward": False}
COMPILE = {"actor_rollout_ref.model.use_torch_compile": True}
LIGER = {"actor_rollout_ref.model.use_liger": True}
CHECKPOINTING = {"actor_rollout_ref.model.enable_gradient_checkpointing": True}
OLD_KERNELS = {"actor_rollout_ref.actor.optim.kernel": "foreach",  # before issue 33: foreach AdamW, CPU-sized blocks
               "actor_rollout_ref.model.logit_block_elements": 4 * 1024 * 1024}
FUSED_HEAD = {"actor_rollout_ref.model.fused_lm_head": True}
ONE_MICRO = {"actor_rollout_ref.model.use_remove_padding": True, "actor_rollout_ref.actor.use_dynamic_bsz": True,
             "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "all"}  # "all": the whole batch's tokens


@dataclass
class Arm:
    key: str
    what: str
    overrides: dict[str, Any] = field(default_factory=dict)  # hflow arms: config keys; plain arms: unused
    plain: str | None = None  # "autocast" | "bf16_master" for the plain loop
    needs: tuple[str, ...] = ()  # "cuda", or module names that must import


ARMS = [
    Arm("P0", "plain loop: fp32 weights + bf16 autocast, fused AdamW", plain="autocast"),
    Arm("P1", "plain loop: bf16 compute weights, fp32 master weights and gradient sums, fused AdamW",
        plain="bf16_master"),
    Arm("H0", "hflow actor as gpu_check part c builds it", H_BASE),
    Arm("H1", "H0 + use_remove_padding (packed rows, varlen attention)", {**H_BASE, **PACKED}),
    Arm("H2", "H0 + reshard_after_forward=false", {**H_BASE, **NO_RESHARD}),
    Arm("H5", "H1 + H2: packed, no reshard", {**H_BASE, **PACKED, **NO_RESHARD}),
    Arm("H6", "H5 + the whole batch in one token-budget micro-batch", {**H_BASE, **NO_RESHARD, **ONE_MICRO}),
    Arm("H6c", "H6 + gradient checkpointing", {**H_BASE, **NO_RESHARD, **ONE_MICRO, **CHECKPOINTING}),
    Arm("H0k", "H0 with the old kernels: foreach AdamW, 4M-logit log-prob blocks", {**H_BASE, **OLD_KERNELS}),
    Arm("H8", "H5 + fused_lm_head (blocked head + log-prob + entropy, recomputed in backward)",
        {**H_BASE, **PACKED, **NO_RESHARD, **FUSED_HEAD}),
    Arm("H9", "H6 + fused_lm_head", {**H_BASE, **NO_RESHARD, **ONE_MICRO, **FUSED_HEAD}),
    # compiled and Triton arms last: their first call compiles, and a run cut short keeps the rest.
    # (use_liger with use_torch_compile is refused in preflight: Dynamo cannot trace Liger's kernels.)
    Arm("H4", "H0 + use_liger", {**H_BASE, **LIGER}, needs=("cuda", "liger_kernel")),
    Arm("H3", "H0 + use_torch_compile", {**H_BASE, **COMPILE}, needs=("cuda",)),
    Arm("H10", "H6 + use_liger", {**H_BASE, **NO_RESHARD, **ONE_MICRO, **LIGER}, needs=("cuda", "liger_kernel")),
    Arm("H11", "H6c + use_liger", {**H_BASE, **NO_RESHARD, **ONE_MICRO, **CHECKPOINTING, **LIGER},
        needs=("cuda", "liger_kernel")),
    Arm("H12", "H6 + use_torch_compile", {**H_BASE, **NO_RESHARD, **ONE_MICRO, **COMPILE}, needs=("cuda",)),
    Arm("P0b", "P0 again (clock or thermal drift)", plain="autocast"),
]
CPU_ARMS = "P0,P1,H0,H0k,H1,H6,H8"  # compiling on a small CPU takes minutes; Liger needs CUDA


@dataclass
class Shape:
    name: str
    model: dict[str, Any]
    prompt: int
    response: int
    seqs_per_micro: int
    micro_batches: int

    @property
    def n(self) -> int:
        return self.seqs_per_micro * self.micro_batches

    @property
    def seq(self) -> int:
        return self.prompt + self.response


SHAPES = {
    "qwen2.5-1.5b": Shape("Qwen2.5-1.5B shape", dict(
        hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, intermediate_size=8960,
        vocab_size=151936, max_position_embeddings=32768, rope_theta=1_000_000.0, tie_word_embeddings=True,
        rms_norm_eps=1e-6), 256, 768, 4, 4),
    "tiny": Shape("tiny Qwen2", dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=512, max_position_embeddings=256, tie_word_embeddings=True), 16, 48, 2, 2),
}


# ------------------------------------------------------------------------------------------------ helpers


def sync() -> None:
    from hflow.utils import device

    device.synchronize()


def timed(fn: Callable[[], Any], repeats: int) -> float:
    """Median wall time of `repeats` synchronised calls after one warm-up."""
    times = []
    for i in range(repeats + 1):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def reset_peak() -> None:
    import torch

    from hflow.utils import device

    gc.collect()
    if device.is_cuda():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float | None:
    import torch

    from hflow.utils import device

    return torch.cuda.max_memory_allocated() / 2**30 if device.is_cuda() else None


def profile_update(fn: Callable[[], Any]) -> dict[str, Any]:
    """One update under torch.profiler. GPU: kernels launched (and memcpy/memset) and the GPU-busy share (their
    summed time / wall, at most 1: overlapping streams would count twice). CPU: aten operators dispatched and
    the CPU time of the outermost ones."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from hflow.utils import device

    cuda = device.is_cuda()
    # On a GPU the kernels only: CPU operator events of a 1.5B update take the profiler tens of seconds to list.
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    sync()
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        fn()
        sync()
    wall = time.perf_counter() - t0
    events = prof.events()
    out: dict[str, Any] = {"profiled_wall_s": wall}
    if cuda:
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        busy_us = sum(getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0) for e in kernels)  # µs
        out.update(kernels=len(kernels) or None,
                   gpu_busy=min(1.0, busy_us / 1e6 / wall) if kernels and wall > 0 else None)
    else:
        ops = [e for e in events if e.name.startswith("aten::")]
        out["aten_ops"] = len(ops)
        top = [e for e in ops if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
        out.update(cpu_op_s=sum(e.cpu_time_total for e in top) / 1e6)
    return out


def verl_training_flops(shape, seqlens) -> float:
    """verl's counter (verl/utils/flops_counter.py, Qwen2): hflow's with the LM head on every token, plus the
    embedding as a product (another 2·V·h per token, x3 for training)."""
    from hflow.utils.flops_counter import TransformerShape, training_flops

    s = TransformerShape.from_hf_config(shape)
    return training_flops(s, seqlens) + 6 * s.vocab_size * s.hidden_size * sum(seqlens)


# ---------------------------------------------------------------------------------------------- the batch


def make_batch(shape: Shape, vocab: int):
    import torch

    from hflow.protocol import DataProto
    from hflow.utils.torch_functional import compute_position_id_with_mask

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (shape.n, shape.seq), generator=gen)
    mask = torch.ones(shape.n, shape.seq, dtype=torch.long)
    return DataProto.from_dict({
        "input_ids": ids, "responses": ids[:, shape.prompt:], "attention_mask": mask,
        "position_ids": compute_position_id_with_mask(mask), "response_mask": mask[:, shape.prompt:],
        "advantages": torch.randn(shape.n, shape.response, generator=gen),
    }, meta_info={"temperature": 1.0, "micro_batch_size": shape.seqs_per_micro})


# ------------------------------------------------------------------------------------------ the plain loop


def plain_arm(mode: str, hf_config, state: dict, data, shape: Shape, repeats: int, profile_it: bool) -> dict[str, Any]:
    """The loop a user would write: SDPA, log_softmax + gather on the response positions, fused AdamW.
    `autocast`: fp32 weights under bf16 autocast. `bf16_master`: bf16 weights compute, an fp32 master copy
    is what AdamW steps, bf16 gradients are summed into fp32 after each backward (post-accumulate hooks)."""
    import torch
    from transformers import Qwen2ForCausalLM

    from hflow.utils import device

    dev = device.get_device()
    half = device.compute_dtype() if device.is_cuda() else torch.bfloat16
    with torch.device(dev):
        model = Qwen2ForCausalLM._from_config(hf_config, attn_implementation="sdpa", dtype=torch.float32)
    model.load_state_dict(state)
    params = list(model.parameters())
    if mode == "bf16_master":
        master = [p.detach().clone().float() for p in params]
        for p, m in zip(params, master):
            m.grad = torch.zeros_like(m)

            def accumulate(param, m=m):
                m.grad.add_(param.grad)
                param.grad = None

            p.register_post_accumulate_grad_hook(accumulate)
        model.to(half)
        optimizer = torch.optim.AdamW(master, lr=1e-6, fused=True)
    else:
        optimizer = torch.optim.AdamW(params, lr=1e-6, fused=True)
    ids = data.batch["input_ids"].to(dev)
    adv = data.batch["advantages"].to(dev)
    P, S, M = shape.prompt, shape.seqs_per_micro, shape.micro_batches
    autocast = mode == "autocast"

    def logits_of(xb):
        with torch.autocast(dev.type, dtype=half, enabled=autocast):
            return model(input_ids=xb, use_cache=False, logits_to_keep=xb.shape[1] - P + 1).logits[:, :-1].float()

    def step():
        for i in range(M):
            xb = ids[i * S:(i + 1) * S]
            lp = torch.log_softmax(logits_of(xb), -1).gather(-1, xb[:, P:, None]).squeeze(-1)
            (-(lp * adv[i * S:(i + 1) * S]).mean() / M).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=mode != "bf16_master")
        if mode == "bf16_master":
            with torch.no_grad():
                torch._foreach_copy_(params, master)

    def log_probs(entropy: bool):
        out = []
        with torch.no_grad():
            for i in range(M):
                xb = ids[i * S:(i + 1) * S]
                logp = torch.log_softmax(logits_of(xb), -1)
                out.append(logp.gather(-1, xb[:, P:, None]).squeeze(-1))
                if entropy:
                    -(logp.exp() * logp).sum(-1)
        return torch.cat(out)

    model.train()
    reset_peak()
    first = log_probs(False).float().cpu()
    result = {"update_s": timed(step, repeats), "logprob_s": timed(lambda: log_probs(False), repeats),
              "logprob_entropy_s": timed(lambda: log_probs(True), repeats), "peak_gib": peak_gib()}
    if profile_it:
        result.update(profile_update(step))
    return {**result, "_log_probs": first}  # the model and optimizer go with this frame (reset_peak collects)


# -------------------------------------------------------------------------------------------- hflow's actor


_MESH = None


def one_rank_mesh():
    global _MESH
    if _MESH is None:
        import socket

        import torch.distributed as dist

        from hflow.utils import device
        from hflow.workers.fsdp import build_device_mesh

        device.set_device()
        if not dist.is_initialized():
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            dist.init_process_group(device.dist_backend(), init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                    world_size=1)
        _MESH = build_device_mesh(1)
    return _MESH


def arm_config(overrides: dict[str, Any], shape: Shape):
    """The trainer's `actor_rollout_ref` with the arm's overrides, normalised as a one-rank worker does."""
    from omegaconf import OmegaConf, open_dict

    from hflow.trainer.config import default_config
    from hflow.utils import device
    from hflow.workers.config import resolve_device_defaults, resolved_copy

    config = default_config()
    updates = {"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": shape.seqs_per_micro,
               "actor_rollout_ref.actor.shuffle": False, "actor_rollout_ref.actor.ppo_epochs": 1, **overrides}
    with open_dict(config):
        for key, value in updates.items():
            OmegaConf.update(config, key, shape.n * shape.seq if value == "all" else value, merge=False)
    arr = resolved_copy(config.actor_rollout_ref)
    resolve_device_defaults(arr, device.is_cuda())
    arr.actor.ppo_mini_batch_size_per_rank = shape.n
    arr.actor.use_remove_padding = bool(arr.model.use_remove_padding)  # as normalize_actor_rollout_ref copies it
    arr.actor.fused_lm_head = bool(arr.model.fused_lm_head)  # the model-level kernel keys, copied likewise
    arr.actor.logit_block_elements = arr.model.logit_block_elements
    return arr


def hflow_arm(overrides: dict[str, Any], hf_config, state: dict, data, shape: Shape, repeats: int,
              profile_it: bool) -> dict[str, Any]:
    """hflow's DataParallelPPOActor on a module built by the worker's `_build_trainable` (FSDP2 on a one-rank
    mesh, the config's mixed precision, kernel options and optimizer), loaded with `state`."""
    import torch
    from transformers import Qwen2ForCausalLM

    from hflow.utils import device
    from hflow.workers.actor import DataParallelPPOActor
    from hflow.workers.fsdp import default_attn_implementation
    from hflow.workers.fsdp_workers import FSDPModelHolder

    arr = arm_config(overrides, shape)
    dev = device.get_device()
    with torch.device(dev):
        model = Qwen2ForCausalLM._from_config(hf_config, attn_implementation=default_attn_implementation(),
                                              dtype=torch.float32)
    model.load_state_dict(state)
    holder = type("OneRank", (), {"device_mesh": one_rank_mesh()})()
    module, optimizer, _ = FSDPModelHolder._build_trainable(
        holder, model, arr.actor.fsdp_config, arr.actor.optim,
        gradient_checkpointing=bool(arr.model.enable_gradient_checkpointing), train=True, kernels=arr.model)
    actor = DataParallelPPOActor(arr.actor, module, optimizer)
    batch = data.to(dev)
    if arr.actor.use_dynamic_bsz:
        batch.meta_info.update(use_dynamic_bsz=True, max_token_len=int(arr.actor.ppo_max_token_len_per_gpu))
    reset_peak()
    first, _ = actor.compute_log_prob(batch, calculate_entropy=False)
    batch.batch["old_log_probs"] = first
    result = {"update_s": timed(lambda: actor.update_policy(batch), repeats),
              "logprob_s": timed(lambda: actor.compute_log_prob(batch, calculate_entropy=False), repeats),
              "logprob_entropy_s": timed(lambda: actor.compute_log_prob(batch, calculate_entropy=True), repeats),
              "peak_gib": peak_gib()}
    if profile_it:
        result.update(profile_update(lambda: actor.update_policy(batch)))
    result["_log_probs"] = first.float().cpu()
    return result


# ------------------------------------------------------------------------------------------------ the run


def missing_needs(arm: Arm) -> str | None:
    from hflow.utils import device

    for need in arm.needs:
        if need == "cuda" and not device.is_cuda():
            return "needs CUDA"
        if need != "cuda" and importlib.util.find_spec(need) is None:
            return f"needs {need} (not installed)"
    return None


def run(arm_keys: list[str], shape: Shape, repeats: int, profile_it: bool, log=print,
        budget_s: float | None = None, on_row: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Measure each arm in turn. `on_row` sees the result so far after every arm (a run cut short by the
    device's time limit keeps what it measured); arms not started within `budget_s` are SKIPPED."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from hflow.utils import device
    from hflow.utils.flops_counter import device_peak_flops, forward_flops, training_flops

    hf_config = Qwen2Config(**shape.model)
    torch.manual_seed(0)
    with torch.device(device.get_device()):
        source = Qwen2ForCausalLM._from_config(hf_config, attn_implementation="sdpa", dtype=torch.float32)
    state = {k: v.detach().cpu().clone() for k, v in source.state_dict().items()}  # every arm loads these
    del source
    data = make_batch(shape, hf_config.vocab_size)
    seqlens = [shape.seq] * shape.n
    heads = shape.n * shape.response
    train_hflow = training_flops(hf_config, seqlens, lm_head_tokens=heads)
    train_verl = verl_training_flops(hf_config, seqlens)
    fwd = forward_flops(hf_config, seqlens, lm_head_tokens=heads)
    peak = device_peak_flops()
    arms = {a.key: a for a in ARMS}
    rows, reference = [], None
    begun = time.perf_counter()

    def result() -> dict[str, Any]:
        return {"environment": environment(), "shape": {"name": shape.name, **shape.model, "prompt": shape.prompt,
                "response": shape.response, "sequences": shape.n, "micro_batches": shape.micro_batches,
                "sequences_per_micro_batch": shape.seqs_per_micro},
                "flops": {"train_hflow": train_hflow, "train_verl": train_verl, "forward_hflow": fwd, "peak": peak},
                "repeats": repeats, "rows": rows}

    for key in arm_keys:
        arm = arms[key]
        row: dict[str, Any] = {"arm": key, "what": arm.what, "overrides": arm.overrides or None}
        reason = missing_needs(arm)
        if not reason and budget_s is not None and time.perf_counter() - begun > budget_s:
            reason = f"not started: the run's --budget-s {budget_s:.0f} s was spent"
        if reason:
            row.update(status="SKIPPED", note=reason)
            rows.append(row)
            log(f"actor_speed: {key}: skipped ({reason})")
            if on_row:
                on_row(result())
            continue
        log(f"actor_speed: {key}: {arm.what} ...")
        started = time.perf_counter()
        oom = False
        try:
            if arm.plain:
                out = plain_arm(arm.plain, hf_config, state, data, shape, repeats, profile_it)
            else:
                out = hflow_arm(arm.overrides, hf_config, state, data, shape, repeats, profile_it)
            row["status"] = "OK"
        except torch.OutOfMemoryError:
            oom = True
        except Exception as err:  # noqa: BLE001 - recorded, and the next arm runs
            row.update(status="ERROR", note=f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}")
            log(traceback.format_exc())
        if oom:
            row.update(status="OOM", note="out of device memory")
        if row["status"] == "OK":
            log_probs = out.pop("_log_probs")
            if reference is None:
                reference = log_probs
            row.update(out)
            row["max_abs_logprob_diff"] = float((log_probs - reference).abs().max())
            row["update_mfu_hflow"] = train_hflow / out["update_s"] / peak if peak else None
            row["update_mfu_verl"] = train_verl / out["update_s"] / peak if peak else None
            row["logprob_mfu_hflow"] = fwd / out["logprob_s"] / peak if peak else None
            row["tokens_per_s"] = shape.n * shape.seq / out["update_s"]
        row["seconds"] = time.perf_counter() - started
        rows.append(row)
        reset_peak()
        log(f"actor_speed: {key}: {row['status']} in {row['seconds']:.1f} s")
        if on_row:
            on_row(result())
    return result()


def environment() -> dict[str, Any]:
    import torch
    import transformers

    from hflow.utils import device

    name = torch.cuda.get_device_name(device.get_device()) if device.is_cuda() else platform.processor() or "cpu"
    commit = os.popen(f"git -C {REPO} rev-parse --short HEAD 2>/dev/null").read().strip()
    return {"device": name, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "hflow commit": commit or "unknown",
            "liger": importlib.util.find_spec("liger_kernel") is not None}


def markdown(result: dict[str, Any], command: str) -> str:
    def f(v, fmt="{:.3f}"):
        return "n/a" if v is None else fmt.format(v)

    def pct(v):
        return "n/a" if v is None else f"{100 * v:.1f} %"

    env, shape = result["environment"], result["shape"]
    cuda = any("kernels" in r for r in result["rows"])
    lines = [f"# Actor speed: {shape['name']}, {shape['sequences']} x {shape['prompt'] + shape['response']} tokens "
             f"({shape['micro_batches']} micro-batches of {shape['sequences_per_micro_batch']})", "",
             f"`{command}`", "",
             "; ".join(f"{k} {v}" for k, v in env.items()), "",
             f"Median of {result['repeats']} after a warm-up. MFU: hflow's FLOP count (LM head on response positions) "
             "and verl's (LM head and embedding on every token). |Δ log p|: largest difference to the first plain "
             "arm's log-probs on the same weights.", "",
             "| arm | what | status | update s | log-prob s | + entropy s | MFU hflow | MFU verl | peak GiB | "
             + ("GPU busy | kernels/step |" if cuda else "aten ops/step | op CPU s |") + " max abs Δ log p |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if r["status"] != "OK":
            lines.append(f"| {r['arm']} | {r['what']} | {r['status']}: {r.get('note', '')} |" + " |" * 10)
            continue
        prof = (f"{pct(r.get('gpu_busy'))} | {r.get('kernels', 'n/a')} |" if cuda
                else f"{r.get('aten_ops', 'n/a')} | {f(r.get('cpu_op_s'))} |")
        lines.append(f"| {r['arm']} | {r['what']} | OK | {f(r['update_s'])} | {f(r['logprob_s'])} | "
                     f"{f(r['logprob_entropy_s'])} | {pct(r['update_mfu_hflow'])} | {pct(r['update_mfu_verl'])} | "
                     f"{f(r['peak_gib'], '{:.1f}')} | {prof} {r['max_abs_logprob_diff']:.2e} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--workload", choices=("fixed", "gsm8k"), default="fixed",
                        help="fixed: one 16 x 1024 batch, the update and log-prob passes (the arms above); gsm8k: a "
                        "GRPO step's training side on GSM8K-like lengths, KL loss, two mini-batches "
                        "(bench/actor_speed_gsm8k.py, its own arms)")
    parser.add_argument("--arms", default=None, help=f"comma-separated keys of {[a.key for a in ARMS]} "
                        f"(default: all on CUDA, {CPU_ARMS} on CPU)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None,
                        help="default: qwen2.5-1.5b on CUDA, tiny on CPU")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no arm after this many seconds (a device call has a time limit); "
                        "the files are rewritten after every arm either way")
    parser.add_argument("--out", default=None, help="folder for actor_speed.md / .json "
                        "(default bench/results/actor_speed_<device>)")
    args = parser.parse_args(argv)
    import torch

    from hflow.utils import device

    if args.device == "cuda" and not device.is_cuda():
        print(f"actor_speed: no CUDA device (torch {torch.__version__}); use --device cpu", file=sys.stderr)
        return 2
    if args.device == "cpu":
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    if args.workload == "gsm8k":
        import actor_speed_gsm8k as gsm8k

        keys = [k.strip() for k in (args.arms or ",".join(a.key for a in gsm8k.ARMS)).split(",") if k.strip()]
        unknown = [k for k in keys if k not in {a.key for a in gsm8k.ARMS}]
        if unknown:
            parser.error(f"unknown gsm8k arms {unknown}; known: {[a.key for a in gsm8k.ARMS]}")
        out = Path(args.out or REPO / "bench" / "results" / f"actor_speed_gsm8k_{args.device}")
        out.mkdir(parents=True, exist_ok=True)
        command = ("python bench/actor_speed.py " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
        result = gsm8k.run(keys, out, command, log=lambda m: print(m, file=sys.stderr, flush=True),
                           budget_s=args.budget_s)
        print(gsm8k.markdown(result, command))
        return 1 if any(r["status"] == "ERROR" for r in result["rows"]) else 0
    keys = [k.strip() for k in (args.arms or (",".join(a.key for a in ARMS) if args.device == "cuda" else CPU_ARMS)
                                ).split(",") if k.strip()]
    unknown = [k for k in keys if k not in {a.key for a in ARMS}]
    if unknown:
        parser.error(f"unknown arms {unknown}; known: {[a.key for a in ARMS]}")
    shape = SHAPES[args.shape or ("qwen2.5-1.5b" if args.device == "cuda" else "tiny")]
    out = Path(args.out or REPO / "bench" / "results" / f"actor_speed_{args.device}")
    out.mkdir(parents=True, exist_ok=True)
    command = ("python bench/actor_speed.py " + " ".join(argv if argv is not None else sys.argv[1:])).strip()

    def write(result: dict[str, Any]) -> None:
        (out / "actor_speed.json").write_text(json.dumps({"command": command, **result}, indent=1) + "\n")
        (out / "actor_speed.md").write_text(markdown(result, command))

    result = run(keys, shape, args.repeats, not args.no_profile,
                 log=lambda m: print(m, file=sys.stderr, flush=True), budget_s=args.budget_s, on_row=write)
    write(result)
    print(markdown(result, command))
    errors = [r["arm"] for r in result["rows"] if r["status"] == "ERROR"]
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
