"""What isolation the local sandbox needs before it runs model-written code, and the one message that says it is missing.

Fail closed: a `LocalSandbox` runs code only where the kernel gave it all of `REQUIRED_ISOLATION` (the
network namespace only when the run asked for no network), unless the caller allowed running without it
(`allow_unisolated`, or the environment variable `ALLOW_UNISOLATED_ENV` set to 1, which is how a
trainer's decision reaches its scoring and rollout processes). Preflight (`require_isolation`), the
command line and a refused run all use `unisolated_message`, so each names the same missing pieces and
the same three ways out.
"""

from __future__ import annotations

import os
import sys

__all__ = [
    "ALLOW_UNISOLATED_ENV",
    "REQUIRED_ISOLATION",
    "env_allows_unisolated",
    "missing_isolation",
    "required_isolation",
    "unisolated_message",
    "warn_unisolated",
]

# Each a key of `sandbox_capabilities()` and of the launcher's report, with what it keeps the code from.
REQUIRED_ISOLATION = {
    "user_namespace": "a user namespace (the code would keep this user's rights)",
    "network_namespace": "a network namespace (the code could reach the network, 127.0.0.1 included)",
    "filesystem_readonly": "a read-only mount namespace (the code could write wherever this user can)",
    "proc_isolated": "a pid namespace with its own /proc (the code could see the host's processes and their "
                     "environment)",
}
ALLOW_UNISOLATED_ENV = "HFLOW_SANDBOX_ALLOW_UNISOLATED"

# Where each way out is set, by who asks; {remote} and {allow} are filled in.
_REMOTE_HINTS = {
    "config": "for the python tool, `config: {backend: remote, url: http://HOST:8080/run_code}` in its tool YAML "
              "(actor_rollout_ref.rollout.multi_turn.tool_config_path); code rewards have no remote sandbox of "
              "their own: score them with a reward server (custom_reward_function.url) on a machine that isolates",
    "cli": "--url http://HOST:8080/run_code",
}
_ALLOW_HINTS = {
    "config": "sandbox.allow_unisolated=true (warned at every start and recorded in the run's metadata)",
    "cli": "--allow-unisolated",
}


def required_isolation(network: bool = False) -> list[str]:
    """The `REQUIRED_ISOLATION` keys a run needs; without the network namespace when it asked for the network."""
    return [key for key in REQUIRED_ISOLATION if not (network and key == "network_namespace")]


def missing_isolation(isolation: dict, network: bool = False) -> list[str]:
    """The required keys that `isolation` (a launcher report or `sandbox_capabilities()`) does not have in force."""
    return [key for key in required_isolation(network) if not isolation.get(key)]


def env_allows_unisolated() -> bool:
    """Whether this process was told (``HFLOW_SANDBOX_ALLOW_UNISOLATED=1``) that code may run unisolated."""
    return os.environ.get(ALLOW_UNISOLATED_ENV, "").strip().lower() in ("1", "true", "yes")


def unisolated_message(missing: list[str], used_by: list[str] | None = None, where: str = "config") -> str:
    """Why the local sandbox refuses to run code here and the three ways out; `where`: "config" or "cli"."""
    what = "; ".join(REQUIRED_ISOLATION.get(key, key) for key in missing)
    users = f" ({'; '.join(used_by)})" if used_by else ""
    return (
        f"the local sandbox cannot isolate model-written code on this machine{users}: the kernel refused "
        f"{what}. Unprivileged namespaces are refused here (as under Docker's default seccomp profile, or a "
        "kernel or AppArmor policy that forbids unprivileged user namespaces). Three ways out: "
        f"(1) run the code on a remote sandbox (a Sandbox Fusion server): {_REMOTE_HINTS[where]}; "
        "(2) run where namespaces are allowed: a privileged container (docker run --privileged, or a seccomp "
        "profile that allows unshare) or a host whose kernel allows unprivileged user namespaces "
        "(sysctl user.max_user_namespaces > 0, kernel.unprivileged_userns_clone=1, and on Ubuntu "
        "kernel.apparmor_restrict_unprivileged_userns=0); "
        f"(3) accept the risk and run it unisolated: {_ALLOW_HINTS[where]}"
    )


_warned: set[tuple[str, ...]] = set()


def warn_unisolated(missing: list[str], used_by: list[str] | None = None, once: bool = False) -> str:
    """Print (to stderr) that code runs without `missing` because it was allowed; `once`: once per process."""
    text = (
        "hflow.sandbox: WARNING: model-written code runs WITHOUT isolation (allow_unisolated): missing "
        + "; ".join(REQUIRED_ISOLATION.get(key, key) for key in missing)
        + (f"; used by {'; '.join(used_by)}" if used_by else "")
    )
    if not (once and tuple(missing) in _warned):
        _warned.add(tuple(missing))
        print(text, file=sys.stderr, flush=True)
    return text
