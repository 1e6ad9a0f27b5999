"""A world of ranks for a test: every multi-rank test spawns its processes here."""

from __future__ import annotations

import faulthandler
import os
import socket
import sys
from typing import Callable

import torch


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn_ranks(main: Callable[..., None], nprocs: int, *args) -> None:
    """Run `main(rank, *args)` in `nprocs` fresh processes; raises if any rank raises or dies."""
    torch.multiprocessing.spawn(_run_rank, args=(main, args), nprocs=nprocs)


def _run_rank(rank: int, main: Callable[..., None], args: tuple) -> None:
    faulthandler.enable(all_threads=True)  # a C++ abort still prints every thread's Python stack
    main(rank, *args)  # an exception propagates to spawn, which reports it
    # The rank's work is done and written: leave without interpreter finalization. A gloo thread can still
    # hold a finished work object whose tensors need the GIL while the interpreter is torn down, which aborts
    # the process (pytorch PR 179291). Ranks died of SIGABRT with no Python error in CI twice; if that is not
    # the cause, faulthandler above now prints where it happens.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
