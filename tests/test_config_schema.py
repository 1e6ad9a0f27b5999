"""One source per default: the YAML users read and the typed schema the code relies on say the same thing,
key for key and value for value (every section's dataclass is part of a root, so every section is
compared), each YAML key has its comment, and no default is written a third time in the code; and the
schema is what catches typos and wrong types."""

import ast
import dataclasses
import importlib
import inspect
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from hflow.config_schema import ConfigError

from hflow.trainer.config import SCHEMAS, default_config, reuses_update_log_probs, validate_config

REPO = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO / "config"

# The modules that own a config section (each beside the code that reads it).
SECTION_MODULES = ["hflow.utils.dataset.config", "hflow.workers.config", "hflow.workers.rollout.config",
                   "hflow.agent.config", "hflow.workers.critic.config", "hflow.reward.config",
                   "hflow.algorithms.config", "hflow.trainer.ppo.health_config", "hflow.trainer.config"]


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


STAGES = ["ppo_trainer", "sft_trainer", "rm_trainer", "dpo_trainer"]


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
                                          ("builtin_vault_task", "ppo_trainer"),
                                          ("builtin_sft", "sft_trainer"), ("builtin_rm", "rm_trainer"),
                                          ("builtin_dpo", "dpo_trainer")])
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
    (["algorithm.rollout_mask.token_high=2"], False),  # the mask compares the sampler with a separate pass
    (["algorithm.use_rollout_log_probs=true"], False),
    (["trainer.placement=split", "trainer.async_steps=1"], False),
    (["actor_rollout_ref.actor.ppo_epochs=2", "algorithm.reuse_update_log_probs=true"], True),  # told: preflight judges
    (["algorithm.reuse_update_log_probs=false"], False),
])
def test_old_log_probs_are_reused_by_default_exactly_where_the_update_is_on_policy(overrides, reused):
    config = validate_config(composed("data.train_batch_size=32", "actor_rollout_ref.actor.ppo_mini_batch_size=32",
                                      *overrides))
    assert reuses_update_log_probs(config) is reused


def schema_types(schema: type) -> set[type]:
    """`schema` and every dataclass nested in it."""
    found = {schema}
    for f in dataclasses.fields(schema):
        factory = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        value = factory() if factory else f.default
        if dataclasses.is_dataclass(value):
            found |= schema_types(type(value))
    return found


@pytest.mark.parametrize("module", SECTION_MODULES)
def test_every_section_dataclass_is_part_of_a_root(module):
    """So the key and default comparisons above cover every section a module defines."""
    in_roots = set().union(*(schema_types(schema) for schema in SCHEMAS.values()))
    defined = [obj for _, obj in inspect.getmembers(importlib.import_module(module), inspect.isclass)
               if dataclasses.is_dataclass(obj) and obj.__module__ == module]
    assert defined, f"{module} defines no section"
    orphans = [cls.__name__ for cls in defined if cls not in in_roots and not any(
        issubclass(sub, cls) for sub in in_roots)]  # a base the stages share counts through its subclasses
    assert not orphans, f"{module}: dataclasses in no root schema: {orphans}"


@pytest.mark.parametrize("name", STAGES)
def test_every_yaml_key_has_its_comment(name):
    """A key with a value on its line says what it means there (a section's line may go without)."""
    bare = [f"{number}: {line.strip()}"
            for number, line in enumerate((CONFIG_DIR / f"{name}.yaml").read_text().splitlines(), 1)
            if ":" in line and not line.lstrip().startswith("#") and line.split(":", 1)[1].strip()
            and "#" not in line.split(":", 1)[1]]
    assert not bare, f"{name}.yaml keys without a comment:\n" + "\n".join(bare)


def schema_defaults_by_name() -> dict[str, list]:
    """{leaf key name: its defaults in every stage} (interpolations left out: they name another key)."""
    found: dict[str, list] = {}
    for name in STAGES:
        for key, value in schema_leaves(name).items():
            if not (isinstance(value, str) and "${" in value):
                found.setdefault(key.rpartition(".")[2], []).append(value)
    return found


# Repeated defaults left in files other changes of issue 38 own (the worker/actor code); remove them there.
KNOWN_REPEATS = {
    "hflow/workers/actor/dp_actor.py: getattr(self.config, 'use_remove_padding', False)",
    "hflow/workers/actor/dp_actor.py: meta.get('use_dynamic_bsz', False)",
    "hflow/workers/critic/dp_critic.py: getattr(self.config, 'use_remove_padding', False)",
    "hflow/workers/critic/dp_critic.py: meta.get('use_dynamic_bsz', False)",
}


def test_no_config_default_is_written_a_third_time_in_the_code():
    """`x.get("key", default)` or `getattr(x, "key", default)` with a config key's own default repeats it:
    the validated config always has the key, so the code reads it plainly."""
    defaults = schema_defaults_by_name()
    repeats = set()
    for path in sorted((REPO / "hflow").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.Call):
                continue
            if isinstance(node.func, ast.Attribute) and node.func.attr == "get" and len(node.args) == 2:
                key, default = node.args
            elif isinstance(node.func, ast.Name) and node.func.id == "getattr" and len(node.args) == 3:
                key, default = node.args[1:]
            else:
                continue
            if not (isinstance(key, ast.Constant) and key.value in defaults):
                continue
            try:
                value = ast.literal_eval(default)
            except ValueError:
                continue
            if value is not None and any(value == d and type(value) is type(d) for d in defaults[key.value]):
                repeats.add(f"{path.relative_to(REPO)}: {ast.unparse(node)}")
    new = sorted(repeats - KNOWN_REPEATS)
    assert not new, "config defaults repeated in the code (read the key; its default is the schema's):\n" + \
        "\n".join(new)


def test_the_agent_loop_takes_the_multi_turn_section_itself():
    """No settings class of its own repeating `rollout.multi_turn`'s defaults: the loop takes the section."""
    import hflow.agent.loop as loop
    from hflow.agent.config import MultiTurnConfig

    assert not hasattr(loop, "MultiTurnSettings")
    parameter = inspect.signature(loop.AgentLoop.__init__).parameters["config"]
    assert parameter.annotation in (MultiTurnConfig, "MultiTurnConfig")
    assert parameter.default is inspect.Parameter.empty
    # and nothing in hflow/agent/ but its config module declares a field with a multi_turn default
    names = {f.name for f in dataclasses.fields(MultiTurnConfig)}
    for path in sorted((REPO / "hflow" / "agent").glob("*.py")):
        if path.name == "config.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
                assert node.target.id not in names, f"{path.name}:{node.lineno} repeats multi_turn.{node.target.id}"
