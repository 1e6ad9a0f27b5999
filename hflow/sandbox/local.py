"""`LocalSandbox`: each execution in a fresh, isolated, limited process on this machine.

See the package docstring for what is enforced and what is not; `sandbox_capabilities()` measures it.
"""

from __future__ import annotations

import functools
import json
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hflow.sandbox.base import Sandbox, SandboxLimits, SandboxResult
from hflow.sandbox.base import classify_ending, decode_output, sandbox_error_result
from hflow.sandbox.isolation import env_allows_unisolated, missing_isolation, required_isolation
from hflow.sandbox.isolation import unisolated_message, warn_unisolated

__all__ = ["LocalSandbox", "run_code", "sandbox_capabilities"]

_LAUNCHER = str(Path(__file__).with_name("_launcher.py"))
_CHUNK = 65536
_POLL_S = 0.1
# After the launcher exits, what may still hold the pipes (a leftover that left the process group,
# possible only without a pid namespace) gets this long before reading stops.
_DRAIN_S = 0.5
_REAP_WAIT_S = 2.0


def _child_env(workdir: str) -> dict[str, str]:
    # Nothing of the trainer's environment (tokens, paths) reaches the code.
    return {
        "PATH": "/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "HOME": workdir,
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONIOENCODING": "utf-8",
    }


class LocalSandbox(Sandbox):
    """Runs Python code in a fresh interpreter (``-I -S``: stdlib only) under `limits`.

    Fails closed: where the kernel refuses the isolation of `REQUIRED_ISOLATION` at a run, that run
    ends as "sandbox_error" before the code starts, saying what is missing and the ways out, unless
    `allow_unisolated` (None: the environment's ``HFLOW_SANDBOX_ALLOW_UNISOLATED=1``) lets it run
    without, with a warning once per process.
    """

    def __init__(self, limits: SandboxLimits | None = None, *, allow_unisolated: bool | None = None) -> None:
        self.limits = limits or SandboxLimits()
        self.allow_unisolated = allow_unisolated
        self._warn = True  # off for the capability probe, which runs nothing of the model's

    def allows_unisolated(self) -> bool:
        """Whether this sandbox runs code even where the isolation it needs is missing."""
        return env_allows_unisolated() if self.allow_unisolated is None else bool(self.allow_unisolated)

    def run(self, code: str, *, stdin: str = "", language: str = "python") -> SandboxResult:
        return self.run_with_report(code, stdin=stdin, language=language)[0]

    def run_with_report(
        self, code: str, *, stdin: str = "", language: str = "python"
    ) -> tuple[SandboxResult, dict[str, Any]]:
        """`run`, plus the launcher's report: which isolation was in force (empty if it never reported)."""
        if language != "python":
            raise ValueError(
                f"LocalSandbox runs only language='python', not {language!r}; use RemoteSandbox for others"
            )
        start = time.monotonic()
        try:
            workdir = tempfile.mkdtemp(prefix="hflow-sandbox-")
        except OSError as err:
            return sandbox_error_result(f"the local sandbox could not make its work dir: {err}", start), {}
        try:
            main = os.path.join(workdir, "main.py")
            # Lone surrogates pass through as invalid UTF-8: the code's own error, not a crash here.
            Path(main).write_bytes(code.encode("utf-8", errors="surrogatepass"))
            return self._execute(workdir, main, stdin, start)
        except OSError as err:  # e.g. no process or file could be made: the sandbox failed, not the code
            return sandbox_error_result(f"the local sandbox could not run the code: {err}", start), {}
        finally:
            _remove_tree(workdir)

    def _execute(self, workdir: str, main: str, stdin: str, start: float) -> tuple[SandboxResult, dict[str, Any]]:
        limits = self.limits
        status_r, status_w = os.pipe()
        cfg = {
            "status_fd": status_w,
            "parent_pid": os.getpid(),
            "workdir": workdir,
            "main": main,
            "network": limits.network,
            # What the launcher must have in force before it starts the code (nothing: allowed unisolated).
            "require": [] if self.allows_unisolated() else required_isolation(limits.network),
            "cpu_time_s": limits.cpu_time_s,
            "memory_bytes": int(limits.memory_mb) * 2**20,
            "max_file_bytes": int(limits.max_file_bytes),
            "max_processes": int(limits.max_processes),
        }
        try:
            with tempfile.TemporaryFile() as stdin_file:  # a file, not a pipe: no writer to block on
                stdin_file.write(stdin.encode("utf-8", errors="surrogatepass"))
                stdin_file.seek(0)
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-B", _LAUNCHER, json.dumps(cfg)],
                    stdin=stdin_file,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    cwd=workdir,
                    env=_child_env(workdir),
                    pass_fds=(status_w,),
                    start_new_session=True,  # its own process group, killed as one
                )
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
        with os.fdopen(status_r, "rb"):
            stdout, stderr, report, killed_for = self._collect(proc, status_r, start + limits.wall_time_s)
        return self._result(report, stdout, stderr, killed_for, start), report

    def _collect(
        self, proc: subprocess.Popen, status_fd: int, deadline: float
    ) -> tuple[bytes, bytes, dict[str, Any], str | None]:
        """Read stdout, stderr and the status pipe until all close, a limit hits, or the launcher is gone.

        Kills the process group on the way out and reaps it. Returns stdout and stderr (at most
        max_output_bytes + one chunk each), the launcher's report, and the limit the sandbox enforced
        by killing, if any.
        """
        cap = self.limits.max_output_bytes
        out_fds = (proc.stdout.fileno(), proc.stderr.fileno())
        data = {fd: bytearray() for fd in (*out_fds, status_fd)}
        killed_for, exited_at = None, None
        try:
            with selectors.DefaultSelector() as selector:
                for fd in data:
                    selector.register(fd, selectors.EVENT_READ)
                while selector.get_map() and killed_for is None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        killed_for = "wall_time"
                        break
                    for key, _ in selector.select(min(remaining, _POLL_S)):
                        chunk = os.read(key.fd, _CHUNK)
                        if not chunk:
                            selector.unregister(key.fd)
                        elif len(data[key.fd]) <= cap:  # keep at most cap + one chunk in memory
                            data[key.fd] += chunk
                        if key.fd in out_fds and len(data[key.fd]) > cap:
                            killed_for = "output"
                            break
                    if exited_at is None and _has_exited(proc.pid):
                        exited_at = time.monotonic()
                    elif exited_at is not None and time.monotonic() - exited_at > _DRAIN_S:
                        break
            report = _parse_report(bytes(data[status_fd]))
            if killed_for or exited_at is None or not (report.get("isolation") or {}).get("pid_namespace"):
                # Else the end of the pid namespace already took everything with it.
                _kill_group(proc.pid, wait=True)
        finally:  # also when interrupted (KeyboardInterrupt): nothing may outlive the call
            # The launcher is unreaped until proc.wait(), so its pid (the group's id) cannot have been reused.
            _kill_group(proc.pid, wait=False)
            proc.wait()
            proc.stdout.close()
            proc.stderr.close()
        return bytes(data[out_fds[0]]), bytes(data[out_fds[1]]), report, killed_for

    def _result(
        self, report: dict, stdout: bytes, stderr: bytes, killed_for: str | None, start: float
    ) -> SandboxResult:
        limits = self.limits
        isolation = report.get("isolation") or {}
        exit_code = report.get("exit_code")
        err_text = decode_output(stderr, limits.max_output_bytes)
        if report.get("refused") and killed_for is None:  # fail closed: the code never started
            return sandbox_error_result(unisolated_message(report["refused"]), start)
        if isolation and self._warn and self.allows_unisolated():
            missing = missing_isolation(isolation, limits.network)
            if missing:
                warn_unisolated(missing, once=True)
        if killed_for is None and (exit_code is None or "setup_error" in report):
            if "isolation" not in report or "setup_error" in report:
                why = report.get("setup_error") or "the sandbox launcher ended without reporting"
                return sandbox_error_result(f"{why}\n{err_text}".rstrip(), start)
            # The code was running when its supervisor died: without a pid namespace the code itself
            # can kill it (same uid), so this counts against the code, not as the sandbox's failure.
            err_text += "\n[sandbox] the program's supervisor was killed before the program ended"
        limit = killed_for or report.get("watchdog")
        if limit is None:
            limit = classify_ending(exit_code, err_text, report.get("cpu_s"), limits.cpu_time_s)
        status = "limit" if limit else ("ok" if exit_code == 0 else "error")
        return SandboxResult(
            status=status,
            exit_code=None if killed_for else exit_code,
            stdout=decode_output(stdout, limits.max_output_bytes),
            stderr=err_text,
            limit_hit=limit,
            duration_s=time.monotonic() - start,
            network_isolated=bool(isolation.get("network_namespace")),
        )


def run_code(code: str, *, stdin: str = "", limits: SandboxLimits | None = None) -> SandboxResult:
    """Run Python `code` in a `LocalSandbox` with `limits`."""
    return LocalSandbox(limits).run(code, stdin=stdin)


def sandbox_capabilities() -> dict[str, Any]:
    """What the local sandbox enforces on this machine, measured by running a trivial program (once per process).

    Keys: user_namespace, uid_mapped, network_namespace, mount_namespace, pid_namespace (each True when
    in force), filesystem_readonly (all but the work dir), proc_isolated (the trainer's /proc hidden),
    process_watchdog (pid 1 kills all past max_processes), watchdog_realtime (it cannot be starved),
    nproc_rlimit ("per_sandbox", "per_user" or "not_enforced_root"), rlimits (always set), uid (the
    uid the code runs as, outside).
    """
    return dict(_measure_capabilities())


@functools.lru_cache(maxsize=1)
def _measure_capabilities() -> dict[str, Any]:
    # allow_unisolated: a trivial program, run to see what is in force, whatever that is.
    probe = LocalSandbox(SandboxLimits(wall_time_s=30.0), allow_unisolated=True)
    probe._warn = False
    result, report = probe.run_with_report("pass")
    if result.status != "ok":
        raise RuntimeError(f"the local sandbox cannot run a trivial program here: {result.stderr or result.status}")
    rlimits = ["RLIMIT_CPU", "RLIMIT_AS", "RLIMIT_FSIZE", "RLIMIT_CORE"]
    if report["isolation"]["nproc_rlimit"] != "not_enforced_root":
        rlimits.append("RLIMIT_NPROC")
    return {**report["isolation"], "rlimits": rlimits, "uid": os.geteuid()}


def _parse_report(raw: bytes) -> dict:
    # One JSON object per line (the code's child writes one only if its exec failed); later keys win.
    report: dict = {}
    for line in raw.decode("utf-8", errors="replace").splitlines():
        try:
            report.update(json.loads(line))
        except (ValueError, TypeError):
            continue
    return report


def _has_exited(pid: int) -> bool:
    # WNOWAIT: leave it unreaped, so its pid (our process group's id) stays ours until we kill the group.
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _kill_group(pgid: int, wait: bool) -> None:
    """SIGKILL the process group; with `wait`, until its processes are gone (bounded), so none is seen after."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + _REAP_WAIT_S
    while wait and _group_members(pgid, exclude=pgid) and time.monotonic() < deadline:
        time.sleep(0.01)


def _group_members(pgid: int, exclude: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == exclude:
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != b"Z" and int(fields[2]) == pgid:  # fields after the name: state, ppid, pgrp
            members.append(int(entry))
    return members


def _remove_tree(path: str) -> None:
    def make_writable_and_retry(func: Any, failed: str, _exc: Any) -> None:
        # The code may have left directories without write or search permission.
        parent = os.path.dirname(failed)
        os.chmod(parent, os.stat(parent).st_mode | stat.S_IRWXU)
        if os.path.isdir(failed) and not os.path.islink(failed):
            os.chmod(failed, stat.S_IRWXU)
        func(failed)

    try:
        shutil.rmtree(path, onerror=make_writable_and_retry)
    except OSError:
        shutil.rmtree(path, ignore_errors=True)
