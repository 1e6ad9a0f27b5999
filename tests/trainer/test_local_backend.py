"""`trainer.backend=local`: the real trainer in one process, with neither Ray nor vLLM importable.

The runs are the README's main job (the built-in task), in a subprocess whose `import ray` and `import vllm`
raise (IMPORT_BLOCKER, also used by test_reward_controls.py, whose real-reward run is this backend's
learning test).
"""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT


# Put first on sys.path as `sitecustomize`: every import of ray or vllm (or a submodule) raises, while
# `importlib.util.find_spec` still answers, as it would for a broken install.
IMPORT_BLOCKER = '''
import importlib.abc, importlib.machinery, sys

class _Refuse(importlib.abc.Loader):
    def create_module(self, spec):
        raise ImportError(f"{spec.name} is blocked: trainer.backend=local must not import it")

    def exec_module(self, module):
        pass

class _Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("ray", "vllm"):
            return importlib.machinery.ModuleSpec(name, _Refuse())
        return None

sys.meta_path.insert(0, _Blocker())
'''


# That the local backend learns with neither Ray nor vLLM importable is the real-reward run of
# tests/trainer/test_reward_controls.py (the same command, beside its coin-flip and inverted controls).

def test_local_backend_needs_exactly_one_rank(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "hflow.trainer.main_ppo", "trainer.backend=local", "trainer.n_gpus_per_node=2"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": REPO_ROOT}, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode != 0
    assert "trainer.backend=local runs one rank" in run.stderr and "trainer.n_gpus_per_node=1" in run.stderr


@pytest.mark.slow  # a training run in a subprocess
def test_local_backend_with_the_vllm_engine_runs_and_exits_cleanly(tmp_path):
    """The engine lives in the driver's process here: it must shut down before the process group it
    hangs off (else vLLM's exit handler fails on destroyed subgroups and prints a traceback)."""
    run = subprocess.run(
        [sys.executable, "-m", "hflow.trainer.main_ppo", "algorithm.adv_estimator=grpo", "trainer.backend=local",
         "trainer.n_gpus_per_node=1", "trainer.total_training_steps=2"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": REPO_ROOT}, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "Traceback" not in run.stdout + run.stderr, run.stderr[-4000:]
    records = [json.loads(line) for line in open(tmp_path / "logs" / "hflow" / "default" / "metrics.jsonl")]
    assert any("timing_s/weight_sync" in r for r in records)  # the vLLM engine generated (FSDP -> vLLM sync)
