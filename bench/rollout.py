"""Rollout speed (vLLM vs HF generate) and weight-sync cost, for models of ~1M, ~12M and ~125M parameters.

For each model size, in a fresh process (so memory readings are its own): an FSDP2-wrapped policy in a
torch.distributed world of one, the in-process vLLM engine and the FSDPVLLMShardingManager, as the
fused worker holds them. Measured, median of --rounds after one warm-up:

  vllm tok/s, hf tok/s   generated tokens per second for the same batch of prompts (sampling, T=1)
  sync s                 FSDP full weights -> engine (reload_weights + prefix-cache reset)
  sync peak extra MiB    peak process RSS during the sync minus RSS just before it

    python bench/rollout.py [--sizes 1m 12m 125m] [--rounds 3] [--batch 16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
SHAPES = {
    "1m": {"preset": "tiny"},
    "12m": {"preset": "small"},
    "125m": {"preset": "small", "hidden_size": 768, "num_layers": 13, "num_heads": 12, "num_kv_heads": 12,
             "intermediate_size": 3072},
}


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class PeakRss:
    """Samples this process's RSS every millisecond while active."""

    def __enter__(self):
        self.peak = self.start = rss_mib()
        self._running = True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while self._running:
            self.peak = max(self.peak, rss_mib())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._running = False
        self._thread.join()
        self.peak = max(self.peak, rss_mib())


def measure(size: str, rounds: int, batch: int, prompt_len: int, response_len: int) -> dict:
    """Runs in the child process."""
    import torch
    import torch.distributed as dist
    from hflow.config_schema import default_section
    from hflow.protocol import DataProto
    from hflow.single_controller.base.worker import get_free_port
    from hflow.workers import fsdp
    from hflow.tasks.tiny_models import build_causal_lm
    from hflow.utils.torch_functional import compute_position_id_with_mask
    from hflow.workers.common import load_tokenizer
    from hflow.workers.rollout import HFRollout, vLLMRollout
    from hflow.workers.sharding_manager import FSDPVLLMShardingManager

    torch.set_num_threads(os.cpu_count())
    shape = dict(SHAPES[size])
    model_dir = Path("/tmp/hflow-bench-models") / size
    if not (model_dir / "config.json").exists():
        build_causal_lm(model_dir, shape.pop("preset"), **shape)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{get_free_port()}", rank=0, world_size=1)
    module = fsdp.load_causal_lm(str(model_dir))
    params = sum(p.numel() for p in module.parameters())
    hf_config = module.config
    module = fsdp.apply_fsdp2(module, fsdp.build_device_mesh(1))
    tokenizer = load_tokenizer(str(model_dir))
    config = default_section(
        "actor_rollout_ref.rollout", prompt_length=prompt_len, response_length=response_len, dtype="float32",
        kv_cache_memory_bytes=256 * 2**20, max_num_batched_tokens=4096, enforce_eager=True)
    rollout = vLLMRollout(str(model_dir), config, tokenizer, hf_config)
    manager = FSDPVLLMShardingManager(module, rollout)
    hf_rollout = HFRollout(module, config)

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(10, len(tokenizer) - 10, (batch, prompt_len), generator=gen)
    mask = torch.ones_like(ids)
    prompts = DataProto.from_dict({"input_ids": ids, "attention_mask": mask,
                                   "position_ids": compute_position_id_with_mask(mask)},
                                  meta_info={"eos_token_id": tokenizer.eos_token_id,
                                             "pad_token_id": tokenizer.pad_token_id})

    def tokens(out) -> int:
        return int(out.batch["attention_mask"][:, -response_len:].sum())

    sync_s, sync_peak, vllm_tps, hf_tps = [], [], [], []
    for round_ in range(rounds + 1):
        with PeakRss() as rss:
            manager.__enter__()
        if round_:
            sync_s.append(manager.last_sync_s)
            sync_peak.append(rss.peak - rss.start)
        start = time.perf_counter()
        out = rollout.generate_sequences(prompts)
        if round_:
            vllm_tps.append(tokens(out) / (time.perf_counter() - start))
        manager.__exit__(None, None, None)
        start = time.perf_counter()
        out = hf_rollout.generate_sequences(prompts)
        if round_:
            hf_tps.append(tokens(out) / (time.perf_counter() - start))
    dist.destroy_process_group()
    med = statistics.median
    return {"size": size, "params_m": params / 1e6, "vllm_tok_s": med(vllm_tps), "hf_tok_s": med(hf_tps),
            "sync_s": med(sync_s), "sync_peak_extra_mib": med(sync_peak),
            "weights_mib": params * 4 / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--response-len", type=int, default=64)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(measure(args.child, args.rounds, args.batch, args.prompt_len, args.response_len)))
        return

    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TORCHDYNAMO_DISABLE": "1"}
    rows = []
    for size in args.sizes:
        cmd = [sys.executable, __file__, "--child", size, "--rounds", str(args.rounds), "--batch", str(args.batch),
               "--prompt-len", str(args.prompt_len), "--response-len", str(args.response_len)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not lines:
            sys.exit(f"{size}: the measurement failed\n{done.stderr[-3000:]}")
        rows.append(json.loads(lines[-1].removeprefix("RESULT ")))

    table = [
        f"# Rollout: {args.batch} prompts x {args.prompt_len} tokens -> {args.response_len} tokens, fp32, "
        f"one process, {os.cpu_count()} cores; median of {args.rounds} rounds after 1 warm-up",
        "",
        "| model | params | vLLM tok/s | HF tok/s | vLLM / HF | sync s | sync peak extra MiB | weights MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        table.append(f"| {r['size']} | {r['params_m']:.1f}M | {r['vllm_tok_s']:.0f} | {r['hf_tok_s']:.0f} | "
                     f"{r['vllm_tok_s'] / r['hf_tok_s']:.2f} | {r['sync_s']:.3f} | {r['sync_peak_extra_mib']:.0f} | "
                     f"{r['weights_mib']:.0f} |")
    text = "\n".join(table)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "rollout.md").write_text(text + "\n")
    (RESULTS / "rollout.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
