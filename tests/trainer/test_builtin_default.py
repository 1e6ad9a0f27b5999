"""The README's main job: with no data or model given, the built-in task and model learn.

`python -m hflow.trainer.main_ppo algorithm.adv_estimator=grpo` (and the same with gae, critic on), stopped
after 10 of its 30 steps to keep the suite short: the validation score starts at or below 0.2 and ends at or
above 0.8, and a learning-curve PNG is written beside the metrics.
"""

import json

import pytest
from hydra import compose, initialize_config_dir

from hflow.trainer.main_ppo import CONFIG_DIR, run_ppo

VAL_KEY = "val-core/hflow/arithmetic/reward/mean@1"


# GRPO, the README's command. (GAE on the built-in task is the same run with a critic; test_e2e checks that the
# critic learns, and examples/rlhf_pipeline runs PPO with a critic to a measured gain.)
@pytest.mark.parametrize("estimator", ["grpo"])
def test_builtin_default_learns(ray_session, tmp_path, monkeypatch, estimator):
    monkeypatch.chdir(tmp_path)  # logs/ and checkpoints/ go to the working directory, as for a user
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        # 10 of the built-in run's 30 steps: both estimators pass 0.8 by step 4 (GAE: 0.0, 0.75, 1.0, 0.975, 1.0)
        config = compose(config_name="ppo_trainer", overrides=[f"algorithm.adv_estimator={estimator}",
                                                               "trainer.total_training_steps=10"])
    run_ppo(config)
    log_dir = tmp_path / "logs" / "hflow" / "default"
    records = [json.loads(line) for line in open(log_dir / "metrics.jsonl")]
    scores = [r[VAL_KEY] for r in records if VAL_KEY in r]
    assert scores[0] <= 0.2, scores
    assert scores[-1] >= 0.8, scores
    assert (log_dir / "learning_curve.png").stat().st_size > 10_000


def test_builtin_settings_never_replace_what_the_user_gave():
    from hflow.trainer.main_ppo import fill_builtin_defaults

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
    from hflow.config_schema import validate_config
    from hflow.trainer.main_ppo import fill_builtin_defaults
    from hflow.trainer.preflight import preflight_check

    overrides = [f"trainer.nnodes={nodes}", f"trainer.n_gpus_per_node={devices}", f"ray_init.num_cpus={devices}"]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        config = validate_config(compose(config_name="ppo_trainer", overrides=overrides))
    fill_builtin_defaults(config, frozenset(o.split("=")[0] for o in overrides))
    preflight_check(config)
