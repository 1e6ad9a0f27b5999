"""The parts of the GPU check (bench/gpu_check.py runs them and writes the report), one module per thing
measured. Each part module has TITLE and TARGET (the report's summary row) and `run(part, smoke, workdir)`,
which fills the Part record: status PASS or FAIL against the target, a one-line result, details, data.

  a  learning        the built-in task trained on the GPU: validation score before and after
  b  logprob_parity  sampler (HF generation) vs trainer (FSDP2 bf16 forward) log-probs
  c  speed           actor update and log-prob pass of a 1.5B-shaped model: tokens/s, MFU, peak memory
  d  memory          log-prob and entropy memory at a 152k vocabulary

and what they share: common (mesh, memory statistics, actor config), environment (the machine's facts for
the header), report (the Markdown and JSON files). Nothing here imports hflow or torch at module level, so
that bench/gpu_check.py can choose the device (`--smoke-cpu`) before hflow does.
"""

from __future__ import annotations

from . import learning, logprob_parity, memory, speed

PARTS = {"a": learning, "b": logprob_parity, "c": speed, "d": memory}
