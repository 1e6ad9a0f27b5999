"""The colocated weight sync's gather (`hflow.workers.fsdp.gather`) on three FSDP2 ranks (gloo): fp32 master
shards cast to a bf16 engine's dtype on each rank before the all-gather, a bucket of shards per collective.
Three ranks split the tiny model's rows unevenly (64 rows: 22, 22, 20), so the padding of the last shard is
exercised."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import Qwen2Config, Qwen2ForCausalLM

from tests.ranks import free_port, spawn_ranks

RANKS = 3
SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
             vocab_size=100, tie_word_embeddings=False)


def _rank(rank: int, port: int, out: str) -> None:
    from hflow.workers.fsdp import GatherStats, apply_fsdp2, build_device_mesh, iter_full_params

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS,
                            timeout=timedelta(seconds=120))
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SHAPE))  # the same fp32 weights on every rank
    expected = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    model = apply_fsdp2(model, build_device_mesh(RANKS))
    fp32, bf16 = GatherStats(), GatherStats()
    one_by_one = dict(iter_full_params(model, stats=fp32))  # what the sync gathered before: fp32, per tensor
    bucketed = dict(iter_full_params(model, torch.bfloat16, bucket_bytes=64 * 1024, stats=bf16))
    assert list(bucketed) == list(one_by_one)
    for name, tensor in bucketed.items():
        assert torch.equal(one_by_one[name], expected[name]), name
        assert tensor.dtype == torch.bfloat16 and tensor.shape == expected[name].shape, name
        # bitwise the fp32 master cast afterwards: casting a shard commutes with gathering it
        assert torch.equal(tensor.view(torch.int16), expected[name].to(torch.bfloat16).view(torch.int16)), name
    if rank == 0:
        Path(out).write_text(json.dumps({"fp32": vars(fp32), "bf16": vars(bf16), "tensors": len(bucketed)}))
    dist.barrier()
    dist.destroy_process_group()


def test_the_sync_gathers_half_the_bytes_in_buckets_and_arrives_bitwise_equal(tmp_path):
    out = tmp_path / "stats.json"
    spawn_ranks(_rank, RANKS, free_port(), str(out))
    stats = json.loads(out.read_text())
    assert stats["bf16"]["bytes"] * 2 == stats["fp32"]["bytes"] > 0  # fp32 master -> bf16 engine: half the bytes
    assert stats["fp32"]["collectives"] == stats["tensors"]  # one all-gather per tensor before
    assert stats["bf16"]["collectives"] < stats["tensors"] / 3  # a bucket of tensors per all-gather now
