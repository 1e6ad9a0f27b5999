"""The rank contract every worker follows (hflow.single_controller.base.worker), checked where it can be
on CPU, so that it holds on an 8-GPU node where each Ray actor sees exactly one device.

`LOCAL_RANK` is the index of the worker's device among those it can see (0 under Ray), never its
position on the node: vLLM's in-process executor reads it and asserts `local_rank < device_count()`,
and torch.cuda.set_device uses it. The node position is `NODE_LOCAL_RANK`.
"""

import pytest
import torch

pytest.importorskip("ray", reason="needs Ray (the GPU check's machine has none)")

from hflow.utils import device


@pytest.fixture
def pretend_cuda(monkeypatch):
    """The device helper as it answers on a GPU worker that Ray gave `n` visible devices."""
    def visible(n):
        monkeypatch.setattr(device, "device_name", lambda: "cuda")
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return visible


def test_local_rank_past_the_visible_devices_is_an_error(pretend_cuda, monkeypatch):
    pretend_cuda(1)  # a Ray actor holding one GPU
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert device.local_device_index() == 0
    monkeypatch.setenv("LOCAL_RANK", "3")  # what a node-position LOCAL_RANK would give rank 3
    with pytest.raises(RuntimeError, match="LOCAL_RANK=3 but this process sees 1 GPU"):
        device.local_device_index()
    pretend_cuda(8)  # torchrun: every process sees the whole node, LOCAL_RANK picks the device
    assert device.local_device_index() == 3


def test_gpu_process_groups_keep_host_collectives_off_nccl(pretend_cuda):
    assert device.dist_backend() == "gloo"
    pretend_cuda(1)
    assert device.dist_backend() == "cpu:gloo,cuda:nccl"


def test_the_cluster_not_the_driver_decides_gpu_workers(monkeypatch):
    monkeypatch.delenv("HFLOW_DEVICE", raising=False)
    assert device.cluster_has_gpus({"CPU": 128, "GPU": 8})  # even when this driver has no GPU
    assert not device.cluster_has_gpus({"CPU": 2})
    monkeypatch.setenv("HFLOW_DEVICE", "cpu")
    assert not device.cluster_has_gpus({"CPU": 128, "GPU": 8})


GPU_NODE_SCRIPT = r'''
import json, os, sys
import ray
from omegaconf import OmegaConf
from hflow.single_controller.base import ClassWithInitArgs, Dispatch, Worker, register
from hflow.trainer.ppo.ray_trainer import make_worker_group

class Probe(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def report(self):
        import torch.distributed as dist
        from hflow.utils import device

        self.init_distributed()
        return {"rank": self.rank, "world_size": self.world_size, "env_rank": int(os.environ["RANK"]),
                "local_rank": int(os.environ["LOCAL_RANK"]), "node_local_rank": int(os.environ["NODE_LOCAL_RANK"]),
                "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"]),
                "visible": os.environ.get("CUDA_VISIBLE_DEVICES", ""), "visible_devices": device.visible_device_count(),
                "device_index": device.local_device_index(), "device": str(device.get_device()),
                "backend": dist.get_backend(), "master": (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]),
                "threads": os.environ.get("OMP_NUM_THREADS"), "gpu_ids": ray.get_gpu_ids()}

# One node as Ray sees an 8-GPU machine with 32 cores (the GPUs are a declared resource here: the
# actors' torch stays on the CPU, but Ray schedules and isolates them exactly as on real GPUs).
ray.init(num_cpus=32, num_gpus=8, include_dashboard=False, log_to_driver=False,
         runtime_env={"env_vars": {"PYTHONPATH": sys.argv[1]}})
trainer = OmegaConf.create({"backend": "ray", "nnodes": 1, "n_gpus_per_node": 8, "cpus_per_worker": 1,
                            "threads_per_worker": None})
group = make_worker_group(trainer, ClassWithInitArgs(Probe))
print(json.dumps(group.report()))
group.shutdown()
ray.shutdown()
'''


@pytest.mark.slow  # eight ranks
@pytest.mark.alone  # eight workers at once
def test_on_an_eight_gpu_node_each_worker_sees_one_gpu_at_local_rank_zero(tmp_path):
    """The trainer's worker group on a cluster that has 8 GPUs: one GPU bundle per worker, Ray narrows
    CUDA_VISIBLE_DEVICES to that GPU, LOCAL_RANK indexes it (0), and each worker gets an even share of
    the node's cores as torch threads (32 CPUs / 8 GPUs) while reserving one CPU. The eight join one
    process group (torch stays on the CPU here: gloo) with the ranks and rendezvous of the contract."""
    import json
    import os
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    script = tmp_path / "gpu_node.py"
    script.write_text(GPU_NODE_SCRIPT)
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "HFLOW_DEVICE": ""}
    run = subprocess.run([sys.executable, str(script), REPO_ROOT], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    reports = json.loads(run.stdout.strip().splitlines()[-1])
    assert [r["rank"] for r in reports] == list(range(8))
    assert sorted(r["node_local_rank"] for r in reports) == list(range(8))
    visible = [r["visible"].split(",") for r in reports]
    assert all(len(ids) == 1 for ids in visible), visible  # one device per worker
    assert sorted(ids[0] for ids in visible) == [str(i) for i in range(8)]  # all eight, none shared
    for r in reports:
        assert r["local_rank"] == 0 < len(r["visible"].split(","))  # vLLM: local_rank < device_count
        assert r["threads"] == "4"
    # the rank contract: RANK is the worker's rank, NODE_LOCAL_RANK its place on the node, LOCAL_RANK the
    # index of its device among those it sees (what vLLM asserts inside LLM(...)), one rendezvous (rank 0's)
    assert [r["env_rank"] for r in reports] == list(range(8))
    for r in reports:
        assert r["world_size"] == r["local_world_size"] == 8
        assert r["local_rank"] < r["visible_devices"] and r["local_rank"] == r["device_index"] == 0, r
        assert r["device"] == "cpu" and r["backend"] == "gloo"
    assert len({tuple(r["master"]) for r in reports}) == 1
