"""Before a run: can every sandbox it will use run model-written code isolated? (`require_isolation`)

A trainer calls this in preflight with the sandboxes its code tools and code rewards will use. A local
sandbox passes where the kernel gives it all the isolation it needs (`REQUIRED_ISOLATION`, measured once
per process by `sandbox_capabilities()`); a remote one where its server runs a trivial program. Anything
else stops the run with `SandboxUnavailable`, whose message names what is missing, who needs it and the
three ways out, unless the run allowed unisolated code, which then prints a warning (every start) and
returns a report to record with the run.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hflow.sandbox.base import Sandbox
from hflow.sandbox.isolation import ALLOW_UNISOLATED_ENV, REQUIRED_ISOLATION, missing_isolation
from hflow.sandbox.isolation import unisolated_message, warn_unisolated
from hflow.sandbox.local import LocalSandbox, sandbox_capabilities
from hflow.sandbox.remote import RemoteSandbox

__all__ = ["ISOLATION_RECORD", "IsolationReport", "SandboxUnavailable", "require_isolation"]

ISOLATION_RECORD = "sandbox.jsonl"  # in the run's log folder: one line per start that uses a sandbox
_PROBE = "print('hflow sandbox probe')"
_PROBE_TIMEOUT_S = 15.0


class SandboxUnavailable(RuntimeError):
    """The sandbox a run needs cannot isolate code here; the message says what is missing and how to get it.

    Not a `hflow.utils.errors.UserError` (the sandbox imports nothing of hflow): callers that end a run
    with a user's error re-raise it as one (`ConfigError(str(err))`).
    """


@dataclass
class IsolationReport:
    """What `require_isolation` found: each user's sandbox, and those allowed to run without isolation."""

    sandboxes: dict[str, str] = field(default_factory=dict)  # used by -> "local" | "remote <url>"
    unisolated: dict[str, list[str]] = field(default_factory=dict)  # used by -> missing isolation keys
    allow_unisolated: bool = False
    warning: str | None = None  # printed at this start when `unisolated` is not empty

    def to_dict(self) -> dict[str, Any]:
        return {
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "allow_unisolated": self.allow_unisolated,
            "isolated": not self.unisolated,
            "sandboxes": self.sandboxes,
            "unisolated": self.unisolated,
            "warning": self.warning,
        }

    def record(self, log_dir: str | os.PathLike) -> Path | None:
        """Append this start to `<log_dir>/sandbox.jsonl` (nothing when no sandbox is used); its path."""
        if not self.sandboxes:
            return None
        path = Path(log_dir).expanduser() / ISOLATION_RECORD
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(self.to_dict()) + "\n")
        return path


def require_isolation(sandboxes: Mapping[str, Sandbox], *, allow_unisolated: bool = False) -> IsolationReport:
    """Raise `SandboxUnavailable` unless each sandbox of `sandboxes` (what uses it -> the sandbox) isolates code.

    Local sandboxes are measured here (`sandbox_capabilities()`); remote ones are sent a trivial program
    (one try, at most 15 s). With `allow_unisolated` (or a sandbox's own ``allow_unisolated=True``), a local
    sandbox without isolation passes: the warning is printed now, and ``HFLOW_SANDBOX_ALLOW_UNISOLATED=1``
    is set in this process's environment so that the processes it starts later (scoring pools, rollout
    workers of a local Ray cluster) run their sandboxes likewise; without it they refuse every run.
    """
    report = IsolationReport(allow_unisolated=bool(allow_unisolated))
    refused: dict[str, list[str]] = {}
    for used_by, sandbox in sandboxes.items():
        if isinstance(sandbox, RemoteSandbox):
            report.sandboxes[used_by] = f"remote {sandbox.url}"
            _probe_remote(used_by, sandbox)
            continue
        if not isinstance(sandbox, LocalSandbox):
            report.sandboxes[used_by] = type(sandbox).__name__  # someone else's: nothing to measure
            continue
        report.sandboxes[used_by] = "local"
        try:
            capabilities = sandbox_capabilities()
        except RuntimeError as err:  # not even a trivial program runs (no fork, no temporary folder, ...)
            raise SandboxUnavailable(f"{err} ({used_by})") from None
        missing = missing_isolation(capabilities, sandbox.limits.network)
        if not missing:
            continue
        if allow_unisolated or sandbox.allow_unisolated:
            report.unisolated[used_by] = missing
        else:
            refused[used_by] = missing
    if refused:
        missing = sorted({key for keys in refused.values() for key in keys}, key=_order)
        raise SandboxUnavailable(unisolated_message(missing, list(refused)))
    if report.unisolated:
        missing = sorted({key for keys in report.unisolated.values() for key in keys}, key=_order)
        report.warning = warn_unisolated(missing, list(report.unisolated))
        os.environ[ALLOW_UNISOLATED_ENV] = "1"
    return report


def _order(key: str) -> int:
    return list(REQUIRED_ISOLATION).index(key) if key in REQUIRED_ISOLATION else len(REQUIRED_ISOLATION)


def _probe_remote(used_by: str, sandbox: RemoteSandbox) -> None:
    probe = RemoteSandbox(sandbox.url, limits=sandbox.limits, timeout_s=min(sandbox.timeout_s, _PROBE_TIMEOUT_S),
                          max_retries=0)
    result = probe.run(_PROBE)
    if result.status != "ok" or "hflow sandbox probe" not in result.stdout:
        why = (result.stderr or result.stdout).strip()[-300:] or result.status
        raise SandboxUnavailable(
            f"the remote sandbox {sandbox.url} ({used_by}) did not run a trivial program: {why}. Start the "
            "Sandbox Fusion server or fix its url; or use the local sandbox (backend: local) where the kernel "
            "allows unprivileged namespaces")
