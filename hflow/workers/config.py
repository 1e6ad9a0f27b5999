"""Per-rank normalisation of the worker configs: the rules of `hflow.config_schema`, applied with the
group's real size.

Batch sizes are given globally in prompts (`ppo_mini_batch_size`) and per device in sequences
(`*_micro_batch_size_per_gpu`). A worker of a group of `world_size` ranks trains on

    ppo_mini_batch_size_per_rank = ppo_mini_batch_size * rollout.n / world_size   sequences,

cut into micro-batches of `ppo_micro_batch_size_per_gpu`. The user's keys keep their values; derived
per-rank values get names of their own. Every impossible combination raises a `ConfigError` that names
the keys to change (the trainer's preflight applies the same functions before it starts Ray).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from hflow.config_schema import (  # noqa: F401  (ConfigError and the rules are re-exported for the workers)
    ROLLOUT_NAMES,
    ConfigError,
    check_choice,
    check_micro_batch,
    check_offload,
    check_positive,
    check_tensor_parallel,
    per_rank_mini_batch,
)


def resolved_copy(config: Any) -> DictConfig:
    """A detached, fully resolved copy that the worker may extend with derived values."""
    if isinstance(config, DictConfig):
        return OmegaConf.create(OmegaConf.to_container(config, resolve=True))
    return OmegaConf.create(copy.deepcopy(dict(config)))


def check_model_path(path: Any, key: str) -> None:
    """A local Hugging Face model folder (config.json and weights)."""
    if path is None:
        raise ConfigError(f"{key} is not set; give a local Hugging Face model folder")
    folder = Path(str(path)).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"{key}={path} is not a folder; give a local Hugging Face model folder")
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{key}={path} has no config.json; it is not a Hugging Face model folder")
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        raise ConfigError(f"{key}={path} has no weights (*.safetensors or *.bin)")


def normalize_actor_rollout_ref(config: DictConfig, role: str, world_size: int) -> DictConfig:
    """Check the `actor_rollout_ref` subtree for `role` and turn global batch sizes into per-rank ones."""
    cfg = resolved_copy(config)
    prefix = "actor_rollout_ref"
    check_model_path(cfg.model.path, f"{prefix}.model.path")
    n = int(cfg.rollout.n)
    if n < 1:
        raise ConfigError(f"{prefix}.rollout.n must be >= 1, got {n}")
    if role in ("actor", "actor_rollout", "actor_rollout_ref"):
        actor = cfg.actor
        actor.ppo_mini_batch_size_per_rank = per_rank_mini_batch(
            actor.ppo_mini_batch_size, n, world_size, f"{prefix}.actor", f"{prefix}.rollout.n")
        check_micro_batch(actor.ppo_mini_batch_size_per_rank, actor.ppo_micro_batch_size_per_gpu, f"{prefix}.actor",
                          "ppo_micro_batch_size_per_gpu", actor.use_dynamic_bsz)
        check_positive(actor.ppo_epochs, f"{prefix}.actor.ppo_epochs")
    if cfg.rollout.dtype is None:  # the engine's dtype, and the weight stream's: the device's compute dtype
        from hflow.utils.device import compute_dtype

        cfg.rollout.dtype = str(compute_dtype()).removeprefix("torch.")
    if role in ("rollout", "actor_rollout", "actor_rollout_ref"):
        check_tensor_parallel(int(cfg.rollout.tensor_model_parallel_size), world_size)
        check_choice(cfg.rollout.name, ROLLOUT_NAMES, f"{prefix}.rollout.name")
        if not cfg.rollout.log_prob_use_dynamic_bsz:
            check_positive(cfg.rollout.log_prob_micro_batch_size_per_gpu,
                           f"{prefix}.rollout.log_prob_micro_batch_size_per_gpu")
    if role in ("ref", "actor_rollout_ref") and not cfg.ref.log_prob_use_dynamic_bsz:
        check_positive(cfg.ref.log_prob_micro_batch_size_per_gpu, f"{prefix}.ref.log_prob_micro_batch_size_per_gpu")
    if role != "ref":  # every other role builds the actor's model
        check_offload(cfg.actor.fsdp_config, f"{prefix}.actor.fsdp_config")
    if role in ("ref", "actor_rollout_ref"):
        check_offload(cfg.ref.fsdp_config, f"{prefix}.ref.fsdp_config")
    return cfg


def normalize_critic(config: DictConfig, world_size: int) -> DictConfig:
    cfg = resolved_copy(config)
    check_model_path(cfg.model.path, "critic.model.path")
    cfg.ppo_mini_batch_size_per_rank = per_rank_mini_batch(
        cfg.ppo_mini_batch_size, int(cfg.rollout_n), world_size, "critic", "critic.rollout_n")
    check_micro_batch(cfg.ppo_mini_batch_size_per_rank, cfg.ppo_micro_batch_size_per_gpu, "critic",
                      "ppo_micro_batch_size_per_gpu", cfg.use_dynamic_bsz)
    if not cfg.use_dynamic_bsz:
        check_positive(cfg.forward_micro_batch_size_per_gpu, "critic.forward_micro_batch_size_per_gpu")
    check_positive(cfg.ppo_epochs, "critic.ppo_epochs")
    check_offload(cfg.model.fsdp_config, "critic.model.fsdp_config")
    return cfg


def normalize_reward_model(config: DictConfig) -> DictConfig:
    cfg = resolved_copy(config)
    check_model_path(cfg.model.path, "reward_model.model.path")
    check_positive(cfg.micro_batch_size_per_gpu, "reward_model.micro_batch_size_per_gpu")
    return cfg
