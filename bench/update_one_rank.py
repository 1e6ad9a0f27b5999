"""The actor update on one rank: a plain module (what `apply_fsdp2` leaves when FSDP2 has nothing to do) against
FSDP2 on a mesh of one (`fsdp_on_one_rank=True`, hflow before issue 26), side by side in one process.

    python bench/update_one_rank.py [--rows 32] [--reps 4] [--out bench/results/update_one_rank.md]

SmolLM2-135M-Instruct (`examples/smollm2_arith/prepare_model.py` builds it from the registry package), fp32,
2 torch threads, hflow's `DataParallelPPOActor` with its defaults plus remove-padding, micro-batches of 16, the
low-variance KL loss; `--rows` sequences of a 64-token prompt and a response of 30-64 tokens (issue 26's
shape). One untimed update per arm, then `--reps` updates per arm, the arms alternating so that drift in the
machine's speed falls on both. Reported: medians [min-max], the plain arm's time over FSDP2's, and the update's
model FLOP rate (`flops_counter.training_flops`) against the fp32 matmul peak measured at the start and the end of
the run (the larger).
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build_batch(rows: int, prompt: int = 64, response: int = 64):
    import torch
    from tensordict import TensorDict

    from hflow.protocol import DataProto

    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(100, 40000, (rows, prompt + response), generator=g)
    lengths = torch.randint(30, response + 1, (rows,), generator=g)
    response_mask = (torch.arange(response)[None] < lengths[:, None]).long()
    attention_mask = torch.cat([torch.ones(rows, prompt, dtype=torch.long), response_mask], 1)
    batch = TensorDict({
        "input_ids": input_ids, "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0), "responses": input_ids[:, prompt:],
        "response_mask": response_mask, "advantages": torch.randn(rows, response, generator=g),
        "ref_log_prob": -torch.rand(rows, response, generator=g) * 5}, batch_size=[rows])
    return DataProto(batch=batch, meta_info={"temperature": 1.0})


def build_actor(model_path: str, rows: int, mesh, fsdp_on_one_rank: bool):
    import torch
    from omegaconf import OmegaConf

    from hflow.config_schema import default_config
    from hflow.workers.fsdp import apply_fsdp2, build_optimizer, default_attn_implementation, load_causal_lm
    from hflow.workers.actor.dp_actor import DataParallelPPOActor

    config = OmegaConf.create(OmegaConf.to_container(default_config().actor_rollout_ref.actor, resolve=True))
    config.update(ppo_mini_batch_size_per_rank=rows, ppo_micro_batch_size_per_gpu=16, use_kl_loss=True,
                  kl_loss_coef=0.001, kl_loss_type="low_var_kl", use_remove_padding=True)
    model = load_causal_lm(model_path, dtype=torch.float32, attn_implementation=default_attn_implementation())
    model = apply_fsdp2(model, mesh, fsdp_on_one_rank=fsdp_on_one_rank)
    return DataParallelPPOActor(config, model, build_optimizer(model.parameters(), config.optim)), model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--model", default=os.path.expanduser("~/.cache/hflow/smollm2-135m-instruct"))
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "update_one_rank.md")
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist

    from hflow.utils.flops_counter import measure_matmul_flops, training_flops
    from hflow.workers.fsdp import build_device_mesh
    from torch.distributed.fsdp import FSDPModule

    torch.set_num_threads(2)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    peaks = [measure_matmul_flops()]
    mesh = build_device_mesh(1)
    data = build_batch(args.rows)
    arms = {}
    for name, wrap in (("plain module", False), ("FSDP2, mesh of one", True)):
        actor, model = build_actor(args.model, args.rows, mesh, wrap)
        assert isinstance(model, FSDPModule) == wrap, name
        actor.update_policy(data)  # warm-up: AdamW's moments, first-call costs
        arms[name] = (actor, [])
    for rep in range(args.reps):
        for name, (actor, times) in arms.items():
            started = time.perf_counter()
            actor.update_policy(data)
            times.append(time.perf_counter() - started)
            print(f"[update_one_rank] rep {rep} {name}: {times[-1]:.2f} s", flush=True)
    peaks.append(measure_matmul_flops())
    dist.destroy_process_group()

    from transformers import AutoConfig

    mask = data.batch["attention_mask"]
    flops = training_flops(AutoConfig.from_pretrained(args.model), mask.sum(-1).tolist(),
                           lm_head_tokens=int(data.batch["response_mask"].sum()))
    peak = max(peaks)
    medians = {name: statistics.median(times) for name, (_, times) in arms.items()}
    base = medians["FSDP2, mesh of one"]
    lines = ["# The actor update on one rank: plain module vs FSDP2 on a mesh of one", "",
             f"Command: `python bench/update_one_rank.py --rows {args.rows} --reps {args.reps}`", "",
             f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
             f"{torch.__version__}, 2 threads; {time.strftime('%Y-%m-%d %H:%M')}. SmolLM2-135M-Instruct fp32, "
             f"{args.rows} sequences (64-token prompts, 30-64-token responses), remove-padding, micro-batches of "
             f"16; medians [min-max] of {args.reps} updates per arm after one untimed, arms alternating. Update "
             f"FLOPs {flops / 1e12:.2f} T (counted, `flops_counter.training_flops`); fp32 matmul peak "
             f"{peak / 1e9:.0f} GFLOP/s (measured at the start and end of this run: "
             f"{', '.join(f'{p / 1e9:.0f}' for p in peaks)}).", "",
             "| arm | update s [min-max] | GFLOP/s (% of peak) | time vs FSDP2 |", "|---|---|---|---|"]
    for name, (_, times) in arms.items():
        rate = flops / medians[name]
        lines.append(f"| {name} | {medians[name]:.2f} [{min(times):.2f}-{max(times):.2f}] | {rate / 1e9:.0f} "
                     f"({100 * rate / peak:.0f} %) | {medians[name] / base:.3f}x |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
