"""Continuous admission's router (`hflow.workers.rollout.router.RowRouter`), driven as engines drive it:
rows come back complete and in order, the load balances over engines, a later batch's rows wait for the
weights they need, and each engine's idle time is counted. Pure Python (the engines' side of a real vLLM
engine is in tests/workers/test_rollout.py)."""

import time

import pytest

from hflow.workers.rollout.router import RowRouter, request_seed

pytestmark = pytest.mark.alone  # idle seconds measured in wall time


def rows(count: int, tag: str = "") -> list[dict]:
    return [{"ids": [i], "tools_kwargs": {}, "tag": tag} for i in range(count)]


def drain(router: RowRouter, engine: int, handed: list, version: int = 0, **kwargs) -> list:
    """The engine finishes everything it holds (result = its own row dict) and asks for more."""
    finished = [(batch, row, {"engine": engine, **sample}) for batch, row, sample, _ in handed]
    return router.exchange(engine, finished, running=0, room=8, version=version, **kwargs)


def test_rows_come_back_complete_and_in_order_from_two_engines():
    router = RowRouter(engines=2)
    router.submit(0, rows(20), {"n": 1}, min_version=0)
    held = {0: router.exchange(0, [], running=0, room=8, version=0),
            1: router.exchange(1, [], running=0, room=8, version=0)}
    while not router.complete(0):
        for engine in (1, 0):  # engine 1 reports first: results arrive out of row order
            held[engine] = drain(router, engine, held[engine])
    collected = router.collect(0)
    assert [r["ids"] for r in collected["results"]] == [[i] for i in range(20)]
    assert sorted(set(collected["engine_of"])) == [0, 1]
    assert [r["engine"] for r in collected["results"]] == collected["engine_of"]  # each row where it ran
    assert sum(collected["rows_per_engine"]) == 20


def test_an_engine_slowed_by_its_tail_takes_fewer_rows_and_both_stay_busy():
    """Engine 0 holds a long episode that never finishes during the batch; engine 1 finishes each of its
    rows at once. With a fixed shard, or first come first served (engine 0 asks first), each would get 16
    rows; routed by load, engine 1 takes part of engine 0's share as engine 0's load stays up, and both
    engines hold rows until the batch's end."""
    router = RowRouter(engines=2)
    router.submit(0, rows(32), {}, min_version=0)
    slow = router.exchange(0, [], running=0, room=1, version=0)  # engine 0 takes one row, its tail
    assert len(slow) == 1
    held, busy_rounds = router.exchange(1, [], running=0, room=8, version=0), 0
    while router.batches[0].next_row < 32:
        slow += router.exchange(0, [], running=1, room=8, version=0)  # engine 0 asks first, its tail still runs
        held = drain(router, 1, held)
        busy_rounds += bool(held) and bool(slow)
    per_engine = [0, 0]
    for row, engine in router.batches[0].engine_of.items():
        per_engine[engine] += 1
    assert per_engine[1] > 16 > per_engine[0] >= 1, per_engine
    assert busy_rounds > 0


def test_a_later_batch_waits_for_its_weights_unless_partial():
    router = RowRouter(engines=1)
    router.submit(0, rows(2), {}, min_version=3)
    router.submit(1, rows(2), {}, min_version=4)
    first = router.exchange(0, [], running=0, room=8, version=3)
    assert {b for b, *_ in first} == {0}  # batch 1 needs version 4
    assert router.has_work(0, version=3)  # ... which keeps the engine's serve loop asking
    assert drain(router, 0, first, version=3) == []
    later = router.exchange(0, [], running=0, room=8, version=4)
    assert [(b, r) for b, r, *_ in later] == [(1, 0), (1, 1)]
    partial = RowRouter(engines=1)
    partial.submit(0, rows(1), {}, min_version=9)
    assert len(partial.exchange(0, [], running=0, room=8, version=0, any_version=True)) == 1


def test_only_batch_keeps_a_colocated_engine_to_its_own_batch():
    router = RowRouter(engines=1)
    router.submit(0, rows(1), {}, min_version=0)
    router.submit(1, rows(1), {}, min_version=0)
    assert [(b, r) for b, r, *_ in router.exchange(0, [], 0, 8, 0, only_batch=1)] == [(1, 0)]
    assert not router.has_work(0, 0, only_batch=1)


def test_idle_seconds_count_only_time_with_nothing_running():
    router = RowRouter(engines=2)
    router.submit(0, rows(2), {}, min_version=0)
    handed = router.exchange(0, [], running=0, room=2, version=0)  # engine 0 runs both; engine 1 never comes
    time.sleep(0.2)
    while not router.complete(0):
        handed = drain(router, 0, handed)
    collected = router.collect(0)
    assert collected["idle_s"][1] >= 0.2 - 1e-3  # engine 1 ran nothing the whole time
    assert collected["idle_s"][0] < 0.1  # engine 0 ran its requests
    assert collected["window_s"] >= collected["idle_s"][1]
    assert collected["wall_s"] >= collected["idle_in_batch_s"][1] >= 0.2 - 1e-3  # the colocated measure


def test_request_seeds_differ_by_row_turn_and_batch():
    seeds = {request_seed(0, b, r, t) for b in range(3) for r in range(50) for t in range(4)}
    assert len(seeds) == 3 * 50 * 4
