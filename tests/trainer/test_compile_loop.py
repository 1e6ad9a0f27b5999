"""`use_torch_compile` through a real loop: six GRPO steps (local backend, HF rollout, packed rows, so every
micro-batch has a token count of its own), compiled with inductor on the CPU. What the loop compiles is
bounded: each code region of the decoder layers is compiled once per role and mode (actor with gradients,
actor and reference without), all of it in the first step, and Dynamo's recompile limit is never reached
(before, HF generation ran the compiled layers with its KV cache and hit it, as the H100's GRPO log shows)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_six_grpo_steps_compile_each_region_once_per_role_and_mode(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TORCHDYNAMO_DISABLE"}  # (the suite's conftest sets it)
    env.update(OMP_NUM_THREADS="2", PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    run = subprocess.run(
        [sys.executable, "-m", "hflow.trainer.main_ppo", "algorithm.adv_estimator=grpo", "trainer.backend=local",
         "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.name=hf",
         "actor_rollout_ref.model.use_torch_compile=true", "actor_rollout_ref.model.use_remove_padding=true",
         "trainer.total_training_steps=6", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=4",
         "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
         "trainer.val_before_train=false", "trainer.test_freq=100", "trainer.logger=[jsonl]"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    steps = [json.loads(line) for line in open(tmp_path / "logs" / "hflow" / "default" / "metrics.jsonl")]
    steps = [s for s in steps if "actor/pg_loss" in s]
    assert len(steps) == 6
    # the lengths varied: packed micro-batches of different token counts
    assert len({(s["response_length/mean"], s["prompt_length/mean"]) for s in steps}) > 1
    roles = ("actor/train", "actor/no_grad", "ref/no_grad")
    for step in steps:
        assert step["compile/recompile_limit_hits"] == 0, step
        for role in roles:
            assert step[f"compile/max_compiles_per_region/{role}"] == 1, (role, step)
        assert {k.removeprefix("compile/graphs/") for k in step if k.startswith("compile/graphs/")} == set(roles)
    first, last = steps[0], steps[-1]
    assert all(first[f"compile/graphs/{r}"] == last[f"compile/graphs/{r}"] > 0 for r in roles)  # nothing after step 1
