"""The sandbox's launcher: sets up isolation, then runs the untrusted program and reports how it ended.

Run by `hflow.sandbox.local` as ``python -I -S -B _launcher.py CONFIG_JSON`` in a new session, with
the work directory as cwd. Stdlib only and imports nothing of hflow (it runs isolated, like the code).

Process tree (pids as seen from the trainer)::

    launcher (L)          unshare(user, net, mount, pid); read-only filesystem; waits for I
      └─ init (I)         pid 1 of the new pid namespace: mounts /proc, reaps, counts processes
           └─ code (C)    rlimits, no_new_privs, then exec of `python -I -S main.py`

When I exits the kernel kills everything left in its pid namespace, so nothing the code started
outlives the run. Without a pid namespace L supervises C itself. The report is one JSON line per
writer on the status pipe (fd `status_fd`); C's copy closes at exec, so the code cannot forge it.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import resource
import select
import signal
import sys
from collections.abc import Callable
from typing import Any

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 2, 4, 8
_MS_BIND, _MS_REC, _MS_PRIVATE = 4096, 0x4000, 1 << 18
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS = 1, 38
_SYS_MOUNT_SETATTR = 442  # the same number on every architecture (new syscalls share one table)
_MOUNT_ATTR_RDONLY, _AT_FDCWD, _AT_RECURSIVE = 1, -100, 0x8000
_INSIDE_ID = 1000  # the code's uid/gid inside the user namespace: not 0, so its exec drops every capability
_WATCH_INTERVAL_S = 0.02

_libc = ctypes.CDLL(None, use_errno=True)


class _MountAttr(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("attr_set", "attr_clr", "propagation", "userns_fd")]


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int) -> None:
    src, typ = (None if s is None else s.encode() for s in (source, fstype))
    _check(_libc.mount(src, target.encode(), typ, ctypes.c_ulong(flags), None), f"mount {target}")


def _set_readonly(path: str, readonly: bool, recursive: bool) -> None:
    attr = _MountAttr(_MOUNT_ATTR_RDONLY if readonly else 0, 0 if readonly else _MOUNT_ATTR_RDONLY, 0, 0)
    flags = _AT_RECURSIVE if recursive else 0
    ret = _libc.syscall(_SYS_MOUNT_SETATTR, _AT_FDCWD, path.encode(), flags, ctypes.byref(attr), ctypes.sizeof(attr))
    _check(ret, f"mount_setattr {path}")


def _die_with_parent(parent_alive: Callable[[], bool]) -> None:
    # A parent killed mid-run (e.g. a scoring worker past its deadline) must not leave the code running.
    _check(_libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
    if not parent_alive():  # it died before the prctl
        os._exit(1)


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _unshare(network: bool) -> dict[str, bool]:
    """The strongest set of namespaces the OS allows; which ones are in force.

    The one place the sandbox asks for namespaces: where the kernel refuses them (EPERM, e.g. Docker's
    default seccomp profile), none are in force and the run is refused before the code starts (see
    `_refuse_unisolated`), unless the caller allowed running without them.
    """
    net = 0 if network else _CLONE_NEWNET
    for flags in (_CLONE_NEWUSER | _CLONE_NEWNS | _CLONE_NEWPID | net, _CLONE_NEWUSER | net):
        if _libc.unshare(flags) == 0:
            return {
                "user_namespace": True,
                "network_namespace": bool(flags & _CLONE_NEWNET),
                "mount_namespace": bool(flags & _CLONE_NEWNS),
                "pid_namespace": bool(flags & _CLONE_NEWPID),
            }
    return dict.fromkeys(("user_namespace", "network_namespace", "mount_namespace", "pid_namespace"), False)


def _realtime() -> bool:
    """Give this process (and so init, forked from it) a real-time priority, if allowed (root: before unshare).

    A fork bomb's thousands of runnable processes would otherwise starve init's process count for
    seconds; a real-time task runs as soon as it wakes. The code's process drops it before exec.
    """
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    except OSError:
        return False
    return True


def _isolate(cfg: dict[str, Any]) -> dict[str, Any]:
    uid, gid = os.geteuid(), os.getegid()
    realtime = _realtime()
    iso: dict[str, Any] = _unshare(cfg["network"])
    iso["watchdog_realtime"] = realtime and iso["pid_namespace"]  # (init inherits it)
    iso["filesystem_readonly"] = False
    iso["uid_mapped"] = False
    if iso["user_namespace"]:
        # Map only our own uid; the code runs as a non-zero id inside, so exec leaves it no capabilities.
        # A namespace without capabilities (e.g. an AppArmor policy) refuses the map: the network is still
        # cut, the mounts below then fail and are reported as not in force.
        try:
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"{_INSIDE_ID} {uid} 1")
            _write("/proc/self/gid_map", f"{_INSIDE_ID} {gid} 1")
            iso["uid_mapped"] = True
        except OSError:
            pass
    if iso["mount_namespace"]:
        iso["filesystem_readonly"] = _readonly_except(cfg["workdir"])
    os.chdir(cfg["workdir"])  # after the bind mount: the old cwd would still point under it, read-only
    if iso["user_namespace"]:
        # Since Linux 5.14 RLIMIT_NPROC counts per user namespace, so it limits this sandbox alone; uid 0
        # is exempt from it everywhere (measured), which the pid-1 watchdog covers.
        iso["nproc_rlimit"] = "per_sandbox" if uid != 0 else "not_enforced_root"
    else:
        iso["nproc_rlimit"] = "per_user" if uid != 0 else "not_enforced_root"
    iso["proc_isolated"] = False  # set by init once it mounted its own /proc
    iso["process_watchdog"] = False  # likewise: it counts the processes that /proc lists
    return iso


def _readonly_except(workdir: str) -> bool:
    """Make every mount read-only but a bind mount of `workdir`; False (and all left writable) if the OS refuses."""
    try:
        _mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing we do here propagates to the host
        _mount(workdir, workdir, None, _MS_BIND)
        _set_readonly("/", True, recursive=True)
    except OSError:
        return False
    try:
        _set_readonly(workdir, False, recursive=False)
    except OSError:
        _set_readonly("/", False, recursive=True)
        return False
    return True


def _nproc_limit(cfg: dict[str, Any], iso: dict[str, Any]) -> int | None:
    """RLIMIT_NPROC for the code: its max_processes plus what it counts besides the code's own processes."""
    if iso["nproc_rlimit"] == "per_sandbox":
        return cfg["max_processes"] + (2 if iso["pid_namespace"] else 1)  # L (and I) share the count
    if iso["nproc_rlimit"] == "per_user":
        return _user_tasks(os.getuid()) + cfg["max_processes"]  # counts all of this uid's tasks
    return None


def _user_tasks(uid: int) -> int:
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                count += int(fields["Threads"])
        except (OSError, KeyError, ValueError):
            continue  # the process ended while we looked
    return count


def _exec_code(cfg: dict[str, Any], iso: dict[str, Any], status_fd: int) -> None:
    """In the forked child: limits, then exec. Never returns."""
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, [])  # the mask survives exec
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))  # no real-time priority for the code
        cpu = max(1, math.ceil(cfg["cpu_time_s"]))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at the soft limit, SIGKILL at the hard
        resource.setrlimit(resource.RLIMIT_AS, (cfg["memory_bytes"],) * 2)
        resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["max_file_bytes"],) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        nproc = _nproc_limit(cfg, iso)
        if nproc is not None:
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
        if iso["pid_namespace"]:
            # Out of the launcher's process group, which it could otherwise signal (killpg(0)). The
            # trainer's kill of that group still takes the code: init dies with it, and the namespace.
            os.setpgid(0, 0)
        else:
            _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        exe = sys.executable
        os.execv(exe, [exe, "-I", "-S", "-B", "-u", "-X", "utf8", cfg["main"]])
    except BaseException as err:  # noqa: BLE001 - report anything, then leave without running the code
        os.write(status_fd, (json.dumps({"setup_error": f"starting the code failed: {err!r}"}) + "\n").encode())
    os._exit(127)


def _refuse_unisolated(cfg: dict[str, Any], iso: dict[str, Any], status_fd: int) -> None:
    """End here, the code never started, if isolation that `cfg["require"]` lists is not in force.

    Fail closed: the caller lists what it needs (empty only when it allowed running unisolated), and
    a machine that refused it at this run (it may have allowed it at preflight) gets a refusal, never
    an unisolated run.
    """
    missing = [key for key in cfg["require"] if not iso.get(key)]
    if missing:
        os.write(status_fd, (json.dumps({"isolation": iso, "refused": missing}) + "\n").encode())
        os._exit(0)  # as pid 1 this also ends the namespace


def _supervise(cfg: dict[str, Any], iso: dict[str, Any], status_fd: int, as_init: bool) -> None:
    """Fork and exec the code, wait for it (as pid 1: reaping orphans, counting processes), report. Never returns."""
    _refuse_unisolated(cfg, iso, status_fd)
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])
    child = os.fork()
    if child == 0:
        _exec_code(cfg, iso, status_fd)
    report: dict[str, Any] = {"isolation": iso, "watchdog": None}
    while "exit_code" not in report:
        if as_init:
            _reap(child, report, block=False)
            counted = iso["process_watchdog"] and "exit_code" not in report
            if counted and _more_processes_than(cfg["max_processes"] + 1):  # +1: init itself
                report["watchdog"] = "processes"
                os.kill(-1, signal.SIGKILL)  # from pid 1: every process of the namespace but itself
            signal.sigtimedwait([signal.SIGCHLD], _WATCH_INTERVAL_S)
        else:
            _reap(child, report, block=True)
    os.write(status_fd, (json.dumps(report) + "\n").encode())
    os._exit(0)  # as pid 1, this kills whatever the code left behind


def _more_processes_than(limit: int) -> bool:
    """Whether this pid namespace's /proc lists more than `limit` processes.

    Stops reading at limit + 1: a full listing can chase a fork bomb's new pids for ever.
    """
    with os.scandir("/proc") as entries:
        return sum(1 for _ in zip(range(limit + 1), (e for e in entries if e.name.isdigit()))) > limit


def _reap(child: int, report: dict[str, Any], block: bool) -> None:
    """Collect ended children; the code's own status (and CPU time) goes into `report`."""
    while True:
        try:
            pid, status, usage = os.wait4(child if block else -1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid == child:
            report["exit_code"] = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            report["cpu_s"] = usage.ru_utime + usage.ru_stime
            return


def _init(cfg: dict[str, Any], iso: dict[str, Any], status_fd: int, launcher_alive: int) -> None:
    # The launcher is outside our pid namespace (getppid() is 0): its end shows as EOF on this pipe.
    _die_with_parent(lambda: not select.select([launcher_alive], [], [], 0)[0])
    os.close(launcher_alive)
    try:
        # Our own /proc shows only this namespace: the trainer's /proc/<pid>/environ is out of sight.
        _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
        iso["proc_isolated"] = iso["process_watchdog"] = True
    except OSError:
        pass
    _supervise(cfg, iso, status_fd, as_init=True)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    status_fd = cfg["status_fd"]
    os.set_inheritable(status_fd, False)
    _die_with_parent(lambda: os.getppid() == cfg["parent_pid"])
    try:
        iso = _isolate(cfg)
    except OSError as err:
        os.write(status_fd, (json.dumps({"setup_error": f"isolating the sandbox failed: {err}"}) + "\n").encode())
        os._exit(1)
    os.write(status_fd, (json.dumps({"isolation": iso}) + "\n").encode())  # known even if the run is killed
    if not iso["pid_namespace"]:
        _supervise(cfg, iso, status_fd, as_init=False)
    alive_r, alive_w = os.pipe()  # held open by the launcher alone, for as long as it lives
    init = os.fork()
    if init == 0:
        os.close(alive_w)
        _init(cfg, iso, status_fd, alive_r)
    os.close(alive_r)
    os.close(status_fd)
    os.waitpid(init, 0)
    os._exit(0)


if __name__ == "__main__":
    main()
