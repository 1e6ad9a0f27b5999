"""What a slow tool costs a multi-turn rollout: each of S samples calls a tool that sleeps, once.

The built-in arithmetic model answers in one or two tokens, and a benchmark parser makes every turn call
the `wait` tool; with `multi_turn.max_user_turns=1` each sample therefore makes exactly one call and
then answers. The sleep comes from each row's `extra_info.tools_kwargs` (execute kwargs), so one run can
give every sample its own tool latency. Measured in one process, on the real vLLM engine:

* the rollout with every call sleeping `--sleep-s` against the same rollout with calls that return at
  once (the added time; serial calls would add S x sleep),
* a rollout where one sample's call sleeps `--slow-s` and the others' return at once: when the other
  episodes end, against when the slow one does (samples advance independently).

    python bench/agent_tool_latency.py --samples 64 --sleep-s 1 --repeats 3 --out bench/results/agent_tool_latency

Writes OUT.md and OUT.json (medians of the repeats, with the command and the commit).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WAIT_TOOL = '''
import time


def wait(label: str = "", seconds: float = 0.0) -> str:
    time.sleep(seconds)
    return "done"
'''

TOOLS_YAML = """tools:
  - function: wait_tool.py:wait
    tool_schema:
      type: function
      function:
        name: wait
        description: wait a while
        parameters: {type: object, properties: {label: {type: string}}, required: []}
"""


def register_always_call_parser() -> str:
    """A parser that makes every turn call `wait` (the turn limit ends each episode after one call)."""
    from hflow.agent.parsers import ParsedTurn, ToolCall, ToolCallParser, register_parser

    @register_parser("bench-always-wait")
    class AlwaysWait(ToolCallParser):
        def parse(self, text: str) -> ParsedTurn:
            return ParsedTurn(content=text, calls=[ToolCall("wait", {"label": text[:8]})], malformed=[])

    return "bench-always-wait"


def build_rollout(samples: int, workdir: Path):
    """A vLLMRollout on the built-in arithmetic model, multi-turn with the wait tool, and S prompts."""
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from transformers import AutoConfig, AutoTokenizer

    from hflow.trainer.config import default_config
    from hflow.tasks.builtin_task import ensure_builtin_assets, builtin_problems
    from hflow.workers.rollout.vllm_rollout import vLLMRollout

    (workdir / "wait_tool.py").write_text(WAIT_TOOL)
    (workdir / "tools.yaml").write_text(TOOLS_YAML)
    assets = ensure_builtin_assets()
    tokenizer = AutoTokenizer.from_pretrained(assets.model_path)
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    config = default_config().actor_rollout_ref.rollout
    for key, value in {
        "n": 1, "temperature": 1.0, "prompt_length": 32, "response_length": 64, "dtype": "float32",
        "enforce_eager": True, "kv_cache_memory_bytes": 64 * 2**20, "gpu_memory_utilization": 0.5,
        "load_format": "auto", "multi_turn.enable": True, "multi_turn.format": register_always_call_parser(),
        "multi_turn.tool_config_path": str(workdir / "tools.yaml"), "multi_turn.max_user_turns": 1,
        "multi_turn.max_concurrent_tools": max(samples, 1),
    }.items():
        OmegaConf.update(config, key, value, merge=True)
    rollout = vLLMRollout(assets.model_path, config, tokenizer, AutoConfig.from_pretrained(assets.model_path))
    questions = [p.question for p in builtin_problems()[:samples]]
    prompt_ids = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                return_dict=True)["input_ids"] for q in questions]
    del torch
    return rollout, tokenizer, prompt_ids


def make_batch(tokenizer, prompt_ids: list[list[int]], seconds: list[float]):
    """Prompts with each row's tool sleep in `tools_kwargs`."""
    import numpy as np
    import torch

    from hflow.protocol import DataProto
    from hflow.utils.torch_functional import compute_position_id_with_mask

    width = max(map(len, prompt_ids))
    ids = torch.full((len(prompt_ids), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(prompt_ids):
        ids[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    kwargs = np.array([{"wait": {"execute_kwargs": {"seconds": s}}} for s in seconds], dtype=object)
    return DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": compute_position_id_with_mask(mask)},
        {"tools_kwargs": kwargs},
        meta_info={"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id},
    )


def timed_rollout(rollout, batch) -> tuple[float, list[dict]]:
    started = time.perf_counter()
    output = rollout.generate_sequences(batch)
    return time.perf_counter() - started, list(output.non_tensor_batch["episode"])


def measure(samples: int, sleep_s: float, slow_s: float, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        rollout, tokenizer, prompt_ids = build_rollout(samples, Path(tmp))
        timed_rollout(rollout, make_batch(tokenizer, prompt_ids, [0.0] * samples))  # warm-up
        instant, sleeping, others_end, slow_end = [], [], [], []
        for _ in range(repeats):  # interleaved, so drift in machine load hits every case alike
            seconds, episodes = timed_rollout(rollout, make_batch(tokenizer, prompt_ids, [0.0] * samples))
            assert all(e["num_tool_turns"] == 1 for e in episodes), "every sample must call the tool once"
            instant.append(seconds)
            seconds, episodes = timed_rollout(rollout, make_batch(tokenizer, prompt_ids, [sleep_s] * samples))
            sleeping.append(seconds)
            _, episodes = timed_rollout(rollout, make_batch(tokenizer, prompt_ids, [slow_s] + [0.0] * (samples - 1)))
            slow_end.append(episodes[0]["finished_s"])
            others_end.append(max(e["finished_s"] for e in episodes[1:]))
        rollout.close()
    median = statistics.median
    return {
        "samples": samples,
        "sleep_s": sleep_s,
        "slow_s": slow_s,
        "repeats": repeats,
        "rollout_instant_tools_s": median(instant),
        "rollout_sleeping_tools_s": median(sleeping),
        "added_s": median(s - i for s, i in zip(sleeping, instant)),
        "serial_would_add_s": samples * sleep_s,
        "one_slow_sample_end_s": median(slow_end),
        "other_samples_end_s": median(others_end),
    }


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write(result: dict, out: Path, command: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {**result, "command": command, "commit": _commit(), "load_1min": os.getloadavg()[0]}
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    r = result
    out.with_suffix(".md").write_text(
        "# Tool latency in a multi-turn rollout\n\n"
        f"`{command}` (commit {r['commit']}, load {r['load_1min']:.1f}); the built-in arithmetic model on the vLLM "
        f"engine, {r['samples']} samples, each calling the `wait` tool once; medians of {r['repeats']} interleaved "
        "repetitions, measured.\n\n"
        "| case | seconds |\n|---|---|\n"
        f"| rollout, tools return at once | {r['rollout_instant_tools_s']:.2f} |\n"
        f"| rollout, every call sleeps {r['sleep_s']:g} s | {r['rollout_sleeping_tools_s']:.2f} |\n"
        f"| **added by the sleeping tools** | **{r['added_s']:.2f}** |\n"
        f"| what serial calls would add (computed: samples x sleep) | {r['serial_would_add_s']:.0f} |\n"
        f"| one sample's call sleeps {r['slow_s']:g} s: the other {r['samples'] - 1} samples have ended after | "
        f"{r['other_samples_end_s']:.2f} |\n"
        f"| ... and the slow sample ends after | {r['one_slow_sample_end_s']:.2f} |\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--sleep-s", type=float, default=1.0)
    parser.add_argument("--slow-s", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "agent_tool_latency")
    args = parser.parse_args()
    result = measure(args.samples, args.sleep_s, args.slow_s, args.repeats)
    command = "python bench/agent_tool_latency.py " + " ".join(sys.argv[1:])
    write(result, args.out, command.strip())
    print(args.out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
