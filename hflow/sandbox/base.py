"""What every sandbox backend shares: the limits, the result, and how an ending is classified."""

from __future__ import annotations

import dataclasses
import signal
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

__all__ = [
    "LIMIT_NAMES",
    "STATUSES",
    "Sandbox",
    "SandboxLimits",
    "SandboxResult",
    "classify_ending",
    "decode_output",
    "sandbox_error_result",
]

STATUSES = ("ok", "error", "limit", "sandbox_error")
LIMIT_NAMES = ("cpu_time", "wall_time", "memory", "processes", "output", "file_size")


@dataclass(frozen=True)
class SandboxLimits:
    """Limits for one execution. Field names double as `make_sandbox` config keys."""

    cpu_time_s: float = 10.0  # RLIMIT_CPU, rounded up to whole seconds (the kernel counts seconds)
    wall_time_s: float = 20.0  # the whole process group is killed after this
    memory_mb: int = 1024  # RLIMIT_AS (address space) of each process
    max_processes: int = 16  # processes the code may have at once (RLIMIT_NPROC and a pid-1 watchdog)
    max_output_bytes: int = 65536  # per stream; once exceeded, reading stops and the code is killed
    max_file_bytes: int = 16 * 2**20  # RLIMIT_FSIZE: the largest file the code may write
    network: bool = False  # False: no network where the OS allows (a network namespace)

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type == "bool":
                if not isinstance(value, bool):
                    raise ValueError(f"sandbox limit {field.name}={value!r}; give true or false")
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"sandbox limit {field.name}={value!r}; give a positive number")
            elif field.type == "int" and value != int(value):
                raise ValueError(f"sandbox limit {field.name}={value!r}; give a whole number")


@dataclass
class SandboxResult:
    """How one execution ended.

    status: "ok" (exit 0), "error" (non-zero exit), "limit" (a limit stopped it: see `limit_hit`) or
    "sandbox_error" (the sandbox itself failed; the code may not have run: stderr says why).
    exit_code: the program's exit status, negative for a signal (as in `subprocess`); None when the
    sandbox killed it (wall time, output), its supervisor died first, or it never ran.
    """

    status: str
    exit_code: int | None
    stdout: str
    stderr: str
    limit_hit: str | None
    duration_s: float
    network_isolated: bool

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Sandbox(ABC):
    """Runs untrusted code and returns a `SandboxResult`; never raises for anything the code does."""

    @abstractmethod
    def run(self, code: str, *, stdin: str = "", language: str = "python") -> SandboxResult:
        """Run `code` (a whole program) with `stdin` as its standard input."""


def sandbox_error_result(message: str, start: float) -> SandboxResult:
    """The result of a run the sandbox itself failed (`start`: its time.monotonic() at the beginning)."""
    return SandboxResult("sandbox_error", None, "", message, None, time.monotonic() - start, False)


def decode_output(data: bytes, max_bytes: int) -> str:
    return data[:max_bytes].decode("utf-8", errors="replace")


# Python's messages when a limit stops it by an exception rather than a signal.
_STDERR_SIGNS = (
    ("memory", ("MemoryError", "Cannot allocate memory")),
    ("file_size", ("File too large",)),  # Python ignores SIGXFSZ: the write raises EFBIG instead
    ("processes", ("BlockingIOError", "Resource temporarily unavailable")),  # fork past RLIMIT_NPROC
)


def classify_ending(
    exit_code: int | None, stderr: str, cpu_s: float | None = None, cpu_limit_s: float | None = None
) -> str | None:
    """The limit that ended a program that exited on its own with `exit_code`, or None if it looks like none did."""
    if not exit_code:
        return None
    if exit_code == -signal.SIGXCPU:
        return "cpu_time"
    # SIGKILL comes at the hard CPU limit (one second past the soft one) if SIGXCPU was caught.
    if exit_code == -signal.SIGKILL and cpu_s is not None and cpu_limit_s is not None and cpu_s >= cpu_limit_s:
        return "cpu_time"
    if exit_code == -signal.SIGXFSZ:
        return "file_size"
    for limit, signs in _STDERR_SIGNS:
        if any(sign in stderr for sign in signs):
            return limit
    return None
