"""Part c, speed: how fast is the actor on a GPU, and how much of it does it use? The actor update and the
log-prob pass of a Qwen2.5-1.5B-shaped model with random weights (built from a config, no download) at 4k
and 16k tokens per micro-batch: tokens/s, MFU (hflow.utils.flops_counter) and peak GPU memory; a size that
runs out of memory is measured again with gradient checkpointing. Target: update MFU >= 35 % at both sizes."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from .common import GiB, Part, actor_config, cuda_memory, gib, mesh, reset_peak, sync

TITLE = "actor update and log-prob pass, Qwen2.5-1.5B shape"
TARGET = "update MFU >= 35 % at 4k and 16k tokens"


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
    from hflow.workers.fsdp import apply_fsdp2, build_optimizer, default_attn_implementation, \
        enable_gradient_checkpointing
    from hflow.utils.torch_functional import compute_position_id_with_mask
    from hflow.workers.actor import DataParallelPPOActor

    dev = device.get_device()
    reset_peak()
    torch.manual_seed(0)
    with torch.device(dev):
        model = Qwen2ForCausalLM._from_config(config, attn_implementation=default_attn_implementation(),
                                              dtype=torch.float32)
    if checkpointing:
        enable_gradient_checkpointing(model)
    apply_fsdp2(model, mesh())
    actor_cfg = actor_config(ppo_mini_batch_size_per_rank=seqs_per_micro * micro_batches,
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

    # The calls are passed with their arguments, not as lambdas: a lambda closing over `actor` and `data`,
    # which are deleted below, reads to pyflakes as an undefined name (it runs fine: the cells are read first).
    def timed(fn, *args, **kwargs):
        times = []
        for i in range(repeats + 1):  # the first is a warm-up
            sync()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            sync()
            if i:
                times.append(time.perf_counter() - t0)
        return statistics.median(times), out

    reset_peak()
    # as the worker's old-log-prob pass does: with the entropy metric
    logprob_s, (old_log_probs, _) = timed(actor.compute_log_prob, data, calculate_entropy=True)
    logprob_mem = cuda_memory()
    data.batch["old_log_probs"] = old_log_probs
    reset_peak()
    update_s, _ = timed(actor.update_policy, data)
    update_mem = cuda_memory()

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
    reset_peak()
    after = cuda_memory()
    result["allocated_after_bytes"] = after[0] if after else None  # should be ~0: the next size needs the room
    return result


def run(part: Part, smoke: bool, workdir: Path) -> None:
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
            reset_peak()
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
                     f"{pct(r['update_mfu'])} | {gib(r['update_peak_bytes'])} | {r['update_s']:.3f} s |")
        table.append(f"| {r['tokens_per_micro_batch']}{gc_note} | log-prob | {r['logprob_tokens_per_s']:,.0f} | "
                     f"{pct(r['logprob_mfu'])} | {gib(r['logprob_peak_bytes'])} | {r['logprob_s']:.3f} s |")
    part.details.append("\n".join(table))
    leftover = [r["allocated_after_bytes"] for r in rows if r.get("allocated_after_bytes")]
    if leftover and max(leftover) > GiB:
        part.details.append(f"GPU memory still allocated after a size's run: {gib(max(leftover))}")
    part.result = "update MFU " + ", ".join(
        f"{pct(r['update_mfu'])} at {r['tokens_per_micro_batch']} tokens" for r in rows)
    if device_peak_flops() is None:
        part.result += " (peak FLOP/s of this device unknown)"
    part.status = "PASS" if ok else "FAIL"

