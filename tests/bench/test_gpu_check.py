"""scripts/gpu_check.sh and bench/gpu_check.py on a machine without a GPU: both refuse at once, and the
bench's plumbing (every part, the report, the exit status) works with `--smoke-cpu` (tiny sizes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")


@no_gpu
def test_gpu_check_sh_fails_fast_without_a_gpu(tmp_path):
    # No nvidia-smi on this PATH (and none on a CPU machine anyway): refused before anything is installed.
    env = {**os.environ, "PATH": "/usr/bin:/bin"}
    started = time.perf_counter()
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    assert "no CUDA device found" in run.stderr
    assert time.perf_counter() - started < 10


@no_gpu
def test_bench_refuses_without_cuda(tmp_path):
    out = tmp_path / "gpu_check.md"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "no CUDA device found" in run.stderr
    assert not out.exists()


@pytest.mark.slow  # bench plumbing (every part of the bench on CPU)
def test_smoke_cpu_runs_every_part_and_writes_the_report(tmp_path):
    out = tmp_path / "gpu_check.md"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--smoke-cpu", "--out", str(out),
         "--tests-rc", "0", "--tests-summary", "6 passed"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    report = out.read_text()
    assert "Smoke run on CPU" in report and "6 passed" in report
    for key in "abcd":
        assert f"\n## {key}. " in report
    parts = json.loads(out.with_suffix(".json").read_text())["parts"]
    assert {k: v["status"] for k, v in parts.items() if v["status"] == "ERROR"} == {}
    # a: the trainer ran with the local backend, validated before and after, without Ray or vLLM
    assert len(parts["a"]["scores"]) >= 2
    assert parts["a"]["imports"] == "GPU_CHECK_IMPORTED ray=False vllm=False"
    # b: fp32 on CPU, so the sampler's and the trainer's log-probs agree to rounding
    assert parts["b"]["tokens"] > 0 and parts["b"]["max_abs_dp"] < 1e-4
    # c: both micro-batch sizes measured, with MFU against this CPU's measured fp32 matmul peak
    assert len(parts["c"]["rows"]) == 2
    assert all(r["update_mfu"] > 0 and r["logprob_mfu"] > 0 for r in parts["c"]["rows"])
    assert all(r["update_tokens_per_s"] > 0 and r["logprob_tokens_per_s"] > 0 for r in parts["c"]["rows"])
    assert "Ray / vLLM imported by this check | neither" in report


def test_the_smoke_run_reaches_every_module_of_the_check():
    """bench/gpu_check.py runs the parts that bench/gpu_check_parts registers, one module each, and the smoke
    run above runs all of them (a, b, c, d) and writes the report (environment, report): a module added to
    the package but not registered as a part, or a part without its title, target or `run`, fails here."""
    package = ROOT / "bench" / "gpu_check_parts"
    probe = ("import json, sys; sys.path.insert(0, sys.argv[1]); from gpu_check_parts import PARTS; "
             "print(json.dumps({k: [m.__name__, bool(m.__doc__), isinstance(m.TITLE, str), isinstance(m.TARGET, str), "
             "callable(m.run)] for k, m in PARTS.items()}))")
    run = subprocess.run([sys.executable, "-c", probe, str(package.parent)], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr[-3000:]
    parts = json.loads(run.stdout)
    assert sorted(parts) == list("abcd")  # what the smoke run checks, part by part
    assert all(all(checks) for _, *checks in parts.values()), parts
    shared = {"common", "environment", "report"}  # used by every run, the smoke run included
    registered = {name.removeprefix("gpu_check_parts.") for name, *_ in parts.values()}
    assert {p.stem for p in package.glob("*.py")} - {"__init__"} == registered | shared
    assert all((package / f"{name}.py").read_text().startswith('"""') for name in registered | shared)


# As on the GPU machine: ray and vllm are not installed (ModuleNotFoundError, which pytest.importorskip skips on;
# a broken install's ImportError would stop the run, as it should).
NOT_INSTALLED = '''
import sys

class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("ray", "vllm"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NotInstalled())
'''


def test_gpu_tests_are_collected_where_neither_ray_nor_vllm_imports(tmp_path):
    """The GPU machine has torch but neither Ray nor vLLM: `pytest -m gpu tests`, as gpu_check.sh runs it,
    must collect the gpu tests and skip the modules that need Ray, not stop at collection."""
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    assert '-m pytest -m gpu -p no:cacheprovider -q -rfE tests' in script  # the command checked here
    (tmp_path / "sitecustomize.py").write_text(NOT_INSTALLED)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    run = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-q", "-rs", "tests"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "error" not in run.stdout.lower().split("short test summary")[-1], run.stdout[-3000:]
    skipped_for_ray = [line for line in run.stdout.splitlines() if "needs Ray" in line]
    assert len(skipped_for_ray) >= 3, run.stdout[-3000:]
    gpu_tests = [line for line in run.stdout.splitlines() if "tests/gpu/test_cuda_path.py" in line]
    assert gpu_tests, run.stdout[-3000:]  # collected (and, without CUDA here, skipped by tests/gpu/conftest.py)


def test_gpu_wheels_fetch_everything_the_check_installs():
    """Every distribution gpu_check.sh installs when missing is in gpu_wheels.sh's list (or its documented
    extras), so the offline install on the GPU machine never lacks a wheel."""
    import re

    check = (ROOT / "scripts" / "gpu_check.sh").read_text()
    wheels = (ROOT / "scripts" / "gpu_wheels.sh").read_text()
    needed_block = re.search(r"needed=\((.*?)\)", check, re.S).group(1)
    installed = {pair.split(":")[1].lower() for pair in needed_block.split()}
    fetched = {name.lower() for name in re.findall(r'"([A-Za-z0-9_.-]+)==', wheels)}
    extras = {"pandas", "pyarrow", "matplotlib"}  # large compiled wheels: GPU_WHEELS_EXTRA
    fetched.add("antlr4-python3-runtime")  # built from source by the script
    assert installed - fetched - extras == set()
    assert all(extra in wheels for extra in extras)
