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
                                                   "resume_from_path": None, "max_actor_ckpt_to_keep": None,
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


class _Recorder:
    """A worker-group view that records checkpoint calls."""

    def __init__(self):
        self.saved: list[str] = []

    def save_checkpoint(self, path: str, global_step: int = 0) -> None:
        self.saved.append(path)

    def call(self, method, *args, **kwargs):  # as a group does: the named worker method
        return getattr(self, method.__name__)(*args, **kwargs)


class _Loader:
    def state_dict(self) -> dict:
        return {"epoch": 0, "position": 3}  # already past the batch drawn for the next step


def test_a_checkpoint_taken_with_rollouts_in_flight_resumes_by_drawing_those_batches_again(tmp_path):
    """Batches in flight (trainer.async_steps >= 1) are not saved: the checkpoint's data position is the
    oldest one's, so a resumed run draws them again and generates them with its own weights, and no
    sample from before the checkpoint can be trained beyond the staleness bound."""
    from collections import deque

    import torch

    from types import SimpleNamespace

    from hflow.trainer.ppo.rollout_source import PendingRollout, RolloutSource

    trainer = object.__new__(RayPPOTrainer)
    trainer.config = OmegaConf.create({"trainer": {"default_local_dir": str(tmp_path), "max_actor_ckpt_to_keep": None,
                                                   "resume_mode": "auto", "resume_from_path": None,
                                                   "async_steps": 2, "backend": "ray"},
                                       "reward_model": {"enable": False},
                                       "actor_rollout_ref": {"model": {"path": str(tmp_path / "model")},
                                                             "rollout": {"admission": "static"}},
                                       "critic": {"model": {"path": None}}})
    trainer.global_steps, trainer.use_critic, trainer.kl_ctrl_in_reward = 2, False, None
    trainer.scorer = SimpleNamespace(reward_norm=None)
    trainer.health = None
    trainer.actor_rollout_wg = _Recorder()
    trainer.train_dataloader = _Loader()
    trainer.rollouts = RolloutSource(trainer.config, trainer.actor_rollout_wg, trainer.train_dataloader)
    trainer.rollouts._pending = deque(PendingRollout(batch=None, gen_batch=None, call=None, version=1,
                                                     loader_state={"epoch": 0, "position": position})
                                      for position in (1, 2))
    trainer._save_checkpoint()
    state = torch.load(tmp_path / "global_step_2" / "data" / "state.pt", weights_only=True)
    assert state["dataloader"] == {"epoch": 0, "position": 1}
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "2"
    trainer.rollouts._pending = deque()  # nothing in flight: the loader's own position
    trainer._save_checkpoint()
    assert torch.load(tmp_path / "global_step_2" / "data" / "state.pt", weights_only=True)["dataloader"]["position"] == 3


def test_a_sample_with_a_token_beyond_the_staleness_bound_is_dropped_from_the_loss_and_counted():
    """The guard behind trainer.async_steps=k: staleness per sampled token (padding and tool tokens, -1 and
    mask 0, do not count); a sample holding one token more than k versions old loses its whole response mask."""
    import torch

    from hflow.protocol import DataProto

    from hflow.trainer.ppo.rollout_source import RolloutSource

    source = object.__new__(RolloutSource)
    source.version, source.async_steps = 5, 2
    versions = torch.tensor([[5, 4, 4, -1],   # staleness 0, 1, 1
                             [3, 3, 3, 3],    # 2: at the bound, kept
                             [2, 3, 3, -1],   # one token 3 versions old: dropped
                             [4, -1, 5, -1]])  # the -1 is a tool token (mask 0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 0], [1, 0, 1, 0]])
    batch = DataProto.from_dict({"rollout_versions": versions, "response_mask": mask.clone()})
    metrics = source.bound_staleness(batch, submitted_version=3)
    assert metrics["training/staleness/dropped_samples"] == 1
    assert batch.batch["response_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 1, 0]]
    kept = torch.tensor([0, 1, 1, 2, 2, 2, 2, 3, 2, 2, 1, 0], dtype=torch.float)  # every masked token, dropped ones too
    assert metrics["training/staleness/max"] == 3 and metrics["training/staleness/mean"] == pytest.approx(kept.mean().item())
    # without per-token versions (a colocated engine), the batch's submission version stands for every token
    plain = DataProto.from_dict({"response_mask": mask.clone()})
    assert source.bound_staleness(plain, submitted_version=4)["training/staleness/max"] == 1


class _Call:
    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


class _FakeGroup:
    """A worker group whose methods are plain functions; every call (`call` or `start`) is logged."""

    def __init__(self, log: list, world_size: int = 1, **methods):
        self.world_size = world_size
        for name, fn in methods.items():
            def call(*args, _name=name, _fn=fn):
                log.append(_name)
                return _fn(*args)

            call.start = lambda *args, _call=call: _Call(_call(*args))
            setattr(self, name, call)

    def call(self, method, *args):  # the group call by the worker method's name, as a WorkerGroup's
        return getattr(self, method.__name__)(*args)

    def start(self, method, *args):
        return getattr(self, method.__name__).start(*args)


def _sources(log: list, seen_meta: list):
    import torch

    from hflow.protocol import DataProto
    from hflow.trainer.ppo.rollout_source import RolloutSource, SplitRolloutSource

    def generate(gen_batch):
        seen_meta.append(dict(gen_batch.meta_info))
        return DataProto.from_dict({"responses": torch.ones(len(gen_batch), 2, dtype=torch.long)},
                                   meta_info={"metrics": {}})

    class Loader(list):
        def state_dict(self):
            return {}

    rows = {"input_ids": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 3, dtype=torch.long),
            "position_ids": torch.arange(3).repeat(2, 1)}
    config = OmegaConf.create({"trainer": {"async_steps": 0, "backend": "ray", "deterministic": False}, "reward_model": {"enable": False},
                               "actor_rollout_ref": {"rollout": {"admission": "static", "partial_rollout": False}}})
    generator = _FakeGroup(log, generate_sequences=generate, receive_weights=lambda manifest, version, exact: None)
    actor = _FakeGroup(log, send_weights=lambda manifest, version: [{"bytes": 2e9, "collectives": 3.0}])
    colocated = RolloutSource(config, _FakeGroup(log, generate_sequences=generate), Loader([rows] * 8))
    split = SplitRolloutSource(config, generator, Loader([rows] * 8), actor)
    return colocated, split


def test_the_split_source_streams_each_new_version_once_and_the_colocated_source_never():
    """One interface for both placements: the trainer only says when weights changed; the split source
    streams them to its pool (once per version, again after a rollback) and makes the pool wait for them."""
    log, seen_meta = [], []
    colocated, split = _sources(log, seen_meta)
    for step in range(3):
        colocated.next({}, steps_after=5)
        colocated.weights_updated()
    colocated.weights_restored(restored_version=3)
    colocated.next({}, steps_after=5)
    assert log == ["generate_sequences"] * 4
    assert all("min_weights_version" not in meta for meta in seen_meta)

    log.clear(), seen_meta.clear()
    _, metrics = split.next({}, steps_after=5)
    assert log == ["send_weights", "receive_weights", "generate_sequences"]
    assert metrics["perf/weight_stream_gb"] == 2.0 and metrics["perf/weight_stream_collectives"] == 3.0
    assert "timing_s/weight_stream" in metrics
    _, metrics = split.next({}, steps_after=5)  # the engines hold this version already
    assert log[3:] == ["generate_sequences"] and "perf/weight_stream_gb" not in metrics
    split.weights_updated()
    split.next({}, steps_after=5)
    split.weights_restored(restored_version=1)  # same version, other weights: streamed again
    split.next({}, steps_after=5)
    assert log[4:] == ["send_weights", "receive_weights", "generate_sequences"] * 2
    assert [meta["min_weights_version"] for meta in seen_meta] == [0, 0, 1, 1]


@pytest.mark.parametrize("restored,taken_next", [(1, [2, 3, 4]), (0, [2, 4, 5]), (None, [4, 5, 6])])
def test_a_rollback_keeps_the_batches_in_flight_the_restored_weights_sampled_and_drops_the_rest(restored, taken_next):
    """async_steps=2: when an update is rolled back, batch 2 (submitted at version 0) and batch 3 (version 1)
    are in flight. Restored to version 1 both stay; to version 0 batch 3, sampled by weights the rollback
    discards, goes; to a checkpoint's older state (None) both go. Dropped prompts are skipped, and the
    restored weights are streamed before the next batch starts."""
    import torch

    log, seen_meta = [], []
    _, split = _sources(log, seen_meta)
    split.async_steps = 2
    rows = iter(range(100))
    split._batches = ({"input_ids": torch.full((2, 3), next(rows)), "attention_mask": torch.ones(2, 3, dtype=torch.long),
                       "position_ids": torch.arange(3).repeat(2, 1)} for _ in range(100))

    def first_id(rollout):
        return int(rollout.gen_batch.batch["input_ids"][0, 0])

    assert first_id(split.next({}, steps_after=9)[0]) == 0
    split.weights_updated()
    assert first_id(split.next({}, steps_after=9)[0]) == 1
    split.weights_updated()  # the update that is rolled back
    assert [(first_id(p), p.version) for p in split._pending] == [(2, 0), (3, 1)]
    in_flight = split.weights_restored(restored)
    kept = sum(1 for i in taken_next[:2] if i in (2, 3))
    assert in_flight == {"health/in_flight_kept": float(kept), "health/in_flight_dropped": float(2 - kept)}
    log.clear()
    assert [first_id(split.next({}, steps_after=9)[0]) for _ in range(3)] == taken_next
    assert log[:2] == ["send_weights", "receive_weights"]  # the restored weights, before any new batch


def test_with_partial_rollouts_a_batch_with_a_token_newer_than_the_restored_weights_is_dropped():
    """Partial rollouts: a weight update reaches a batch during its generation, so a batch submitted at the
    restored version may hold tokens of the newer weights; those are read from its `rollout_versions`."""
    import torch

    from hflow.protocol import DataProto
    from hflow.trainer.ppo.rollout_source import SplitRolloutSource

    def generate(gen_batch):  # batch 2's last tokens came from version 1, sent while it generated
        newest = 1 if int(gen_batch.batch["input_ids"][0, 0]) == 2 else gen_batch.meta_info["min_weights_version"]
        versions = torch.tensor([[gen_batch.meta_info["min_weights_version"], newest]] * len(gen_batch))
        return DataProto.from_dict({"responses": torch.ones(len(gen_batch), 2, dtype=torch.long),
                                    "rollout_versions": versions}, meta_info={"metrics": {}})

    log = []
    config = OmegaConf.create({"trainer": {"async_steps": 2, "backend": "ray", "deterministic": False}, "reward_model": {"enable": False},
                               "actor_rollout_ref": {"rollout": {"admission": "static", "partial_rollout": True}}})
    generator = _FakeGroup(log, generate_sequences=generate, receive_weights=lambda manifest, version, exact: None)
    actor = _FakeGroup(log, send_weights=lambda manifest, version: [{"bytes": 1.0, "collectives": 1.0}])
    rows = iter(range(100))
    batches = ({"input_ids": torch.full((2, 3), next(rows)), "attention_mask": torch.ones(2, 3, dtype=torch.long),
                "position_ids": torch.arange(3).repeat(2, 1)} for _ in range(100))
    class Loader(list):
        def state_dict(self):
            return {}

    split = SplitRolloutSource(config, generator, Loader(), actor)
    split._batches = batches
    split.next({}, steps_after=9)
    split.weights_updated()
    split.next({}, steps_after=9)
    split.weights_updated()
    assert [p.version for p in split._pending] == [0, 1]
    assert split.weights_restored(0) == {"health/in_flight_kept": 0.0, "health/in_flight_dropped": 2.0}
