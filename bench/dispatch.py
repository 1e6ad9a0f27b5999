"""Cost of sending a batch through DP_COMPUTE_PROTO to 2 workers and back, against plain Ray transfers.

The batch is a PPO-sized one: 1024 sequences x 2048 tokens of input ids, attention mask, position ids
(int64) and log-probs (float32), about 56 MB. Three ways to move it, each timed over several rounds
(median, after one warm-up):

  dispatch       worker_group.echo(DataProto): pad/chunk, pickle, 2 actors, return, concat (hflow)
  plain_actors   ray.put of each half, the same 2 actors return their half, ray.get  (the target)
  plain_driver   ray.put + ray.get of the same tensors on the driver, no actors      (a floor)

Target (issue 2): dispatch within 1.5x of plain_actors.

    python bench/dispatch.py [--rounds 7] [--batch 1024] [--seqlen 2048]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import ray
import torch

from hflow.protocol import DataProto
from hflow.single_controller.base import Dispatch, Worker, register
from hflow.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

RESULTS = Path(__file__).parent / "results"


class EchoWorker(Worker):
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def echo(self, data: DataProto) -> DataProto:
        return data

    def echo_plain(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return tensors


def make_batch(batch: int, seqlen: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    mask = torch.ones(batch, seqlen, dtype=torch.int64)
    return {
        "input_ids": torch.randint(0, 32000, (batch, seqlen), generator=gen),
        "attention_mask": mask,
        "position_ids": torch.cumsum(mask, dim=1) - 1,
        "old_log_probs": -torch.rand(batch, seqlen, generator=gen),
    }


def timed(fn, rounds: int) -> list[float]:
    fn()  # warm-up
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--seqlen", type=int, default=2048)
    args = parser.parse_args()

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    wg = RayWorkerGroup(RayResourcePool([2], use_gpu=False), RayClassWithInitArgs(EchoWorker))
    tensors = make_batch(args.batch, args.seqlen)
    data = DataProto.from_dict(tensors)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    # Each worker's own contiguous copy: a row slice is a view whose pickle carries the whole storage, which
    # would make the baseline move twice the data.
    halves = [{k: v[i * args.batch // 2:(i + 1) * args.batch // 2].clone() for k, v in tensors.items()}
              for i in range(2)]

    def dispatch():
        out = wg.call(EchoWorker.echo, data)
        assert len(out) == args.batch

    def plain_actors():
        refs = [w.echo_plain.remote(ray.put(half)) for w, half in zip(wg.workers, halves)]
        parts = ray.get(refs)
        out = {k: torch.cat([p[k] for p in parts]) for k in tensors}
        assert out["input_ids"].shape[0] == args.batch

    def plain_driver():
        out = ray.get(ray.put(tensors))
        assert out["input_ids"].shape[0] == args.batch

    rows, spread = {}, {}
    for name, fn in (("dispatch", dispatch), ("plain_actors", plain_actors), ("plain_driver", plain_driver)):
        times = timed(fn, args.rounds)
        rows[name], spread[name] = statistics.median(times), (min(times), max(times))
    torch.testing.assert_close(wg.call(EchoWorker.echo, data).batch["old_log_probs"], tensors["old_log_probs"], rtol=0, atol=0)

    ratio = rows["dispatch"] / rows["plain_actors"]
    lines = [
        f"# DP_COMPUTE_PROTO round trip: {args.batch} x {args.seqlen} tokens, {nbytes / 2**20:.0f} MiB, 2 workers",
        "",
        f"median of {args.rounds} rounds after 1 warm-up; ratio = time / plain_actors",
        "",
        "| path | median s [min-max] | GB/s (there and back) | ratio |",
        "|---|---|---|---|",
    ]
    for name, seconds in rows.items():
        low, high = spread[name]
        lines.append(f"| {name} | {seconds:.4f} [{low:.4f}-{high:.4f}] | {2 * nbytes / seconds / 1e9:.2f} | "
                     f"{seconds / rows['plain_actors']:.2f} |")
    lines += ["", f"target: dispatch / plain_actors <= 1.5 -> {ratio:.2f} ({'met' if ratio <= 1.5 else 'NOT met'})"]
    table = "\n".join(lines)
    print(table)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "dispatch.md").write_text(table + "\n")
    (RESULTS / "dispatch.json").write_text(json.dumps(
        {"batch": args.batch, "seqlen": args.seqlen, "bytes": nbytes, "median_s": rows, "min_max_s": spread,
         "ratio": ratio}, indent=2))
    ray.shutdown()


if __name__ == "__main__":
    main()
