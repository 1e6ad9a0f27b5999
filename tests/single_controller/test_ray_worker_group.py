"""Worker groups on real Ray actors (2 CPU workers): dispatch modes, futures, colocation, failures."""

import time

import pytest
import torch

pytest.importorskip("ray", reason="needs Ray (the GPU check's machine has none)")

from hflow.protocol import DataProto, DataProtoFuture  # noqa: E402
from hflow.single_controller.ray import (  # noqa: E402
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    WorkerGroupError,
    create_colocated_worker_cls,
)
from tests.single_controller.example_workers import (  # noqa: E402
    ComputeWorker,
    CriticLike,
    _data,
    fresh_worker_class,
)

WORLD = 2


def make_group(cls_with_init, world=WORLD) -> RayWorkerGroup:
    return RayWorkerGroup(RayResourcePool([world], use_gpu=False), cls_with_init)


@pytest.fixture(scope="module")
def wg(ray_session):
    group = make_group(RayClassWithInitArgs(ComputeWorker, offset=1))
    yield group
    group.shutdown()


@pytest.fixture(scope="module")
def colocated(ray_session):
    """An actor role and a critic role in one process per rank: the colocation test reads it, the future
    test sends into its critic and the overlap test naps on its actor (each new actor process costs ~8 s of
    CPU importing torch here, so the module builds as few as it can)."""
    group = make_group(create_colocated_worker_cls({
        "actor": RayClassWithInitArgs(ComputeWorker, offset=5),
        "critic": RayClassWithInitArgs(CriticLike, scale=2),
    }))
    yield group, group.spawn({"actor", "critic"})
    group.shutdown()


@pytest.fixture
def groups(ray_session):
    """Worker groups made in one test, shut down (resources released) after it."""
    made = []
    yield lambda cls_with_init: made.append(make_group(cls_with_init)) or made[-1]
    for group in made:
        group.shutdown()


def _expected_tags(n, world=WORLD):
    chunk = -(-n // world)
    return [i + 100 * (i // chunk) for i in range(n)]


def test_rank_info_and_rendezvous(wg):
    infos = wg.rank_info()
    assert [i["rank"] for i in infos] == [0, 1]
    assert all(i["world_size"] == WORLD for i in infos)
    assert {i["master"] for i in infos} == {(wg.master_address, wg.master_port)}
    assert wg.master_port is not None
    assert len({i["pid"] for i in infos}) == WORLD


def test_default_is_one_cpu_and_one_thread_per_worker(wg):
    assert wg.threads() == [(1, "1")] * WORLD  # cpus_per_worker=2: test_a_configured_group_...


def test_one_to_all_args_and_kwargs(wg):
    assert wg.add_rank(1, y=2) == [4, 5]  # 1 + 2 + rank + offset 1
    assert wg.add_rank(x=1) == [2, 3]


def test_all_to_all_scatters_lists_of_world_size_and_broadcasts_others(wg):
    assert wg.times_ten([1, 2]) == [10, 20]
    assert wg.times_ten(3) == [30, 30]
    assert wg.times_ten(x=[1, 2]) == [10, 20]


def test_dp_compute_requires_per_rank_lists(wg):
    assert wg.dp_plus_one([1, 2]) == [2, 3]
    with pytest.raises(ValueError, match="one entry per rank"):
        wg.dp_plus_one([1, 2, 3])


@pytest.mark.parametrize("n", [4, 5, 1, 7])
@pytest.mark.parametrize("as_kwarg", [False, True])
def test_dp_compute_proto_even_and_uneven(wg, n, as_kwarg):
    out = wg.tag_rank(data=_data(n)) if as_kwarg else wg.tag_rank(_data(n))
    assert out.batch["a"].tolist() == _expected_tags(n)
    assert out.non_tensor_batch["na"].tolist() == [f"s{i}" for i in range(n)]
    # concat merges the metrics of every rank (not only rank 0's)
    assert sum(out.meta_info["metrics"]["rows"]) == -(-n // WORLD) * WORLD


def test_dp_compute_proto_two_data_args_and_mismatched_lengths(wg):
    other = DataProto.from_dict({"b": torch.arange(5) * 7})
    out = wg.tag_rank(_data(5), other=other)
    assert out.batch["b"].tolist() == [0, 7, 14, 21, 28]
    with pytest.raises(ValueError, match="different lengths"):
        wg.tag_rank(_data(5), other=DataProto.from_dict({"b": torch.arange(4)}))
    with pytest.raises(TypeError, match="DataProto"):
        wg.tag_rank(torch.arange(4))


def test_uneven_batch_with_repeating_method_is_unpadded(wg):
    out = wg.sample_twice(_data(3))
    assert out.batch["a"].tolist() == [0, 0, 1, 1, 2, 2]


def test_dp_compute_metric_returns_per_rank_list(wg):
    assert wg.count_rows(_data(6)) == [{"rank": 0, "rows": 3}, {"rank": 1, "rows": 3}]


def test_execute_rank_zero(wg):
    assert wg.only_rank_zero("x") == (0, "x")
    assert wg.execute_rank_zero_sync("getenv", "RANK") == "0"


def test_custom_dispatch_dict(wg):
    assert wg.custom([7, 8]) == [7, 8, 7, 8]


def test_driver_function_runs_on_every_rank(wg):
    def add_rank(worker, data):
        return DataProto.from_dict({"a": data.batch["a"] + worker.rank})

    out = wg.execute_with_func_generator(add_rank, _data(4))
    assert out.batch["a"].tolist() == [0, 1, 3, 4]
    assert wg.execute_func_rank_zero(lambda a, b: a + b, 2, 3) == 5


@pytest.mark.parametrize("n", [4, 5])
def test_non_blocking_future_passed_into_another_group(wg, colocated, n):
    future = wg.double_async(_data(n))
    assert isinstance(future, DataProtoFuture)
    out = colocated[1]["critic"].scale_a(future)  # materialised on the receiving ranks
    chunk = -(-n // WORLD)
    doubled = [2 * i + (i // chunk) for i in range(n)]
    assert out.batch["a"].tolist() == [2 * v for v in doubled]
    assert future.get().batch["a"].tolist() == doubled  # the future itself comes back unpadded


@pytest.mark.parametrize("order", [("ray.remote", "plain"), ("plain", "ray.remote")])
def test_ray_remote_and_plain_class_both_build_groups_in_either_order(groups, order):
    """verl's form `RayClassWithInitArgs(cls=ray.remote(W))` and the plain `RayClassWithInitArgs(W)` work
    side by side, whichever comes first: `ray.remote(W)` pins W's signatures on its methods, and the rank
    side's wrappers must still accept the padding information of uneven batches and futures."""
    import ray

    worker_cls = fresh_worker_class()  # no ray.remote has touched it yet
    forms = {"ray.remote": lambda: RayClassWithInitArgs(cls=ray.remote(worker_cls)),
             "plain": lambda: RayClassWithInitArgs(worker_cls)}
    built = []
    for form in order:
        group = groups(forms[form]())
        built.append(group)
        # 5 rows on 2 ranks: padded to 6, one padding row on rank 1 (as an argument and as keywords)
        assert group.tag_rank(_data(5)).batch["a"].tolist() == [0, 1, 2, 103, 104], form
        out = group.tag_rank(data=_data(5), other=DataProto.from_dict({"b": torch.arange(5) * 7}))
        assert out.batch["a"].tolist() == [0, 1, 2, 103, 104] and out.batch["b"].tolist() == [0, 7, 14, 21, 28], form
    # A non-blocking result of one group goes into the other's method, in both directions.
    for producer, consumer in (built, built[::-1]):
        future = producer.double_later(_data(5))
        assert isinstance(future, DataProtoFuture)
        assert consumer.tag_rank(future).batch["a"].tolist() == [0, 2, 4, 106, 108]
        assert consumer.tag_rank(data=producer.double_later(_data(3))).batch["a"].tolist() == [0, 2, 104]


def test_gloo_all_reduce_across_ranks(wg):
    assert wg.all_reduce_rank() == [3.0, 3.0]


def test_colocated_roles_share_one_process_and_spawn_per_role_groups(colocated):
    group, roles = colocated
    actor_pids = [info["pid"] for info in roles["actor"].rank_info()]
    assert roles["critic"].pid() == actor_pids
    assert len(set(actor_pids)) == WORLD
    assert roles["actor"].add_rank(0) == [5, 6]
    assert roles["critic"].scale_a(_data(3)).batch["a"].tolist() == [0, 2, 4]
    assert roles["actor"].tag_rank(_data(3)).batch["a"].tolist() == _expected_tags(3)
    assert not hasattr(roles["critic"], "add_rank")
    with pytest.raises(ValueError, match="no role"):
        group.spawn({"reward"})


# Last of the tests on `colocated`: its rank 0 is left waiting in a barrier that rank 1 never reaches.
def test_submitted_calls_on_two_groups_run_at_the_same_time_and_a_worker_error_names_it(wg, colocated):
    """`group.start(Worker.method, ...)` returns at once; calls on groups of other processes overlap (as generation on
    the rollout pool overlaps training with trainer.async_steps=1); `result()` collects as a blocking call. A rank
    that raises ends the blocking call at once, naming the worker, its rank and the method (the `start` form's
    error: test_a_configured_group_from_start_to_shutdown)."""
    other = colocated[1]["actor"]
    other.nap(0)  # started and warm
    started = time.monotonic()
    first, second = wg.start(ComputeWorker.nap, 1.0), other.start(ComputeWorker.nap, 1.0)
    assert time.monotonic() - started < 0.5
    intervals = first.result() + second.result()
    assert len(intervals) == 2 * WORLD
    assert max(start for start, _ in intervals) < min(end for _, end in intervals)  # all four naps overlapped
    assert first.result() is first.result()  # collected once
    assert wg.start(ComputeWorker.add_rank, 1).result() == [2, 3]  # the same collect as the blocking call

    start = time.monotonic()
    with pytest.raises(WorkerGroupError) as err:
        other.fail_on_rank_one()  # rank 0 waits in a collective for rank 1, which raised
    assert time.monotonic() - start < 15
    message = str(err.value)
    assert "rank 1" in message and "fail_on_rank_one" in message and "boom from rank one" in message
    assert other.worker_names[1] in message and other.worker_names[1].endswith("_0:1"), message


def test_pool_larger_than_cluster_fails_at_once(ray_session):
    start = time.monotonic()
    with pytest.raises(ValueError, match="needs 64 CPU"):
        make_group(RayClassWithInitArgs(CriticLike, scale=1), world=64)
    assert time.monotonic() - start < 5


def test_a_configured_group_from_start_to_shutdown(ray_session):
    """One group with options, through its life: `cpus_per_worker` sets each worker's threads; a stale
    MASTER_ADDR/PORT the actors inherit (from the driver, or set by the user) does not pair the ranks on a
    wrong port (the group uses rank 0's published address) while the user's other variables reach them; a
    submitted call whose rank raises fails naming it; a dead worker is reported by name; shutdown gives
    the pool's resources back. (One group rather than one per claim: each costs two actor processes.)"""
    import ray

    free_before = ray.available_resources().get("CPU", 0)
    cls = RayClassWithInitArgs(ComputeWorker)
    cls.update_options({"runtime_env": {"env_vars": {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
                                                     "HFLOW_TEST_MARKER": "kept"}}})
    with pytest.raises(ValueError, match="cpus_per_worker"):
        RayResourcePool([1], use_gpu=False, cpus_per_worker=0)
    group = RayWorkerGroup(RayResourcePool([WORLD], use_gpu=False, cpus_per_worker=2), cls)
    try:
        assert group.threads() == [(2, "2"), (2, "2")]
        assert {i["master"] for i in group.rank_info()} == {(group.master_address, group.master_port)}
        assert group.master_port != "1"
        assert group.all_reduce_rank() == [3.0, 3.0]
        assert group.execute_all_sync("getenv", "HFLOW_TEST_MARKER") == ["kept", "kept"]
        assert group.execute_all_sync("getenv", "RANK") == ["0", "1"]

        with pytest.raises(WorkerGroupError, match="(?s)rank 1.*fail_on_rank_one.*boom from rank one"):
            group.start(ComputeWorker.fail_on_rank_one).result()

        ray.kill(group.workers[1])
        # ray.kill returns before the process is gone; under load a call could still reach it.
        with pytest.raises(ray.exceptions.RayActorError):
            while True:
                ray.get(group.workers[1].__ray_ready__.remote(), timeout=30)
        with pytest.raises(WorkerGroupError) as caught:
            group.threads()  # rank 1's death ends the call although rank 0 is still in fail_on_rank_one's barrier
        # hflow's own sentence (RayWorkerGroup._get_one), which names the worker, its rank and the method;
        # Ray's message about the dead actor follows it and says none of these.
        name = group.worker_names[1]
        assert str(caught.value).startswith(f"worker {name} (rank 1) died during threads(): "), str(caught.value)
    finally:
        group.shutdown()
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU", 0) < free_before and time.monotonic() < deadline:
        time.sleep(0.1)
    # At least what was free before (an earlier test's group may still be releasing its CPUs); a group
    # that kept its resources would leave 4 CPUs fewer.
    assert ray.available_resources().get("CPU", 0) >= free_before
