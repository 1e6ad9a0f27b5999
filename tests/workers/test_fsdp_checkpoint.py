"""Sharded checkpoints (DCP) of an FSDP2 model: exact round trips, saves that die half-way, and runs resumed
on another number of ranks (one rank holds a plain module, two hold FSDP2 shards)."""

import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hflow.workers import fsdp
from hflow.workers.fsdp.checkpoint import FSDPCheckpointManager, resolve_checkpoint
from hflow.tasks.tiny_models import build_causal_lm
from tests.ranks import free_port, spawn_ranks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_causal_lm(tmp_path_factory.mktemp("ckpt_model") / "tiny", preset="tiny")


def make_state(model_dir, mesh):
    model = fsdp.apply_fsdp2(fsdp.load_causal_lm(str(model_dir)), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return model, optimizer, scheduler


def train_step(model, optimizer, scheduler, seed):
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()


def full_params(model):
    return {name: tensor.clone() for name, tensor in fsdp.iter_full_params(model)}


def test_save_load_round_trip_is_exact_and_training_continues_identically(model_dir, world_of_one, tmp_path):
    model, optimizer, scheduler = make_state(model_dir, world_of_one)
    manager = FSDPCheckpointManager(model, optimizer, scheduler)
    train_step(model, optimizer, scheduler, seed=0)
    manager.save_checkpoint(tmp_path / "step1", global_step=1)
    saved = full_params(model)
    torch.manual_seed(123)
    train_step(model, optimizer, scheduler, seed=1)
    uninterrupted = full_params(model)

    extra = manager.load_checkpoint(tmp_path / "step1")
    assert extra["global_step"] == 1
    for name, tensor in full_params(model).items():
        assert torch.equal(tensor, saved[name]), name
    torch.manual_seed(123)
    train_step(model, optimizer, scheduler, seed=1)  # needs optimizer and scheduler state restored
    for name, tensor in full_params(model).items():
        assert torch.equal(tensor, uninterrupted[name]), name


def test_an_interrupted_save_leaves_the_previous_checkpoint_usable(model_dir, world_of_one, tmp_path, monkeypatch):
    model, optimizer, scheduler = make_state(model_dir, world_of_one)
    manager = FSDPCheckpointManager(model, optimizer, scheduler)
    path = tmp_path / "ckpt"
    manager.save_checkpoint(path, global_step=1)
    saved = full_params(model)
    train_step(model, optimizer, scheduler, seed=0)

    real_save = dcp.save

    def dies_after_writing(state, checkpoint_id):
        real_save(state, checkpoint_id=checkpoint_id)
        raise KeyboardInterrupt("killed while saving")

    monkeypatch.setattr(dcp, "save", dies_after_writing)
    with pytest.raises(KeyboardInterrupt):
        manager.save_checkpoint(path, global_step=2)  # overwrite in place: dies before the rename
    with pytest.raises(KeyboardInterrupt):
        manager.save_checkpoint(tmp_path / "never", global_step=2)
    monkeypatch.setattr(dcp, "save", real_save)

    assert not (tmp_path / "never").exists()  # no half-written checkpoint under a real name
    assert manager.load_checkpoint(path)["global_step"] == 1
    for name, tensor in full_params(model).items():
        assert torch.equal(tensor, saved[name]), name
    # A later save cleans up the leftover and succeeds.
    manager.save_checkpoint(path, global_step=3)
    assert manager.load_checkpoint(path)["global_step"] == 3


def test_a_save_that_dies_between_the_two_renames_is_still_found(model_dir, world_of_one, tmp_path):
    model, optimizer, scheduler = make_state(model_dir, world_of_one)
    manager = FSDPCheckpointManager(model, optimizer, scheduler)
    path = tmp_path / "ckpt"
    manager.save_checkpoint(path, global_step=5)
    path.rename(path.with_name("ckpt.replaced"))  # the state right after moving the old copy aside
    assert resolve_checkpoint(path) == path.with_name("ckpt.replaced")
    assert manager.load_checkpoint(path)["global_step"] == 5


def test_unknown_contents_are_rejected(model_dir, world_of_one):
    model, optimizer, scheduler = make_state(model_dir, world_of_one)
    with pytest.raises(ValueError, match="hf_model"):
        FSDPCheckpointManager(model, optimizer, scheduler, contents=["model", "weights"])


def test_rng_streams_round_trip_through_a_safe_load(tmp_path):
    """Extras are read with weights_only=True: the RNG state must survive it exactly."""
    import random

    import numpy as np

    from hflow.workers.fsdp.checkpoint import rng_state, set_rng_state

    torch.save(rng_state(), tmp_path / "rng.pt")
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.random(), np.random.rand(), torch.rand(3)  # move every stream on
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_a_checkpoint_that_would_run_code_is_refused(model_dir, world_of_one, tmp_path):
    model, optimizer, scheduler = make_state(model_dir, world_of_one)
    manager = FSDPCheckpointManager(model, optimizer, scheduler)
    final = manager.save_checkpoint(tmp_path / "step1", global_step=1)

    class RunsCode:
        def __reduce__(self):
            return (print, ("this ran while loading a checkpoint",))

    torch.save({"rng": RunsCode()}, final / "extra_rank_0.pt")
    with pytest.raises(Exception, match="Weights only load failed"):
        manager.load_checkpoint(final)


def _resume_on_two_ranks(rank, port, model_dir, root):
    """Rank `rank` of two: resume the one-rank checkpoint `root/one`, save it as `root/two` (the same
    state, in two ranks' shards), take the next two steps and write the full weights."""
    import torch.distributed as dist

    os.environ.update(HFLOW_DEVICE="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        model, optimizer, scheduler = make_state(model_dir, fsdp.build_device_mesh(2))
        manager = FSDPCheckpointManager(model, optimizer, scheduler)
        assert manager.load_checkpoint(Path(root) / "one")["global_step"] == 1
        manager.save_checkpoint(Path(root) / "two", global_step=1)
        for seed in (1, 2):  # the second step's rate is the resumed scheduler's (the first is the optimizer's)
            train_step(model, optimizer, scheduler, seed=seed)
        params = full_params(model)
        if rank == 0:
            torch.save(params, Path(root) / "two_ranks_next_step.pt")
    finally:
        dist.destroy_process_group()


def test_a_run_resumes_on_another_number_of_ranks(model_dir, world_of_one, tmp_path):
    # one rank (a plain module) -> two ranks (FSDP2) -> one rank: each continues as the run would have
    model, optimizer, scheduler = make_state(model_dir, world_of_one)
    assert not isinstance(model, torch.distributed.fsdp.FSDPModule)
    manager = FSDPCheckpointManager(model, optimizer, scheduler)
    for seed in range(2):  # the scheduler's rate moves with its step: a rank that lost it drifts
        train_step(model, optimizer, scheduler, seed=10 + seed)
    manager.save_checkpoint(tmp_path / "one", global_step=1)
    for seed in (1, 2):
        train_step(model, optimizer, scheduler, seed=seed)
    uninterrupted = full_params(model)
    spawn_ranks(_resume_on_two_ranks, 2, free_port(), str(model_dir), str(tmp_path))

    two_ranks = torch.load(tmp_path / "two_ranks_next_step.pt")
    assert two_ranks.keys() == uninterrupted.keys()
    for name, tensor in two_ranks.items():
        torch.testing.assert_close(tensor, uninterrupted[name], atol=1e-6, rtol=1e-5, msg=name)
    assert manager.load_checkpoint(tmp_path / "two")["global_step"] == 1
    for seed in (1, 2):
        train_step(model, optimizer, scheduler, seed=seed)
    for name, tensor in full_params(model).items():
        torch.testing.assert_close(tensor, uninterrupted[name], atol=1e-6, rtol=1e-5, msg=name)
