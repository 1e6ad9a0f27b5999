"""`trainer.backend=local`: the real trainer in one process, with neither Ray nor vLLM importable.

The run is the README's main job (the built-in task) with the HF rollout, in a subprocess whose
`import ray` and `import vllm` raise. It must learn as the Ray backend does (tests/trainer/
test_builtin_default.py: the validation score starts at or below 0.2 and ends at or above 0.8).
"""

import json
import os
import subprocess
import sys

from tests.conftest import REPO_ROOT

VAL_KEY = "val-core/hflow/arithmetic/reward/mean@1"

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


def test_local_backend_learns_without_ray_or_vllm(tmp_path):
    blocker_dir = tmp_path / "blocker"
    blocker_dir.mkdir()
    (blocker_dir / "sitecustomize.py").write_text(IMPORT_BLOCKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker_dir), REPO_ROOT])}
    probe = subprocess.run([sys.executable, "-c", "import ray"], env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "is blocked" in probe.stderr  # the blocker is in force

    run = subprocess.run(
        [sys.executable, "-m", "hflow.trainer.main_ppo", "algorithm.adv_estimator=grpo", "trainer.backend=local",
         "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.name=hf",
         # the built-in run passes 0.8 within a few steps; 8 of its 30 keep the suite short
         "trainer.total_training_steps=8", "trainer.test_freq=4"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    records = [json.loads(line) for line in open(tmp_path / "logs" / "hflow" / "default" / "metrics.jsonl")]
    scores = [r[VAL_KEY] for r in records if VAL_KEY in r]
    assert scores[0] <= 0.2, scores
    assert scores[-1] >= 0.8, scores


def test_local_backend_needs_exactly_one_rank(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "hflow.trainer.main_ppo", "trainer.backend=local", "trainer.n_gpus_per_node=2"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": REPO_ROOT}, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode != 0
    assert "trainer.backend=local runs one rank" in run.stderr and "trainer.n_gpus_per_node=1" in run.stderr


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
