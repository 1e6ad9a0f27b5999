"""The built-in agentic task learns with its tool and does not without it.

`python -m hflow.trainer.main_ppo algorithm.adv_estimator=grpo actor_rollout_ref.rollout.multi_turn.enable=true`
with no data or model trains `hflow.tasks.agent_task`: multiplications of two 2-digit numbers, which the
small model cannot do in its head (greedy, with tools: 0.01 on the held-out problems) but can with the
built-in calculator, which it calls in a quarter of its samples. Held-out greedy episodes (with the tool)
must go from <= 0.2 to >= 0.9 and stay there (tests/trainer/learning.py's mark) on the real engines (Ray,
vLLM) colocated on two ranks sharing one tensor-parallel engine, with generation on its own devices two
steps off with partial rollouts (`split`, `async_steps=2`, `partial_rollout`), and with the critic (GAE) on
two ranks of HF generation. The control is a GRPO run on the local backend with a calculator that always
fails: calling it earns nothing, and the score must stay <= 0.3.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.trainer.agent_controls import write_broken_tools
from tests.trainer.learning import assert_learned, validation_curve

pytestmark = pytest.mark.slow  # learning runs (four trainings of the agentic task)

VAL_KEY = "val-core/hflow/multiply/reward/mean@1"
STEPS = 6


def run_agent_task(tmp_path: Path, *overrides: str, steps: int = STEPS) -> tuple[dict[int, float], list[dict]]:
    run = subprocess.run(
        [sys.executable, "-m", "hflow.trainer.main_ppo", "actor_rollout_ref.rollout.multi_turn.enable=true",
         f"trainer.total_training_steps={steps}", *overrides],
        cwd=tmp_path, capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": REPO_ROOT},
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    records = [json.loads(line) for line in open(tmp_path / "logs" / "hflow" / "default" / "metrics.jsonl")]
    return validation_curve(records, VAL_KEY), records


def test_grpo_learns_to_call_the_calculator_on_ray_and_vllm(tmp_path):
    """Two ranks, one engine in tensor parallelism over both: only its first rank runs tools, and the
    other adds the same turns at the same step."""
    curve, records = run_agent_task(tmp_path, "algorithm.adv_estimator=grpo", "trainer.rollout_data_dir=rollouts",
                                    "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=2")
    assert_learned(curve)
    steps = [r for r in records if "agent/tool_calls/mean" in r]
    assert steps[0]["agent/tool_calls/mean"] < 0.5 < steps[-1]["agent/tool_calls/mean"], "it learned without the tool?"
    # an episode that called the tool (most do by now; which ones is the sampler's choice)
    episodes = [json.loads(line)["episode"] for line in open(tmp_path / "rollouts" / f"{STEPS}.jsonl")]
    episode = next(e for e in episodes if e["tool_calls"])
    assert [m["role"] for m in episode["messages"]][:3] == ["assistant", "tool", "assistant"], episode


def test_grpo_learns_with_generation_on_its_own_devices_two_steps_off_with_partial_rollouts(tmp_path):
    """Episodes in flight when new weights arrive go on with them (a turn is interrupted and continued);
    no token trained is more than two policy versions old."""
    curve, records = run_agent_task(tmp_path, "algorithm.adv_estimator=grpo", "trainer.placement=split",
                                    "trainer.n_gpus_per_node=2", "trainer.async_steps=2", "algorithm.rollout_is=token",
                                    "actor_rollout_ref.rollout.partial_rollout=true")
    assert_learned(curve)
    steps = [r for r in records if "actor/pg_loss" in r]
    assert max(r["training/staleness/max"] for r in steps) == 2


def test_gae_learns_on_two_ranks_with_hf_generation(tmp_path):
    """HF generation advances in waves, and both ranks step every wave together."""
    curve, _ = run_agent_task(tmp_path, "algorithm.adv_estimator=gae", "trainer.n_gpus_per_node=2",
                              "actor_rollout_ref.rollout.name=hf")
    assert_learned(curve)


def test_control_a_broken_calculator_teaches_nothing(tmp_path):
    tools = write_broken_tools(tmp_path / "broken_tools.yaml")
    curve, records = run_agent_task(tmp_path, "algorithm.adv_estimator=grpo", "trainer.backend=local",
                                    "trainer.n_gpus_per_node=1",
                                    f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}")
    assert curve[0] <= 0.2 and max(curve.values()) <= 0.3, curve
    errors = [r.get("agent/tool_errors/raised", 0.0) for r in records if "agent/tool_calls/mean" in r]
    assert min(errors) > 0, "the control's calls must fail (and be counted), or it controls nothing"
