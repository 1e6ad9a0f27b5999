"""The built-in task learns with this round's throughput and recipe switches on together: packed forwards
(`actor_rollout_ref.model.use_remove_padding`), DAPO dynamic sampling (`algorithm.filter_groups`) and
token-level rollout correction (`algorithm.rollout_is=token`). One real run (Ray, FSDP2, vLLM) instead of one
per switch, to keep the suite short; each switch's definition is tested on its own in
tests/workers/test_remove_padding.py, tests/trainer/test_dapo.py and tests/trainer/test_rollout_is.py.
"""

import json

import pytest
import torch
from hydra import compose, initialize_config_dir

from hflow import CONFIG_DIR
from hflow.trainer.main_ppo import run_ppo
from tests.trainer.learning import assert_learned, validation_curve

pytestmark = pytest.mark.slow  # a learning run

STEPS = 5


def test_builtin_task_learns_with_remove_padding_dynamic_sampling_and_rollout_correction(
        ray_session, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        config = compose(config_name="ppo_trainer", overrides=[
            "algorithm.adv_estimator=grpo", "actor_rollout_ref.model.use_remove_padding=true",
            "algorithm.filter_groups.enable=true", "algorithm.rollout_is=token",
            f"trainer.total_training_steps={STEPS}", f"trainer.test_freq={STEPS}", f"trainer.save_freq={STEPS}"])
    run_ppo(config)
    records = [json.loads(line) for line in open(tmp_path / "logs" / "hflow" / "default" / "metrics.jsonl")]
    assert_learned(validation_curve(records))

    # dynamic sampling: every step says how many generation batches it used, and the checkpoint's loader
    # resumes after the last batch drawn, however many each step drew
    gen_batches = [r["train/num_gen_batches"] for r in records if "train/num_gen_batches" in r]
    filtered = [r["train/filtered_groups_frac"] for r in records if "train/filtered_groups_frac" in r]
    assert len(gen_batches) == len(filtered) == STEPS, (gen_batches, filtered)
    # The model starts right a fifth of the time, so some groups of 8 are all wrong (or, later, all right):
    # the filter drops them, and a step that dropped any must draw more prompts to fill its batch.
    assert max(gen_batches) > 1 and max(filtered) > 0, (gen_batches, filtered)
    assert all((g > 1) == (f > 0) for g, f in zip(gen_batches, filtered)), (gen_batches, filtered)
    state = torch.load(next(tmp_path.rglob(f"global_step_{STEPS}/data/state.pt")), weights_only=True)["dataloader"]
    per_epoch = state["num_samples"] // state["batch_size"]
    assert state["epoch"] * per_epoch + state["batches_done"] == sum(gen_batches), (state, gen_batches)

    # rollout correction: fp32 on CPU, so the sampler and the (packed) trainer agree and the weights are 1
    means = [r["rollout_is/mean"] for r in records if "rollout_is/mean" in r]
    assert len(means) == STEPS and all(abs(m - 1.0) < 1e-3 for m in means), means
