"""A CPU worker runs vLLM's sampler helpers eagerly (`fsdp_workers.eager_on_cpu`), whatever its environment.

The suite sets TORCHDYNAMO_DISABLE=1 for every process (tests/conftest.py); a user's worker does not. This runs a
fresh interpreter without it, as a worker starts."""

import os
import subprocess
import sys

PROBE = """
import os
import torch._dynamo
from hflow.workers import fsdp_workers  # what a worker has imported before it builds its engine

assert not torch._dynamo.config.disable
os.environ["TORCHDYNAMO_DISABLE"] = "1"  # too late: read when torch._dynamo was imported
assert not torch._dynamo.config.disable
fsdp_workers.eager_on_cpu()
assert torch._dynamo.config.disable
print("eager")
"""


def test_a_worker_without_the_variable_runs_eagerly():
    env = {k: v for k, v in os.environ.items() if k != "TORCHDYNAMO_DISABLE"}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("eager"), out.stderr[-2000:]
