"""`trainer.deterministic=true`: the same command twice writes the same metrics (but timings) and the same
checkpoints; a trainer log-prob does not depend on the other samples of its micro-batch
(`hflow.utils.batch_invariant`), in the actor and through the worker that enters the mode; preflight names the
options whose result depends on timing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from hflow import CONFIG_DIR
from hflow.trainer.preflight import check_deterministic
from hflow.utils.batch_invariant import TILE_ROWS, batch_invariant
from hflow.workers.config import ConfigError
from tests.conftest import REPO_ROOT


@pytest.mark.parametrize("remove_padding", [False, True])
def test_a_log_prob_does_not_change_with_its_micro_batch_companions(tmp_path, remove_padding):
    from hflow.workers.actor import DataParallelPPOActor
    from hflow.workers.fsdp import load_causal_lm
    from tests.workers.test_dp_actor import build_model_dir, make_batch

    actor = DataParallelPPOActor(OmegaConf.create({"use_remove_padding": remove_padding}),
                                 load_causal_lm(str(build_model_dir(tmp_path / "model"))))
    data = make_batch(16, seed=5)
    alone = []
    with batch_invariant():
        for micro_batch_size in (1, 3, 16):  # each row alone, with 2 others, with all 15 others
            data.meta_info["micro_batch_size"] = micro_batch_size
            alone.append(actor.compute_log_prob(data)[0])
        # the same rows with other company: the first 4 among 12 new ones
        other = make_batch(16, seed=6)
        for key in data.batch.keys():
            other.batch[key][:4] = data.batch[key][:4]
        other.meta_info["micro_batch_size"] = 16
        mixed = actor.compute_log_prob(other)[0]
    for log_probs in alone[1:]:
        assert torch.equal(log_probs, alone[0])  # bitwise
    assert torch.equal(mixed[:4], alone[0][:4])
    assert data.batch["input_ids"].numel() > TILE_ROWS  # the packed and padded rows span several tiles


def test_batch_invariant_restores_the_deterministic_setting():
    before = torch.are_deterministic_algorithms_enabled()
    with batch_invariant():
        assert torch.are_deterministic_algorithms_enabled()
        a, b = torch.randn(5, 7), torch.randn(7, 3)
        torch.testing.assert_close(a @ b, torch.nn.functional.linear(a, b.T), rtol=1e-6, atol=1e-6)
    assert torch.are_deterministic_algorithms_enabled() == before


def default_config(*overrides):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name="ppo_trainer", overrides=list(overrides))


def test_preflight_names_the_options_that_depend_on_timing():
    config = default_config("trainer.deterministic=true", "actor_rollout_ref.rollout.partial_rollout=true",
                            "actor_rollout_ref.rollout.admission=continuous", "trainer.async_steps=2")
    with pytest.raises(ConfigError) as err:
        check_deterministic(config)
    assert "partial_rollout=true" in str(err.value) and "admission=continuous" in str(err.value)
    assert "async_steps" not in str(err.value)  # exact weight versions make k >= 2 repeatable
    check_deterministic(default_config("trainer.deterministic=true", "trainer.async_steps=1"))
    check_deterministic(default_config("trainer.deterministic=true", "trainer.async_steps=2"))
    check_deterministic(default_config("actor_rollout_ref.rollout.partial_rollout=true"))  # off: nothing to check
    assert default_config("trainer.deterministic=true").actor_rollout_ref.model.batch_invariant  # follows the switch


# The metrics that measure time or the machine (throughput, MFU, memory) rather than the training.
def comparable(record: dict) -> dict:
    return {key: value for key, value in record.items()
            if not key.startswith(("timing_", "perf/", "memory/")) or key == "perf/total_num_tokens"}


LOCAL_TWO_STEPS = ("trainer.backend=local", "trainer.n_gpus_per_node=1", "trainer.total_training_steps=2",
                   "trainer.save_freq=2", "trainer.test_freq=2")


def run_twice(tmp_path: Path, *overrides: str, base: tuple[str, ...] = LOCAL_TWO_STEPS) -> list[Path]:
    command = [sys.executable, "-m", "hflow.trainer.main_ppo", "algorithm.adv_estimator=grpo", *base, *overrides]
    dirs = [tmp_path / "first", tmp_path / "second"]
    runs = []
    for run_dir in dirs:  # side by side (one torch thread each by default on CPU): they must agree whatever else runs
        run_dir.mkdir()
        env = {**os.environ, "PYTHONPATH": REPO_ROOT, "OMP_NUM_THREADS": "1"}
        runs.append(subprocess.Popen(command, cwd=run_dir, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for run in runs:
        out, err = run.communicate(timeout=900)
        assert run.returncode == 0, out[-2000:] + err[-4000:]
    return dirs


@pytest.mark.slow  # two training runs
def test_two_deterministic_runs_write_the_same_metrics_and_checkpoints(tmp_path):
    first, second = run_twice(tmp_path, "trainer.deterministic=true")
    metrics = [[json.loads(line) for line in open(d / "logs" / "hflow" / "default" / "metrics.jsonl")]
               for d in (first, second)]
    assert len(metrics[0]) == len(metrics[1]) >= 2
    assert any("actor/pg_loss" in r and r.get("actor/grad_norm", 0) > 0 for r in metrics[0])  # it trained
    for a, b in zip(*metrics):
        assert comparable(a) == comparable(b)
    files = sorted(p.relative_to(first) for p in (first / "checkpoints").rglob("*") if p.is_file())
    weights = [f for f in files if f.suffix in (".safetensors", ".distcp", ".pt")]
    assert weights, files
    for name in files:
        if name.suffix in (".safetensors", ".distcp", ".pt", ".bin"):
            assert (first / name).read_bytes() == (second / name).read_bytes(), name


@pytest.mark.slow  # two training runs on Ray
def test_two_deterministic_runs_two_steps_off_write_the_same_metrics_and_checkpoints(tmp_path):
    """Split placement, async_steps=2: the rollout pool samples each batch with exactly the weights of the
    version it was submitted with (updates that arrive earlier wait, staged), so how far ahead the training
    pool runs changes nothing; tokens two versions old are trained with decoupled PPO."""
    split_async = ("trainer.n_gpus_per_node=2", "trainer.placement=split", "trainer.rollout_n_gpus=1",
                   "trainer.async_steps=2", "algorithm.rollout_is=token", "trainer.total_training_steps=4",
                   "trainer.save_freq=4", "trainer.test_freq=4", "ray_init.num_cpus=2")
    first, second = run_twice(tmp_path, "trainer.deterministic=true", base=split_async)
    metrics = [[json.loads(line) for line in open(d / "logs" / "hflow" / "default" / "metrics.jsonl")]
               for d in (first, second)]
    steps = [r for r in metrics[0] if "actor/pg_loss" in r]
    assert [r["training/staleness/max"] for r in steps] == [0, 1, 2, 2]  # the pipeline filled
    for a, b in zip(*metrics, strict=True):
        assert comparable(a) == comparable(b)
    weights = [p.relative_to(first) for p in (first / "checkpoints").rglob("*")
               if p.suffix in (".safetensors", ".distcp", ".pt")]
    assert any("actor" in str(name) for name in weights), weights
    for name in weights:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


@pytest.fixture()
def two_threads():
    """Two torch threads in this test: this CPU's BLAS then rounds a 1-row and a 16-row product differently on
    both the padded and the packed path (with one thread the padded path's rounding agreed)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("remove_padding", [False, True])
def test_the_worker_scores_a_row_the_same_alone_or_among_sixteen(tmp_path, world_of_one, two_threads, remove_padding):
    """`trainer.deterministic=true` reaches the worker: its compute_log_prob, at micro-batch sizes 1 and 16,
    gives bitwise the same log-probs, where the same actor outside the mode does not."""
    from hflow.protocol import DataProto
    from hflow.tasks.tiny_models import build_causal_lm
    from hflow.workers.fsdp_workers import ActorRolloutRefWorker
    from tests.workers.test_dp_actor import make_batch

    model_path = build_causal_lm(tmp_path / "model", preset="tiny")
    data = make_batch(16, seed=5)

    def rows() -> DataProto:
        return DataProto.from_dict({key: data.batch[key] for key in ("input_ids", "attention_mask", "position_ids",
                                                                     "responses")})

    in_mode, outside = [], []
    for micro_batch_size in (1, 16):
        config = default_config("trainer.deterministic=true", f"actor_rollout_ref.model.path={model_path}",
                                f"actor_rollout_ref.model.use_remove_padding={remove_padding}",
                                "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
                                f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro_batch_size}")
        OmegaConf.resolve(config)
        worker = ActorRolloutRefWorker(config.actor_rollout_ref, role="actor")
        worker.init_model()
        in_mode.append(worker.compute_log_prob(rows()).batch["old_log_probs"])
        plain = rows()
        plain.meta_info.update(micro_batch_size=micro_batch_size,
                               temperature=config.actor_rollout_ref.rollout.temperature)
        outside.append(worker.actor.compute_log_prob(plain)[0])  # the worker's actor, no mode around it
    # the premise: without the mode the two micro-batch shapes round differently here
    assert not torch.equal(outside[0], outside[1]), "this BLAS is batch-invariant here: the test cannot see the mode"
    difference = (in_mode[0] - in_mode[1]).abs().max()
    assert torch.equal(in_mode[0], in_mode[1]), f"log-probs differ by up to {difference:.2e} between micro-batches"
