"""On CPU an engine is built with vLLM's sampler helpers eager (`vllm_rollout.new_engine`), whatever the
process's environment.

The suite sets TORCHDYNAMO_DISABLE=1 for every process (tests/conftest.py); a user's worker does not. This runs a
fresh interpreter without it, imports what a worker has imported by then and builds a rollout's engine."""

import os
import subprocess
import sys

PROBE = """
import os, sys
import torch._dynamo
from hflow.workers import fsdp_workers  # noqa: F401 - a worker's imports, torch._dynamo among them
from hflow.workers.rollout.vllm_rollout import new_engine, vLLMRollout
from hflow.trainer.config import default_section
from hflow.tasks.tiny_models import build_causal_lm
from transformers import AutoConfig

assert not torch._dynamo.config.disable
os.environ["TORCHDYNAMO_DISABLE"] = "1"  # too late: read when torch._dynamo was imported
assert not torch._dynamo.config.disable
path = build_causal_lm(sys.argv[1], preset="tiny")
config = default_section("actor_rollout_ref.rollout", prompt_length=8, response_length=4, load_format="auto",
                         dtype="float32")
new_engine(vLLMRollout._engine_kwargs(str(path), config, AutoConfig.from_pretrained(path), None))
assert torch._dynamo.config.disable
print("eager")
"""


def test_an_engine_built_without_the_variable_runs_eagerly(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TORCHDYNAMO_DISABLE"}
    out = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "tiny")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("eager"), out.stderr[-3000:]
