"""Run a program the way Docker's default seccomp profile would: ``unshare`` fails with EPERM.

    python no_namespaces.py all|mount_pid PROGRAM [ARGS...]

installs a seccomp filter in this process (inherited by everything it execs and forks, and irremovable),
then execs PROGRAM. ``all``: every unshare(2) is refused, as under Docker. ``mount_pid``: only an
unshare that asks for a mount or pid namespace is refused, so the sandbox gets a user and a network
namespace and nothing else (a partial refusal, as some AppArmor or LSM policies give). The kernel
itself answers EPERM: the code that asks for namespaces runs unchanged.

Stdlib only (the sandbox's launcher imports it via a generated wrapper: see `launcher_wrapper`).
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct
import sys
from pathlib import Path

_ARCH = {  # AUDIT_ARCH_*, __NR_unshare
    "x86_64": (0xC000003E, 272),
    "aarch64": (0xC00000B7, 97),
}
_LD_W_ABS, _JEQ_K, _JSET_K, _RET_K = 0x20, 0x15, 0x45, 0x06
_RET_ALLOW, _RET_ERRNO, _EPERM = 0x7FFF0000, 0x00050000, 1
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, _PR_SET_NO_NEW_PRIVS = 22, 2, 38
_CLONE_NEWNS, _CLONE_NEWPID = 0x00020000, 0x20000000
MODES = ("all", "mount_pid")


class _Filter(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def supported() -> bool:
    return sys.platform == "linux" and platform.machine() in _ARCH


def deny_namespaces(mode: str = "all") -> None:
    """From now on, unshare(2) in this process and its children fails with EPERM (`mode`: which ones)."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; one of {MODES}")
    arch, nr_unshare = _ARCH[platform.machine()]

    def op(code: int, jt: int, jf: int, k: int) -> bytes:
        return struct.pack("HBBI", code, jt, jf, k)

    deny = op(_RET_K, 0, 0, _RET_ERRNO | _EPERM)
    allow = op(_RET_K, 0, 0, _RET_ALLOW)
    if mode == "all":
        tail = [deny, allow]
    else:  # args[0] (flags): its low 32 bits at offset 16 (little endian)
        tail = [op(_LD_W_ABS, 0, 0, 16), op(_JSET_K, 0, 1, _CLONE_NEWNS | _CLONE_NEWPID), deny, allow]
    to_allow = len(tail) - 1  # jumps from the checks below to the final allow
    program = [
        op(_LD_W_ABS, 0, 0, 4),  # seccomp_data.arch
        op(_JEQ_K, 0, 2 + to_allow, arch),
        op(_LD_W_ABS, 0, 0, 0),  # seccomp_data.nr
        op(_JEQ_K, 0, to_allow, nr_unshare),
        *tail,
    ]
    code = b"".join(program)
    buffer = ctypes.create_string_buffer(code, len(code))
    prog = _Filter(len(program), ctypes.cast(buffer, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(NO_NEW_PRIVS)")
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(SECCOMP)")


def launcher_wrapper(folder: Path, launcher: str, mode: str = "all") -> Path:
    """A file to put in place of the sandbox's launcher: it denies namespaces, then execs the real one.

    The sandbox runs it as ``python -I -S -B FILE CONFIG`` (and its status pipe stays open across exec).
    """
    path = Path(folder) / f"launcher_no_namespaces_{mode}.py"
    path.write_text(
        "import os, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from no_namespaces import deny_namespaces\n"
        f"deny_namespaces({mode!r})\n"
        f"os.execv(sys.executable, [sys.executable, '-I', '-S', '-B', {launcher!r}, *sys.argv[1:]])\n"
    )
    return path


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in MODES:
        sys.exit(f"usage: {sys.argv[0]} {'|'.join(MODES)} PROGRAM [ARGS...]")
    deny_namespaces(sys.argv[1])
    os.execvp(sys.argv[2], sys.argv[2:])
