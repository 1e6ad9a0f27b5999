"""Continuous admission (`rollout.admission=continuous`): the rows of every batch go to the engines as they
have room, by least load, instead of a fixed shard per engine.

`RowRouter` is the one place that knows every submitted batch (a Ray actor of the driver's; the engines
reach it through `RouterClient`). The routing unit is one sample (an episode of an agent): an engine that
takes it runs all of its turns (its prefix cache holds the history), so an episode never changes engine.
Each engine runs its own loop (`serve_rows`): between two scheduler steps it reports the samples it
finished and asks for more, and `RowRouter.exchange` gives it rows up to its share of the work: the
samples handed out and not finished plus the rows not yet taken, split evenly over the engines, so the
engine that finishes its samples sooner (fewer tool waits, shorter responses) takes more. Rows of a later
batch are taken while an earlier batch's tail runs, as soon as the engine holds the weights that batch
asks for (`min_version`). The driver waits for a batch's rows, not for the engines to drain, and puts them
back in their order.

Idle time: the router keeps, per engine, the seconds during which it ran no request (it said so at its
last exchange, or it was between two serve calls); `collect` reports them per window between batches.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RouterClient", "RowRouter", "request_seed", "serve_rows"]


@dataclass
class _Batch:
    rows: list[dict]  # per sample: {"ids": prompt ids, "tools_kwargs": ...}
    meta: dict
    min_version: int
    next_row: int = 0  # rows before it were handed out (oldest first)
    results: dict = field(default_factory=dict)  # row -> result
    resolved: dict = field(default_factory=dict)  # the stop and pad ids the engines used
    submitted_s: float = 0.0
    completed_s: float | None = None
    engine_of: dict = field(default_factory=dict)  # row -> engine, for the tests and the metrics
    idle_at_submit: list = field(default_factory=list)  # each engine's idle_s when the batch came, and when it ended
    idle_at_completion: list = field(default_factory=list)


class RowRouter:
    """Submitted batches, who holds which row, and each engine's load and idle time (one per run)."""

    def __init__(self, engines: int) -> None:
        self.engines = int(engines)
        self.batches: dict[int, _Batch] = {}
        self.running = [0] * self.engines  # requests each engine said it runs, at its last exchange
        self.load = [0] * self.engines  # samples handed to each engine and not finished: its share of the work
        self.in_call = [False] * self.engines
        self.idle_s = [0.0] * self.engines  # cumulative seconds with no request running
        self.mark = [time.perf_counter()] * self.engines
        self.last_collect = (time.perf_counter(), [0.0] * self.engines)  # when, and idle_s then

    # ---- the driver's side --------------------------------------------------------------------------

    def submit(self, batch: int, rows: list[dict], meta: dict, min_version: int) -> None:
        self._account_all()
        self.batches[batch] = _Batch(list(rows), dict(meta), int(min_version), submitted_s=time.perf_counter(),
                                     idle_at_submit=list(self.idle_s))

    def complete(self, batch: int) -> bool:
        return self.batches[batch].completed_s is not None

    def collect(self, batch: int) -> dict:
        """A completed batch's results in row order, the ids the engines resolved, its seconds from submission
        to its last row, the rows each engine ran, and per engine its idle seconds since the previous collect
        (`window_s` ago: consecutive windows, so that they add up over a run); then forgets the batch."""
        entry = self.batches.pop(batch)
        if entry.completed_s is None:
            raise RuntimeError(f"batch {batch} collected before its rows were all generated")
        self._account_all()
        now, before = time.perf_counter(), self.last_collect[1]
        window = now - self.last_collect[0]
        # at most the window: the idle clock and the window's are read apart (tens of nanoseconds)
        idle = [min(after - start, window) for after, start in zip(self.idle_s, before)]
        self.last_collect = (now, list(self.idle_s))
        rows_per_engine = [0] * self.engines
        for engine in entry.engine_of.values():
            rows_per_engine[engine] += 1
        return {"results": [entry.results[i] for i in range(len(entry.rows))], "resolved": entry.resolved,
                "wall_s": entry.completed_s - entry.submitted_s, "idle_s": idle, "window_s": window,
                # within the batch's own lifetime (colocated engines exist for one batch at a time)
                "idle_in_batch_s": [min(b - a, entry.completed_s - entry.submitted_s)
                                    for a, b in zip(entry.idle_at_submit, entry.idle_at_completion)], "rows_per_engine": rows_per_engine,
                "engine_of": [entry.engine_of[i] for i in range(len(entry.rows))]}

    # ---- the engines' side --------------------------------------------------------------------------

    def exchange(self, engine: int, finished: list[tuple[int, int, Any]], running: int, room: int,
                 version: int, any_version: bool = False, only_batch: int | None = None,
                 resolved: dict | None = None) -> list[tuple[int, int, dict, dict]]:
        """Take `engine`'s finished rows (batch, row, result) and hand it new ones, (batch, row, sample,
        meta) each: at most `room`, up to its share of the load, from batches whose `min_version` its
        weights (`version`) reach (`any_version`: it takes updates between steps, partial rollouts)."""
        self._account(engine)
        self.in_call[engine] = True
        for batch, meta in (resolved or {}).items():
            if batch in self.batches:
                self.batches[batch].resolved = self.batches[batch].resolved or dict(meta)
        for batch, row, result in finished:
            entry = self.batches[batch]
            entry.results[row] = result
            self.load[engine] -= 1
            if len(entry.results) == len(entry.rows):
                entry.completed_s = time.perf_counter()
                self._account_all()
                entry.idle_at_completion = list(self.idle_s)
        open_rows = [(b, e) for b, e in sorted(self.batches.items())
                     if e.next_row < len(e.rows) and (any_version or e.min_version <= version)
                     and (only_batch is None or b == only_batch)]
        # least load: each engine up to an even share of the samples not finished (an engine that was given
        # fewer, or finished its own sooner, takes more); an episode counts until its last turn
        waiting = sum(len(e.rows) - e.next_row for _, e in open_rows)
        share = math.ceil((waiting + sum(self.load)) / self.engines)
        give = min(room, waiting, max(share - self.load[engine], 0))
        if give == 0 and waiting and room > 0 and self.load[engine] == min(self.load):
            give = 1  # the least-loaded engine always makes progress
        handed = []
        for batch, entry in open_rows:
            while give and entry.next_row < len(entry.rows):
                row = entry.next_row
                entry.next_row += 1
                entry.engine_of[row] = engine
                handed.append((batch, row, entry.rows[row], entry.meta))
                give -= 1
        self.running[engine] = running + len(handed)
        self.load[engine] += len(handed)
        return handed

    def has_work(self, engine: int, version: int, any_version: bool = False, only_batch: int | None = None) -> bool:
        """Rows this engine could still be handed (now, or once its weights reach their version)."""
        return any(e.next_row < len(e.rows) and (only_batch is None or b == only_batch)
                   for b, e in self.batches.items())

    def leave(self, engine: int) -> None:
        """The engine's serve call ended: it runs nothing until its next one."""
        self._account(engine)
        self.running[engine] = 0
        self.in_call[engine] = False

    def _account(self, engine: int) -> None:
        now = time.perf_counter()
        if self.running[engine] == 0:
            self.idle_s[engine] += now - self.mark[engine]
        self.mark[engine] = now

    def _account_all(self) -> None:
        for engine in range(self.engines):
            self._account(engine)


class RouterClient:
    """The router as an engine calls it: a Ray actor's handle (`ray.get` of each call) or the object itself."""

    def __init__(self, router: Any) -> None:
        self.router = router
        self.remote = hasattr(router, "exchange") and hasattr(router.exchange, "remote")

    def __call__(self, method: str, *args, **kwargs) -> Any:
        if self.remote:
            import ray

            return ray.get(getattr(self.router, method).remote(*args, **kwargs))
        return getattr(self.router, method)(*args, **kwargs)


def request_seed(seed: int, batch: int, row: int, turn: int) -> int:
    """The sampling seed of one request: the same row of the same batch draws the same tokens on any engine,
    whatever else that engine runs (vLLM's per-request generator)."""
    return (int(seed) * 1_000_003 + batch * 100_003 + row * 1_009 + turn) % (2**31 - 1)


def serve_rows(client: RouterClient, engine: int, room: int, version: Callable[[], int], any_version: bool,
               only_batch: int | None, resolved: dict, running: Callable[[], int],
               run: Callable[[Callable], None]) -> None:
    """One engine's serve loop: `run(admit)` runs the engine, calling `admit(finished)` between steps with
    the (batch, row, result) it finished since; `admit` returns new rows to start, or None when there is
    nothing more for this call (no row left that this engine may take, and none of its own running)."""
    state = {"sent_meta": set()}

    def admit(finished: list, idle: bool) -> list | None:
        meta = {b: resolved for b in {b for b, _, _ in finished} if b not in state["sent_meta"]}
        state["sent_meta"].update(meta)
        rows = client("exchange", engine, finished, running(), max(room - running(), 0), version(), any_version,
                      only_batch, meta)
        if rows or not idle:
            return rows
        return rows if client("has_work", engine, version(), any_version, only_batch) else None

    try:
        run(admit)
    finally:
        client("leave", engine)
