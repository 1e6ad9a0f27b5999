"""GRPO with router replay learns the built-in task on the built-in MoE model (`MOE_SPEC`: a Qwen3-MoE of 4
experts, 2 per token, pre-trained on the built-in sloppy corpus like the dense model). The short version: 4
steps; the 10-step run against the inverted-reward control is bench/results/moe_replay.md (bench/moe_replay.py).
The HF rollout keeps it short; the same run with the vLLM rollout is bench/results/moe_replay_vllm.md. The
control, the same 4 steps with the inverted reward, must not learn.
"""

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from hflow import CONFIG_DIR
from hflow.tasks.builtin_task import MOE_SPEC, ensure_builtin_assets
from hflow.trainer.main_ppo import run_ppo
from tests.trainer.learning import START_AT_MOST, validation_curve

pytestmark = pytest.mark.slow  # a learning run

STEPS = 4
CONTROLS = str(Path(__file__).with_name("reward_controls.py"))


def moe_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *overrides: str) -> list[dict]:
    """The built-in recipe with router replay on the built-in MoE model for STEPS steps; its metrics records."""
    assets = ensure_builtin_assets(spec=MOE_SPEC)  # cached after the first build (~2 min of CPU)
    monkeypatch.chdir(tmp_path)
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        config = compose(config_name="ppo_trainer", overrides=[
            "algorithm.adv_estimator=grpo", "trainer.backend=local", "trainer.n_gpus_per_node=1",
            "actor_rollout_ref.rollout.name=hf", f"actor_rollout_ref.model.path={assets.model_path}",
            f"data.train_files={assets.train_file}", f"data.val_files={assets.val_file}",
            # the built-in recipe (config/builtin_task.yaml), spelled out since the model is given
            "data.train_batch_size=32", "data.max_prompt_length=32", "data.max_response_length=8",
            "actor_rollout_ref.rollout.n=8", "actor_rollout_ref.actor.ppo_mini_batch_size=32",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", "actor_rollout_ref.actor.optim.lr=2e-4",
            "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.3",
            "actor_rollout_ref.actor.router_replay=true",
            f"trainer.total_training_steps={STEPS}", "trainer.test_freq=2", "trainer.save_freq=-1",
            "trainer.logger=[jsonl]", *overrides])
    run_ppo(config)
    return [json.loads(line) for line in open(tmp_path / "logs" / "hflow" / "default" / "metrics.jsonl")]


def routing_match(records: list[dict]) -> list[float]:
    return [r["actor/moe/routing_match"] for r in records if "actor/moe/routing_match" in r]


def test_moe_with_router_replay_learns_the_builtin_task(tmp_path, monkeypatch):
    records = moe_run(tmp_path, monkeypatch)
    curve = validation_curve(records)
    assert curve[0] <= START_AT_MOST and curve[STEPS] >= 0.8, curve  # 0.0 -> 0.9 at step 4 in the bench run
    # every step replayed the sampler's routing, and the trainer's own routers agreed with it (on-policy, fp32)
    match = routing_match(records)
    assert len(match) == STEPS and min(match) > 0.99, match


@pytest.mark.slow
def test_moe_with_router_replay_and_an_inverted_reward_does_not_learn(tmp_path, monkeypatch):
    """The control: the same run rewarding the wrong answers (validation keeps the true score) stays wrong
    (0.0 at every step of the bench's 10), so the learning above comes from the reward, not from drift."""
    records = moe_run(tmp_path, monkeypatch, f"custom_reward_function.path={CONTROLS}",
                      "custom_reward_function.name=inverted", "custom_reward_function.timeout_s=null")
    curve = validation_curve(records)
    assert sorted(curve) == [0, 2, STEPS] and max(curve.values()) <= 0.1, curve
    # it trained, with replay, as the real run did
    assert len(routing_match(records)) == STEPS
    assert all(r["actor/grad_norm"] > 0 for r in records if "actor/grad_norm" in r)
