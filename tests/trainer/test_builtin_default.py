"""The README's main job: with no data or model given, the built-in task and model learn.

`python -m hflow.trainer.main_ppo algorithm.adv_estimator=grpo`, run as the README runs it and stopped after 6
of its 30 steps to keep the suite short: the validation score passes the shared learning mark
(tests/trainer/learning.py: starts at or below 0.2, ends at or above 0.9, averages 0.8 or more from step 4), a
learning-curve PNG is written beside the metrics, and no warning is printed twice. (The curve has settled by
then: 0.93-0.97 at steps 4 and 6 on all 5 seeds of bench/results/reward_controls.md, as at steps 8 and 10.)
"""

import json

import pytest
from hydra import compose, initialize_config_dir

from hflow import CONFIG_DIR
from tests.trainer.learning import assert_learned, validation_curve
from tests.trainer.test_command_line import assert_no_warning_twice, main_ppo


# GRPO, the README's command. (GAE on the built-in task, the same run with a critic, learns in
# test_reward_controls.py, on the local backend.)
def test_builtin_default_learns_and_prints_no_warning_twice(tmp_path):
    # RAY_DEDUP_LOGS=0: Ray would otherwise fold repeats into "[repeated Nx across cluster]" lines
    code, output, _ = main_ppo(tmp_path, "algorithm.adv_estimator=grpo", "trainer.total_training_steps=6",
                               env={"RAY_DEDUP_LOGS": "0"})
    assert code == 0, output[-4000:]
    log_dir = tmp_path / "logs" / "hflow" / "default"  # in the working directory, as for a user
    records = [json.loads(line) for line in open(log_dir / "metrics.jsonl")]
    assert_learned(validation_curve(records))
    assert (log_dir / "learning_curve.png").stat().st_size > 10_000
    assert_no_warning_twice(output)


def test_builtin_settings_never_replace_what_the_user_gave():
    from hflow.tasks.defaults import fill_builtin_defaults

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        config = compose(config_name="ppo_trainer", overrides=[
            "actor_rollout_ref.rollout.n=1",  # equal to the shipped default, but given explicitly
            "actor_rollout_ref.actor.optim.lr=3e-5",
        ])
    fill_builtin_defaults(config, frozenset({"actor_rollout_ref.rollout.n", "actor_rollout_ref.actor.optim.lr"}))
    assert config.actor_rollout_ref.rollout.n == 1
    assert config.actor_rollout_ref.actor.optim.lr == 3e-5
    assert config.data.train_batch_size == 32  # a built-in setting where the user gave nothing
    assert config.data.train_files is not None and config.actor_rollout_ref.model.path is not None


@pytest.mark.parametrize("nodes,devices", [(1, 1), (1, 2), (1, 4), (1, 8), (2, 8)])
def test_builtin_settings_fit_one_node_of_any_usual_size(nodes, devices):
    """`trainer.n_gpus_per_node=8` (on one or two nodes) with nothing else must pass preflight: the
    built-in micro-batch divides every rank's share of a step."""
    from hflow.tasks.defaults import fill_builtin_defaults
    from hflow.trainer.config import validate_config
    from hflow.trainer.preflight import preflight_check

    overrides = [f"trainer.nnodes={nodes}", f"trainer.n_gpus_per_node={devices}", f"ray_init.num_cpus={devices}"]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        config = validate_config(compose(config_name="ppo_trainer", overrides=overrides))
    fill_builtin_defaults(config, frozenset(o.split("=")[0] for o in overrides))
    preflight_check(config)
