"""Point a run that names no data or model at the built-in task and model, with the settings they need.

Every stage's entry point (main_ppo, main_sft, main_rm, and the memory plan's command line) calls these
before preflight, so a bare command trains the built-in task; a key the user gave is never replaced.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from hflow import CONFIG_DIR
from hflow.config_schema import ConfigError

__all__ = ["apply_builtin_settings", "dotted_leaves", "shipped_defaults", "fill_builtin_defaults", "fill_builtin_paths"]


def fill_builtin_defaults(config: DictConfig, user_keys: frozenset[str] = frozenset()) -> None:
    """Point unset data and model paths at the built-in task and model (generated on first use).

    With both the built-in data and model, the settings of `config/builtin_task.yaml` replace the
    shipped defaults (`hflow.config_schema`, the same as `ppo_trainer.yaml`): never a key given on the
    command line (`user_keys`), nor a value that differs from the shipped default.

    With `actor_rollout_ref.rollout.multi_turn.enable`, the built-in task is the agentic one
    (`hflow.tasks.agent_task`: multiplications, a model that calls the calculator only sometimes) and its
    settings are `config/builtin_agent_task.yaml`. With `data.builtin_task=vault` (or one of its controls,
    `vault_reset_every_turn`, `vault_shuffled`), it is the stateful vault task (`hflow.tasks.vault_task`),
    multi-turn with the environment file of the task or the control, settings `config/builtin_vault_task.yaml`.
    With `data.builtin_task=vision_digits` (or its control `vision_digits_blanked`), it is the vision task
    (`hflow.tasks.vision_task`: a tiny Qwen2-VL reads a two-digit number), settings `config/builtin_vision_task.yaml`.
    """
    from hflow.tasks.builtin_task import ensure_builtin_assets
    from hflow.tasks.vision_task import BUILTIN_TASKS as VISION_TASKS

    task = config.data.get("builtin_task")
    if task in VISION_TASKS:
        _check_own_data_and_model(config, task)
        from hflow.tasks.vision_task import ensure_vision_assets

        def files() -> tuple[str, str]:
            assets = ensure_vision_assets()
            return assets.train_file_for(task), assets.val_file

        fill_builtin_paths(config, "actor_rollout_ref.model.path", files, "builtin_vision_task.yaml",
                           shipped_defaults(), user_keys, model_path=lambda: ensure_vision_assets().model_path)
        return
    if task is not None:
        _use_vault(config, user_keys)
        from hflow.tasks.vault_task import ensure_vault_assets

        ensure_assets, settings_yaml = ensure_vault_assets, "builtin_vault_task.yaml"
    elif config.actor_rollout_ref.rollout.multi_turn.enable:
        from hflow.tasks.agent_task import ensure_agent_assets

        ensure_assets, settings_yaml = ensure_agent_assets, "builtin_agent_task.yaml"
    else:
        ensure_assets, settings_yaml = ensure_builtin_assets, "builtin_task.yaml"

    def files() -> tuple[str, str]:
        assets = ensure_assets()
        return str(assets.train_file), str(assets.val_file)

    fill_builtin_paths(config, "actor_rollout_ref.model.path", files, settings_yaml, shipped_defaults(), user_keys,
                       model_path=lambda: ensure_assets().model_path)


def _use_vault(config: DictConfig, user_keys: frozenset[str]) -> None:
    """`data.builtin_task`: checked, then multi-turn with the task's (or control's) environment file, before
    any asset is built; a command that contradicts it stops naming the keys."""
    from hflow.tasks.vault_task import BUILTIN_TASKS, ensure_vault_assets

    from hflow.tasks.vision_task import BUILTIN_TASKS as VISION_TASKS

    task = config.data.builtin_task
    if task not in BUILTIN_TASKS:
        raise ConfigError(f"data.builtin_task={task!r}; choose one of {sorted([*BUILTIN_TASKS, *VISION_TASKS])} "
                          "(or null: arithmetic)")
    _check_own_data_and_model(config, task)
    multi_turn = config.actor_rollout_ref.rollout.multi_turn
    if "actor_rollout_ref.rollout.multi_turn.enable" in user_keys and not multi_turn.enable:
        raise ConfigError(f"data.builtin_task={task} is a multi-turn task (an environment answers the model), but "
                          "actor_rollout_ref.rollout.multi_turn.enable=false is given; drop it")
    with open_dict(config):
        multi_turn.enable = True
        if multi_turn.env_config_path is None:
            multi_turn.env_config_path = ensure_vault_assets().env_config(BUILTIN_TASKS[task])


def _check_own_data_and_model(config: DictConfig, task: str) -> None:
    given = [key for key in ("data.train_files", "data.val_files", "actor_rollout_ref.model.path")
             if OmegaConf.select(config, key) is not None]
    if given:
        raise ConfigError(f"data.builtin_task={task} brings its own data and model, but {', '.join(given)} "
                          "is given; drop data.builtin_task to train on your data, or drop those keys")


def shipped_defaults() -> DictConfig:
    """The shipped `ppo_trainer.yaml`: every key's default (the trainer's typed schema holds the same values,
    `tests/test_config_schema.py` checks it; read from the file here, below the trainer that owns the schema)."""
    return OmegaConf.load(Path(CONFIG_DIR) / "ppo_trainer.yaml")


def fill_builtin_paths(config: DictConfig, model_key: str, data_files, settings_yaml: str, shipped: DictConfig,
                       user_keys: frozenset[str], model_path=None) -> None:
    """The built-in model at `model_key` (`model_path()`, default the arithmetic task's) and the built-in
    `data_files()` (train, val) where unset; with both, `apply_builtin_settings(settings_yaml)`. Shared by
    every stage's entry point."""
    from hflow.tasks.builtin_task import ensure_builtin_assets

    model_path = model_path or (lambda: ensure_builtin_assets().model_path)
    needs_model = OmegaConf.select(config, model_key) is None
    needs_data = config.data.train_files is None or config.data.val_files is None
    if not (needs_model or needs_data):
        return
    train_file, val_file = data_files()
    with open_dict(config):
        if needs_model:
            OmegaConf.update(config, model_key, str(model_path()))
        if config.data.train_files is None:
            config.data.train_files = train_file
        if config.data.val_files is None:
            config.data.val_files = val_file
    if needs_model and needs_data:
        apply_builtin_settings(config, settings_yaml, shipped, user_keys)


def apply_builtin_settings(config: DictConfig, yaml_name: str, shipped: DictConfig, user_keys: frozenset[str]) -> None:
    """The settings of `config/<yaml_name>` for the built-in model and task, over the shipped defaults
    (`shipped`): never over a key given on the command line (`user_keys`), nor a value that differs from
    the shipped default."""
    with open_dict(config):
        for key, value in dotted_leaves(OmegaConf.to_container(OmegaConf.load(Path(CONFIG_DIR) / yaml_name))):
            if key not in user_keys and OmegaConf.select(config, key) == OmegaConf.select(shipped, key):
                OmegaConf.update(config, key, value)


def dotted_leaves(tree: dict, prefix: str = ""):
    """(dotted key, value) for every leaf of a nested dict."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from dotted_leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value
