"""`trainer.deterministic=true`: the same command twice writes the same metrics (but timings) and the same
checkpoints; a trainer log-prob does not depend on the other samples of its micro-batch
(`hflow.utils.batch_invariant`); preflight names the options whose result depends on timing."""

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
                            "trainer.async_steps=2")
    with pytest.raises(ConfigError) as err:
        check_deterministic(config)
    assert "partial_rollout=true" in str(err.value) and "trainer.async_steps=2" in str(err.value)
    check_deterministic(default_config("trainer.deterministic=true", "trainer.async_steps=1"))
    check_deterministic(default_config("actor_rollout_ref.rollout.partial_rollout=true"))  # off: nothing to check
    assert default_config("trainer.deterministic=true").actor_rollout_ref.model.batch_invariant  # follows the switch


# The metrics that measure time or the machine (throughput, MFU, memory) rather than the training.
def comparable(record: dict) -> dict:
    return {key: value for key, value in record.items()
            if not key.startswith(("timing_", "perf/", "memory/")) or key == "perf/total_num_tokens"}


def run_twice(tmp_path: Path, *overrides: str) -> list[Path]:
    command = [sys.executable, "-m", "hflow.trainer.main_ppo", "algorithm.adv_estimator=grpo", "trainer.backend=local",
               "trainer.n_gpus_per_node=1", "trainer.total_training_steps=2", "trainer.save_freq=2",
               "trainer.test_freq=2", *overrides]
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
