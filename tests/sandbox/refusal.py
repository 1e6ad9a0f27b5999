"""Test helpers for machines that refuse namespaces, real or made so (`no_namespaces.py`)."""

import functools

import pytest

from hflow.sandbox import ALLOW_UNISOLATED_ENV, isolation, local, missing_isolation, sandbox_capabilities
from tests.sandbox import no_namespaces


def refuse_namespaces(monkeypatch, folder, mode="all"):
    """From here on (undone with `monkeypatch`) the sandbox's launcher runs under a seccomp filter that makes
    unshare(2) fail with EPERM, as under Docker's default profile; unisolated runs are not allowed (the
    environment's switch off), each test sees its own first warning, and capabilities are measured anew
    (in a cache of their own: the machine's measurement is back afterwards)."""
    if not no_namespaces.supported():
        pytest.skip("the seccomp wrapper knows x86_64 and aarch64")
    wrapper = no_namespaces.launcher_wrapper(folder, local._LAUNCHER, mode)
    monkeypatch.setattr(local, "_LAUNCHER", str(wrapper))
    monkeypatch.setattr(isolation, "_warned", set())
    monkeypatch.setenv(ALLOW_UNISOLATED_ENV, "0")  # restored afterwards; "0" does not allow
    fresh = functools.lru_cache(maxsize=1)(local._measure_capabilities.__wrapped__)
    monkeypatch.setattr(local, "_measure_capabilities", fresh)


def allow_unisolated_where_refused(monkeypatch):
    """On a machine that refuses namespaces every run is refused (fail closed, tests/sandbox): there, tests of
    what code tools and rewards do with a run's result run with allow_unisolated."""
    if missing_isolation(sandbox_capabilities()):
        monkeypatch.setenv(ALLOW_UNISOLATED_ENV, "1")
