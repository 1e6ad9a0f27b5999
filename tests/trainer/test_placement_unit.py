"""Cheap unit tests of the trainer's placement checks: no Ray, no model."""

import os

import pytest
from omegaconf import OmegaConf

from hflow.config_schema import ConfigError
from hflow.trainer.ppo.ray_trainer import RayPPOTrainer


class _FakeWorkerGroup:
    """Answers `path_exists` per worker: the ones in `sees` look at this file system, the others see nothing."""

    def __init__(self, sees: dict[str, bool]):
        self.worker_names = list(sees)
        self._sees = sees
        self.asked: list[str] = []

    def execute_all_sync(self, method_name: str, path: str) -> list[bool]:
        assert method_name == "path_exists"
        self.asked.append(path)
        return [sees and os.path.exists(path) for sees in self._sees.values()]


def _trainer(checkpoint_dir, sees: dict[str, bool], save_freq: int = 5, resume_mode: str = "auto") -> RayPPOTrainer:
    trainer = object.__new__(RayPPOTrainer)  # only what _check_checkpoint_dir reads
    trainer.config = OmegaConf.create({"trainer": {"save_freq": save_freq, "resume_mode": resume_mode,
                                                   "default_local_dir": str(checkpoint_dir)}})
    trainer.worker_group = _FakeWorkerGroup(sees)
    return trainer


def test_checkpoint_dir_not_seen_by_a_worker_stops_the_run_naming_the_key_and_the_worker(tmp_path):
    checkpoint_dir = tmp_path / "ckpt"
    trainer = _trainer(checkpoint_dir, {"train_pool_0:0": True, "train_pool_1:0": False})
    with pytest.raises(ConfigError) as error:
        trainer._check_checkpoint_dir()
    message = str(error.value)
    assert "trainer.default_local_dir" in message and str(checkpoint_dir) in message, message
    assert "train_pool_1:0" in message and "train_pool_0:0" not in message, message
    [probe] = trainer.worker_group.asked
    assert os.path.dirname(probe) == str(checkpoint_dir)
    assert list(checkpoint_dir.iterdir()) == []  # the probe file is gone


def test_checkpoint_dir_seen_by_every_worker_passes_and_leaves_nothing_behind(tmp_path):
    checkpoint_dir = tmp_path / "ckpt"
    trainer = _trainer(checkpoint_dir, {"train_pool_0:0": True, "rollout_pool_0:0": True})
    trainer._check_checkpoint_dir()
    assert len(trainer.worker_group.asked) == 1
    assert list(checkpoint_dir.iterdir()) == []


def test_checkpoint_dir_is_not_probed_when_the_run_neither_saves_nor_resumes(tmp_path):
    trainer = _trainer(tmp_path / "ckpt", {"train_pool_0:0": False}, save_freq=-1, resume_mode="disable")
    trainer._check_checkpoint_dir()
    assert trainer.worker_group.asked == []
