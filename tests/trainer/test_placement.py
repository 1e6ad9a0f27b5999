"""`trainer.placement=split`: the built-in task learns with generation on a rollout pool of its own, fed by
the weight stream after every update (one step off-policy, `trainer.async_steps=1`, is tested on two nodes in
test_multinode.py; a resumed split run hands the restored weights to the engines before they sample, in
test_async.py).

With 2 devices the training pool is one worker and the rollout pool one vLLM engine. In fp32 the engine's
log-probs equal the trainer's after every stream, which is what shows that every weight arrived.
"""

import contextlib
import json

import pytest
from hydra import compose, initialize_config_dir

from hflow import CONFIG_DIR
from hflow.trainer.main_ppo import run_ppo
from tests.trainer.learning import assert_learned, validation_curve

pytestmark = pytest.mark.slow  # a learning run (split placement)



def run_builtin(run_dir, *overrides: str) -> list[dict]:
    """The README's main job in `run_dir` (logs/ and checkpoints/ go there, as for a user), with `overrides`."""
    with contextlib.chdir(run_dir), initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        config = compose(config_name="ppo_trainer", overrides=["algorithm.adv_estimator=grpo", *overrides])
        run_ppo(config, frozenset(o.split("=", 1)[0] for o in overrides))
    with open(run_dir / "logs" / "hflow" / "default" / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def _learned(records: list[dict]) -> list[float]:
    curve = validation_curve(records)
    assert_learned(curve)
    return [curve[step] for step in sorted(curve)]


# the sampler-vs-trainer check at every step (on-policy runs otherwise make it every 10th), after every stream
SPLIT = ("trainer.placement=split", "trainer.rollout_n_gpus=1", "trainer.test_freq=4", "algorithm.rollout_check_freq=1")


@pytest.fixture(scope="module")
def split_run(ray_session, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("split")
    # 0.1 MiB buckets: the built-in model's 1.8 MB travel as packed buckets and as tensors too large for one
    return run_dir, run_builtin(run_dir, *SPLIT, "trainer.total_training_steps=4",
                                f"actor_rollout_ref.rollout.weight_bucket_mb={BUCKET_MB}")


BUCKET_MB = 0.1


def planned_broadcasts(bucket_mb: float) -> tuple[int, int]:
    """(tensors, broadcasts) of one update of the built-in model in buckets of `bucket_mb`."""
    import torch

    from hflow.tasks.builtin_task import ensure_builtin_assets
    from hflow.workers.fsdp import full_param_shapes, load_causal_lm
    from hflow.workers.weight_sync import manifest_of

    manifest = manifest_of(full_param_shapes(load_causal_lm(ensure_builtin_assets().model_path)), torch.float32,
                           bucket_mb)
    return len(manifest.entries), len(manifest.buckets())


def test_split_placement_learns_and_the_engine_matches_the_trainer_after_every_stream(split_run):
    _, records = split_run
    _learned(records)
    steps = [r for r in records if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for step in steps:
        assert step["training/staleness"] == 0
        # the sampler's log-probs of its own tokens against the trainer's, after each update was streamed
        assert step["training/rollout_log_probs_diff_max"] < 1e-4, step
    streamed = [r for r in steps if "timing_s/weight_stream" in r]
    assert len(streamed) >= 3 and all(r["perf/weight_stream_gb"] > 0 for r in streamed)
    # one collective per bucket, fewer than one per tensor; the log-prob check above shows they arrived whole
    tensors, broadcasts = planned_broadcasts(BUCKET_MB)
    assert 1 < broadcasts < tensors, (broadcasts, tensors)
    assert all(r["perf/weight_stream_collectives"] == broadcasts for r in streamed), streamed
