"""The local backend: the same worker classes and dispatch modes, one rank in the test's own process."""

import os
import subprocess
import sys
import traceback

import pytest

from hflow.protocol import DataProto
from hflow.single_controller.base import ClassWithInitArgs, create_colocated_worker_cls
from hflow.single_controller.local import LocalWorkerGroup
from tests.conftest import REPO_ROOT
from tests.single_controller.example_workers import ComputeWorker, CriticLike, _data


@pytest.fixture
def local_group():
    made = []
    yield lambda cls_with_init: made.append(LocalWorkerGroup(cls_with_init)) or made[-1]
    for group in made:
        group.shutdown()


def test_dispatch_modes_run_in_this_process(local_group):
    wg = local_group(ClassWithInitArgs(ComputeWorker, offset=1))
    assert wg.world_size == 1
    info, = wg.rank_info()
    assert (info["rank"], info["world_size"], info["local_rank"], info["pid"]) == (0, 1, 0, os.getpid())
    assert info["master"] == (wg.master_address, wg.master_port) and wg.master_port is not None
    assert wg.add_rank(1, y=2) == [4]
    assert wg.times_ten([3]) == [30]
    assert wg.dp_plus_one([1]) == [2]
    out = wg.tag_rank(_data(3))
    assert out.batch["a"].tolist() == [0, 1, 2] and out.meta_info["metrics"]["rows"] == [3]
    assert wg.sample_twice(_data(2)).batch["a"].tolist() == [0, 0, 1, 1]
    assert wg.count_rows(_data(5)) == [{"rank": 0, "rows": 5}]
    assert wg.only_rank_zero("x") == (0, "x")
    assert wg.custom([7]) == [7, 7]
    assert wg.all_reduce_rank() == [1.0]  # a real process group of one
    assert wg.execute_with_func_generator(lambda w, d: DataProto.from_dict({"a": d.batch["a"] * 2}),
                                          _data(3)).batch["a"].tolist() == [0, 2, 4]


def test_non_blocking_call_hands_its_result_to_another_group(local_group):
    wg = local_group(ClassWithInitArgs(ComputeWorker))
    result = wg.double_async(_data(3))  # async worker method, blocking=False: already computed here
    assert isinstance(result, DataProto) and result.batch["a"].tolist() == [0, 2, 4]
    submitted = wg.start(ComputeWorker.double_async, _data(3))  # any method, either backend: a call to collect later
    assert submitted.result().batch["a"].tolist() == [0, 2, 4]


def test_group_call_names_the_worker_method(local_group):
    """`call`/`start` take the worker method itself (what "go to definition" follows), and refuse anything
    that is not one of the group's registered methods, naming what the group has."""
    wg = local_group(ClassWithInitArgs(ComputeWorker))
    assert wg.call(ComputeWorker.double_async, _data(3)).batch["a"].tolist() == [0, 2, 4]
    assert wg.call(ComputeWorker.add_rank, 1) == wg.add_rank(1)
    with pytest.raises(TypeError, match="not a @register-ed worker method"):
        wg.call(len, [1])
    with pytest.raises(TypeError, match="not a method of this group's workers"):
        wg.call(CriticLike.scale_a, _data(2))


def test_colocated_roles_and_spawn(local_group):
    group = local_group(create_colocated_worker_cls({
        "actor": ClassWithInitArgs(ComputeWorker, offset=5),
        "critic": ClassWithInitArgs(CriticLike, scale=2),
    }))
    roles = group.spawn({"actor", "critic"})
    assert roles["actor"].add_rank(0) == [5]
    assert roles["critic"].scale_a(_data(3)).batch["a"].tolist() == [0, 2, 4]
    assert roles["critic"].pid() == [os.getpid()]
    assert not hasattr(roles["critic"], "add_rank") and not hasattr(roles["actor"], "scale_a")
    with pytest.raises(ValueError, match="no role"):
        group.spawn({"reward"})


def test_a_worker_error_is_the_original_exception_with_its_stack(local_group):
    class Failing(ComputeWorker):
        from hflow.single_controller.base import Dispatch, register

        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
        def explode(self, data):
            raise KeyError(f"bad row count {len(data)}")

    wg = local_group(ClassWithInitArgs(Failing))
    with pytest.raises(KeyError, match="bad row count 4") as err:
        wg.explode(_data(4))
    frames = [frame.name for frame in traceback.extract_tb(err.tb)]
    assert frames[-1] == "explode"  # a debugger stops in the worker method itself


def test_local_backend_imports_neither_ray_nor_vllm():
    """The single controller, the trainer and the workers' modules load without Ray or vLLM."""
    code = (
        "import sys\n"
        "from hflow.single_controller.base import ClassWithInitArgs\n"
        "from hflow.single_controller.local import LocalWorkerGroup\n"
        "from hflow.trainer.ppo.ray_trainer import RayPPOTrainer, make_worker_group\n"
        "import hflow.trainer.main_ppo, hflow.workers.fsdp_workers, hflow.workers.rollout\n"
        "from hflow.single_controller.base import Dispatch, Worker, register\n"
        "class Probe(Worker):\n"
        "    @register(dispatch_mode=Dispatch.ONE_TO_ALL)\n"
        "    def hello(self):\n"
        "        return 'hi'\n"
        "wg = LocalWorkerGroup(ClassWithInitArgs(Probe))\n"
        "assert wg.hello() == ['hi']\n"
        "wg.shutdown()\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'vllm'))\n"
        "assert not bad, bad\n"
    )
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]

