"""Shared fixtures. Ray is started once per test session (about 3 s) and shared by every Ray test."""

import os
from pathlib import Path

import pytest

REPO_ROOT = str(Path(__file__).resolve().parent.parent)

# In-process vLLM engines (the workers share their torch.distributed world with them) and no hidden
# torch.compile in the sampler (minutes of compiling on a CPU, for nothing).
WORKER_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "TORCHDYNAMO_DISABLE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_DEDUP_LOGS": "0",
}
os.environ.update(WORKER_ENV)


@pytest.fixture(scope="session")
def ray_session():
    import ray

    if not ray.is_initialized():
        # Worker classes defined in test modules are imported by name in the actors: put the repo root
        # (the parent of the `tests` package) on their path.
        env = {**WORKER_ENV, "PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")]))}
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=True, runtime_env={"env_vars": env})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def world_of_one():
    """A torch.distributed group of one process (what FSDP2 and DCP need), torn down after the module."""
    import torch.distributed as dist

    from hflow.utils import device
    from hflow.workers.fsdp import build_device_mesh
    from tests.ranks import free_port

    device.set_device()
    dist.init_process_group(device.dist_backend(), init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield build_device_mesh(1)
    dist.destroy_process_group()


@pytest.fixture()
def fsdp_on_one_rank(monkeypatch):
    """FSDP2 even where `apply_fsdp2` would leave a one-rank model plain (fp32, nothing to cast): for the
    tests of FSDP2's own behaviour (resharding, gathering) in a worker built on `world_of_one`."""
    from hflow.workers.fsdp import sharding

    monkeypatch.setattr(sharding, "fsdp_needed", lambda *args, **kwargs: True)


@pytest.fixture()
def pretend_cuda(monkeypatch):
    """The device helper answers 'cuda' (its detection asks torch), for code that only reads the answer."""
    import torch

    from hflow.utils import device

    monkeypatch.delenv("HFLOW_DEVICE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    device._detect.cache_clear()
    assert device.is_cuda()
    yield
    monkeypatch.undo()
    device._detect.cache_clear()


def pytest_collection_modifyitems(items):
    """Each test's tier (and pytest-xdist worker) goes into the duration record's junit XML (scripts/test.sh
    with HFLOW_TEST_RECORD; scripts/suite_time.py reads it)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    for item in items:
        tier = "slow" if item.get_closest_marker("slow") else "fast"
        item.user_properties += [("tier", tier)] + ([("worker", worker)] if worker else [])
