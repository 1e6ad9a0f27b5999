"""A sandbox for model-written (untrusted) code: the agent's ``python`` tool and rewards that run code.

    result = make_sandbox({"wall_time_s": 5}).run("print(input())", stdin="hi")
    result.status, result.stdout, result.limit_hit   # "ok", "hi\\n", None

`run` never raises for what the code does: it returns a `SandboxResult` whose ``status`` is "ok",
"error", "limit" (``limit_hit`` says which) or "sandbox_error" (the sandbox itself failed).

Local backend (`LocalSandbox`), Linux. Each run is a fresh ``python -I -S`` (stdlib only: neither hflow,
torch nor anything in site-packages imports) in a fresh temporary working directory, removed afterwards,
with an environment of five variables (PATH, LANG, HOME=the work dir, PYTHONDONTWRITEBYTECODE,
PYTHONIOENCODING) and nothing of the trainer's. Always enforced:

- wall time: the process group is killed (SIGKILL) and reaped; stdout and stderr are read concurrently
  and capped at max_output_bytes each (past it the code is killed: "output");
- rlimits of the code's processes: RLIMIT_CPU (whole seconds: SIGXCPU, "cpu_time"), RLIMIT_AS per
  process ("memory", seen as MemoryError), RLIMIT_FSIZE per file ("file_size"), RLIMIT_CORE=0;
  no_new_privs (setuid programs gain nothing);
- the code dies with the trainer (PDEATHSIG), so a killed scoring worker leaves nothing running.

Where the kernel allows unprivileged namespaces (measured on the development machine, Linux 6.18 as
root: all of the below hold; `sandbox_capabilities()` reports them for the machine it runs on):

- user namespace: the code runs as uid 1000 inside with no capabilities (outside, still our uid);
- network namespace: only a loopback that is down; connecting anywhere, 127.0.0.1 included, fails
  (``network_isolated`` in each result says whether this was in force for that run);
- mount namespace: every mount read-only except the work dir (mount_setattr, Linux >= 5.12), so the
  code cannot write anywhere else, even where our uid could; it can still *read* what our uid can;
- pid namespace with a launcher-owned init as pid 1 and its own /proc: the code sees no other process
  (not the trainer's /proc/<pid>/environ), and when the code's main process ends, the kernel kills
  everything it started (daemons that called setsid() included);
- processes: RLIMIT_NPROC counts per user namespace (Linux >= 5.14), so max_processes limits this run
  alone, except for uid 0, which the kernel exempts. Init also counts the namespace's processes every
  20 ms and kills them all past max_processes ("processes"); run as root it has a real-time priority
  so a fork bomb cannot starve it (measured: a ``while True: os.fork()`` ends in about 0.1 s).

Fail closed: without the user, network (unless ``network=True``), read-only mount and pid namespaces
(`REQUIRED_ISOLATION`; EPERM, e.g. Docker's default seccomp profile), the launcher refuses to start the
code and the run ends as "sandbox_error" with a message naming what is missing and the ways out (a remote
sandbox, a privileged container or a kernel that allows them, or ``allow_unisolated``). Preflight asks
before a run with `require_isolation` (see `hflow.sandbox.check`). Only with ``allow_unisolated`` (the
argument, the `make_sandbox` key, or ``HFLOW_SANDBOX_ALLOW_UNISOLATED=1``) does the code run without
them, warned once per process, and then: no network isolation (``network_isolated=False``), the code
keeps our uid's capabilities (as root: all of them) and can write wherever our uid can and read other processes of our uid in /proc (their environ included),
RLIMIT_NPROC counts all of our uid's processes (set to what it has now plus max_processes; not enforced
for root), and a process that leaves the process group (setsid) survives the kill. The rlimits, the wall
time, the fresh work dir and the environment hold.

Not limited anywhere: the total of disk the code writes in its work dir (RLIMIT_FSIZE is per file),
memory summed over its processes (RLIMIT_AS is per process), CPU summed over its processes.

Remote backend (`RemoteSandbox`): a Sandbox Fusion server's ``/run_code``; see its docstring.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from hflow.sandbox.base import Sandbox, SandboxLimits, SandboxResult
from hflow.sandbox.check import IsolationReport, SandboxUnavailable, require_isolation
from hflow.sandbox.config import SandboxConfig
from hflow.sandbox.isolation import ALLOW_UNISOLATED_ENV, REQUIRED_ISOLATION, missing_isolation
from hflow.sandbox.local import LocalSandbox, run_code, sandbox_capabilities
from hflow.sandbox.remote import RemoteSandbox

__all__ = [
    "ALLOW_UNISOLATED_ENV",
    "IsolationReport",
    "LocalSandbox",
    "REQUIRED_ISOLATION",
    "RemoteSandbox",
    "Sandbox",
    "SandboxConfig",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailable",
    "make_sandbox",
    "missing_isolation",
    "require_isolation",
    "run_code",
    "sandbox_capabilities",
    "sandbox_env",
]

_LIMIT_KEYS = tuple(field.name for field in dataclasses.fields(SandboxLimits))
_REMOTE_KEYS = ("url", "timeout_s", "max_retries", "backoff_s")
_BACKENDS = ("local", "remote")


def make_sandbox(config: Mapping[str, Any] | None = None) -> Sandbox:
    """A sandbox from a config mapping (e.g. a YAML section).

    Keys: ``backend`` ("local", the default, or "remote"); for local, ``allow_unisolated`` (run even
    where the isolation it needs is missing; default: refuse, see `LocalSandbox`); for remote, ``url``
    (the full endpoint) and optionally ``timeout_s``, ``max_retries``, ``backoff_s``; and any
    `SandboxLimits` field. A key set to None counts as absent.
    """
    config = {key: value for key, value in dict(config or {}).items() if value is not None}
    known = ("backend", "allow_unisolated", *_REMOTE_KEYS, *_LIMIT_KEYS)
    for key in config:
        if key not in known:
            raise ValueError(f"unknown sandbox config key {key!r}; the keys are {list(known)}")
    backend = config.pop("backend", "local")
    if backend not in _BACKENDS:
        raise ValueError(f"sandbox backend={backend!r}; choose one of {list(_BACKENDS)}")
    limits = SandboxLimits(**{key: config.pop(key) for key in _LIMIT_KEYS if key in config})
    allow_unisolated = config.pop("allow_unisolated", None)
    if allow_unisolated is not None and not isinstance(allow_unisolated, bool):
        raise ValueError(f"sandbox allow_unisolated={allow_unisolated!r}; give true or false")
    if backend == "local":
        if config:
            raise ValueError(f"sandbox keys {sorted(config)} apply to backend='remote' only; remove them or set it")
        return LocalSandbox(limits, allow_unisolated=allow_unisolated)
    if allow_unisolated is not None:
        raise ValueError("sandbox allow_unisolated applies to backend='local' only (a remote server isolates "
                         "the code itself); remove it")
    if "url" not in config:
        raise ValueError("sandbox backend='remote' needs url, the full endpoint (e.g. http://host:8080/run_code)")
    return RemoteSandbox(config.pop("url"), limits=limits, **config)


def sandbox_env() -> dict[str, str]:
    """The environment a trainer's worker processes need to follow its sandbox decision: ``{ALLOW_UNISOLATED_ENV:
    "1"}`` once `require_isolation` allowed unisolated code in this process, else nothing (so they refuse it)."""
    return {ALLOW_UNISOLATED_ENV: os.environ[ALLOW_UNISOLATED_ENV]} if ALLOW_UNISOLATED_ENV in os.environ else {}
