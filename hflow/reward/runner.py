"""Run scoring functions with a per-call deadline that really stops a hung call.

Rule-based rewards are user code: a catastrophic regex or a symbolic simplification can run forever.
A thread cannot be stopped, and a regex holds the GIL for its whole run, so a thread-based timeout
would never even fire. `ScoringPool` therefore runs calls in a few long-lived worker processes
(fresh interpreters, not forks: safe in a driver that already runs Ray and torch threads) and kills
the worker whose call passes its deadline; a replacement starts when there is more work. A call
costs one socket round trip (~0.1 ms) on top of the function itself; starting a worker about
0.1-0.3 s, once.

The function travels to the workers by pickle, so it must be importable by name: a module-level
function, a `functools.partial` of one, or a `hflow.utils.user_code.FileFunction` (a function in a user's file, re-loaded
by path in each worker). This module imports nothing heavy, so the workers start fast.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any


__all__ = ["CallResult", "ScoringPool"]

# A worker that has not unpickled the function and reported ready by then is considered broken.
_STARTUP_TIMEOUT_S = 120.0


# --------------------------------------------------------------------------------------------------
# The worker pool
# --------------------------------------------------------------------------------------------------


@dataclass
class CallResult:
    """Outcome of one call: its return value, or `error` (a traceback or the reason it was stopped)."""

    value: Any = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def worker_main(fd: int) -> None:
    """Worker loop (in the worker process): load the function, report ready, answer (index, kwargs)."""
    # Ctrl-C is the driver's to handle; the driver kills its workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(fd)
    try:
        fn = pickle.loads(conn.recv_bytes())
    except BaseException:  # noqa: BLE001 - reported to the driver, whatever it is
        conn.send(("failed", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        try:
            request = conn.recv()
        except EOFError:  # the driver is gone
            return
        if request is None:
            return
        index, kwargs = request
        try:
            conn.send((index, fn(**kwargs), None))
        except BaseException as exc:  # noqa: BLE001 - user code: everything is reported to the driver
            # Also reached when the return value cannot be pickled. Drop this loop's own frame.
            trace = traceback.format_exception(type(exc), exc, exc.__traceback__.tb_next)
            conn.send((index, None, "".join(trace)))


class _Worker:
    """One worker process, with the call it is running (if any) and that call's deadline.

    A plain subprocess rather than a multiprocessing ``spawn`` child: spawn re-imports the driver's
    ``__main__`` (the trainer, with torch and Ray) in every worker, which costs seconds.
    """

    def __init__(self, payload: bytes) -> None:
        self.conn, child_conn = multiprocessing.Pipe(duplex=True)
        # The worker imports what the driver can: the function is pickled by reference.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
        command = f"from hflow.reward.runner import worker_main; worker_main({child_conn.fileno()})"
        self.process = subprocess.Popen(
            [sys.executable, "-c", command], pass_fds=[child_conn.fileno()], env=env, stdin=subprocess.DEVNULL
        )
        child_conn.close()
        self.conn.send_bytes(payload)
        self.ready = False
        self.index: int | None = None
        self.deadline = time.monotonic() + _STARTUP_TIMEOUT_S

    def send_call(self, index: int, kwargs: dict[str, Any], timeout_s: float) -> None:
        self.conn.send((index, kwargs))
        self.index = index
        self.deadline = time.monotonic() + timeout_s

    def exit_code(self) -> int | None:
        try:
            return self.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, graceful: bool) -> None:
        if graceful and self.process.poll() is None:
            try:
                self.conn.send(None)
                self.process.wait(timeout=1.0)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.conn.close()


def _stop_all(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.stop(graceful=worker.ready and worker.index is None)
    workers.clear()


class ScoringPool:
    """Calls `fn(**kwargs)` for many kwargs in `num_workers` processes, each call limited to `timeout_s`.

    Workers start on the first `map` and stay up between calls; `close()` (or garbage collection,
    or interpreter exit) stops them.
    """

    def __init__(self, fn: Callable[..., Any], num_workers: int, timeout_s: float) -> None:
        if num_workers < 1:
            raise ValueError(f"ScoringPool: num_workers={num_workers}; need at least 1")
        if not timeout_s > 0:
            raise ValueError(f"ScoringPool: timeout_s={timeout_s}; need a positive number of seconds")
        advice = (
            "Define it at module level in an importable module or load it from custom_reward_function.path; "
            "or set custom_reward_function.timeout_s=null to call it in this process, without a timeout"
        )
        if "__main__" in {getattr(fn, "__module__", None), getattr(getattr(fn, "func", None), "__module__", None)}:
            raise TypeError(
                f"the reward function {fn!r} is defined in __main__, which scoring processes cannot import. {advice}"
            )
        try:
            self._payload = pickle.dumps(fn)
        except Exception as exc:
            raise TypeError(
                f"the reward function {fn!r} cannot be sent to a scoring process ({type(exc).__name__}: {exc}). {advice}"
            ) from exc
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _stop_all, self._workers)

    def close(self) -> None:
        self._finalizer()

    def map(self, calls: Sequence[dict[str, Any]], stop_on_error: bool = False) -> list[CallResult | None]:
        """One `CallResult` per call, in order. With `stop_on_error`, the first failure stops every
        worker and calls that did not run are left as None."""
        results: list[CallResult | None] = [None] * len(calls)
        pending = deque(range(len(calls)))
        try:
            while pending or self._busy():
                self._top_up(wanted=len(pending) + len(self._busy()))
                for worker in self._workers:
                    if pending and worker.ready and worker.index is None:
                        index = pending.popleft()
                        worker.send_call(index, calls[index], self.timeout_s)
                if self._collect(results) and stop_on_error:
                    _stop_all(self._workers)
                    break
        except BaseException:
            # Calls still in flight would answer into the next map: start over with fresh workers.
            _stop_all(self._workers)
            raise
        return results

    # ---- internals -------------------------------------------------------------------------------

    def _busy(self) -> list[_Worker]:
        return [worker for worker in self._workers if worker.index is not None]

    def _top_up(self, wanted: int) -> None:
        while len(self._workers) < min(self.num_workers, wanted):
            self._workers.append(_Worker(self._payload))

    def _collect(self, results: list[CallResult | None]) -> bool:
        """Wait until a worker answers or a deadline passes; record what happened. True if a call failed."""
        waiting = [worker for worker in self._workers if worker.index is not None or not worker.ready]
        if not waiting:
            return False
        timeout = max(0.0, min(worker.deadline for worker in waiting) - time.monotonic())
        answered = set(wait([worker.conn for worker in waiting], timeout=timeout))
        failed = False
        for worker in waiting:
            if worker.conn in answered:
                failed |= self._receive(worker, results)
            elif time.monotonic() > worker.deadline and not worker.conn.poll(0):
                failed |= self._expire(worker, results)
        return failed

    def _receive(self, worker: _Worker, results: list[CallResult | None]) -> bool:
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            code = worker.exit_code()
            if not worker.ready:
                self._discard(worker, results, None)
                raise RuntimeError(
                    f"a scoring process exited during start-up (exit code {code}); its error output is above"
                ) from None
            return self._discard(worker, results, f"the scoring process died during the call (exit code {code})")
        if not worker.ready:
            status, detail = message
            if status == "failed":
                self._discard(worker, results, None)
                raise RuntimeError(f"a scoring process could not load the reward function:\n{detail}")
            worker.ready = True
            return False
        index, value, error = message
        results[index] = CallResult(value=value, error=error)
        worker.index = None
        return error is not None

    def _expire(self, worker: _Worker, results: list[CallResult | None]) -> bool:
        if not worker.ready:
            self._discard(worker, results, None)
            raise RuntimeError(
                f"a scoring process did not start within {_STARTUP_TIMEOUT_S:.0f} s (is the machine overloaded?)"
            )
        return self._discard(worker, results, f"timed out after {self.timeout_s:g} s; the call was killed")

    def _discard(self, worker: _Worker, results: list[CallResult | None], error: str | None) -> bool:
        """Kill `worker` (a replacement starts when needed) and record `error` for its call."""
        if worker.index is not None and error is not None:
            results[worker.index] = CallResult(error=error)
        worker.stop(graceful=False)
        self._workers.remove(worker)
        return error is not None
