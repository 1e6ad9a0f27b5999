"""One source per default: the YAML users read and the typed schema the code relies on say the same thing,
key for key and value for value; and the schema is what catches typos and wrong types."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from hflow.config_schema import ConfigError

from hflow.trainer.config import SCHEMAS, default_config, reuses_update_log_probs, validate_config

CONFIG_DIR = Path(__file__).resolve().parent.parent / "config"


def leaves(tree, prefix=""):
    """{dotted key: value} of every leaf; free-form maps that are empty count as leaves ({})."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def yaml_leaves(name: str) -> dict:
    return leaves(OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / name), resolve=False))


def schema_leaves(name: str = "ppo_trainer") -> dict:
    return leaves(OmegaConf.to_container(default_config(SCHEMAS[name]), resolve=False))


STAGES = ["ppo_trainer", "sft_trainer", "rm_trainer"]


@pytest.mark.parametrize("name", STAGES)
def test_yaml_and_schema_have_the_same_keys(name):
    yaml_keys, schema_keys = set(yaml_leaves(f"{name}.yaml")), set(schema_leaves(name))
    assert not yaml_keys - schema_keys, f"in {name}.yaml but not in the schema: {sorted(yaml_keys - schema_keys)}"
    assert not schema_keys - yaml_keys, f"in the schema but not in {name}.yaml: {sorted(schema_keys - yaml_keys)}"


@pytest.mark.parametrize("name", STAGES)
def test_yaml_and_schema_have_the_same_defaults(name):
    yaml, schema = yaml_leaves(f"{name}.yaml"), schema_leaves(name)
    differ = {key: (yaml[key], schema[key]) for key in yaml.keys() & schema.keys() if yaml[key] != schema[key]}
    assert not differ, "defaults that differ (yaml, schema): " + ", ".join(f"{k}={v}" for k, v in sorted(differ.items()))


@pytest.mark.parametrize("name", STAGES)
def test_every_yaml_value_has_the_schema_type(name):
    validate_config(OmegaConf.load(CONFIG_DIR / f"{name}.yaml"), SCHEMAS[name])


@pytest.mark.parametrize("builtin,name", [("builtin_task", "ppo_trainer"), ("builtin_agent_task", "ppo_trainer"),
                                          ("builtin_sft", "sft_trainer"), ("builtin_rm", "rm_trainer")])
def test_builtin_task_settings_name_schema_keys(builtin, name):
    unknown = sorted(set(yaml_leaves(f"{builtin}.yaml")) - set(schema_leaves(name)))
    assert not unknown, f"{builtin}.yaml names keys the schema does not have: {unknown}"
    validate_config(OmegaConf.load(CONFIG_DIR / f"{builtin}.yaml"), SCHEMAS[name])  # and values of the right type


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name="ppo_trainer", overrides=list(overrides))


@pytest.mark.parametrize("override,named", [
    ("+data.train_batchsize=8", ["data.train_batchsize", "data.train_batch_size"]),
    ("data.train_batch_size=abc", ["data.train_batch_size", "abc"]),
    ("actor_rollout_ref.rollout.temperature=hot", ["actor_rollout_ref.rollout.temperature"]),
    ("+trainer.nonsense=1", ["trainer.nonsense"]),
])
def test_unknown_keys_and_wrong_types_fail_naming_the_key(override, named):
    with pytest.raises(ConfigError) as err:
        validate_config(composed(override))
    for word in named:
        assert word in str(err.value), f"{word!r} not in: {err.value}"


def test_free_form_maps_take_new_keys_and_values_are_converted():
    config = validate_config(composed("+custom_reward_function.reward_kwargs.scale=2",
                                      "+actor_rollout_ref.model.override_config.attention_dropout=0.0",
                                      "data.train_batch_size=8"))
    assert config.custom_reward_function.reward_kwargs.scale == 2
    assert config.actor_rollout_ref.model.override_config.attention_dropout == 0.0
    assert config.data.train_batch_size == 8


def test_interpolations_follow_the_keys_they_name():
    config = validate_config(composed("actor_rollout_ref.rollout.n=4", "data.max_prompt_length=100"))
    assert config.critic.rollout_n == 4
    assert config.actor_rollout_ref.rollout.prompt_length == 100
    assert config.critic.optim.lr == 1.0e-5  # the critic's own default, not the actor's


@pytest.mark.parametrize("overrides,reused", [
    ([], True),  # one epoch, one mini-batch: the update's own log-probs are the old ones, exactly
    (["actor_rollout_ref.actor.ppo_epochs=2"], False),
    (["actor_rollout_ref.actor.ppo_mini_batch_size=16"], False),  # two optimizer steps: the second is off-policy
    (["algorithm.use_kl_in_reward=true"], False),  # the reward needs them before the update
    (["algorithm.rollout_is=token"], False),
    (["algorithm.use_rollout_log_probs=true"], False),
    (["trainer.placement=split", "trainer.async_steps=1"], False),
    (["actor_rollout_ref.actor.ppo_epochs=2", "algorithm.reuse_update_log_probs=true"], True),  # told: preflight judges
    (["algorithm.reuse_update_log_probs=false"], False),
])
def test_old_log_probs_are_reused_by_default_exactly_where_the_update_is_on_policy(overrides, reused):
    config = validate_config(composed("data.train_batch_size=32", "actor_rollout_ref.actor.ppo_mini_batch_size=32",
                                      *overrides))
    assert reuses_update_log_probs(config) is reused
