"""Checks and per-rank normalisation of the worker configs, shared by the workers and the trainer.

Batch sizes are given globally in prompts (`ppo_mini_batch_size`) and per device in sequences
(`*_micro_batch_size_per_gpu`). A worker of a group of `world_size` ranks trains on

    per-rank mini-batch = ppo_mini_batch_size * rollout.n / world_size   sequences,

cut into micro-batches of `ppo_micro_batch_size_per_gpu`. Every impossible combination raises a
`ConfigError` that names the keys to change, so the trainer can run the same checks before it starts
Ray or loads a model.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

WORLD_KEYS = "trainer.n_gpus_per_node x trainer.nnodes"


class ConfigError(ValueError):
    """An impossible or invalid configuration; the message names the keys to change."""


def resolved_copy(config: Any) -> DictConfig:
    """A detached, fully resolved copy that the worker may normalise in place."""
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


def per_rank_mini_batch(mini_batch_prompts: int, n: int, world_size: int, prefix: str, n_key: str) -> int:
    """Sequences per rank in one optimizer step."""
    if mini_batch_prompts is None or mini_batch_prompts <= 0:
        raise ConfigError(f"{prefix}.ppo_mini_batch_size must be a positive number of prompts, got {mini_batch_prompts}")
    sequences = mini_batch_prompts * n
    if sequences % world_size:
        raise ConfigError(
            f"{prefix}.ppo_mini_batch_size ({mini_batch_prompts}) x {n_key} ({n}) = {sequences} sequences "
            f"cannot be split evenly over {world_size} ranks ({WORLD_KEYS}); make it a multiple of {world_size}"
        )
    return sequences // world_size


def check_micro_batch(per_rank_mini: int, micro: Any, prefix: str, key: str, use_dynamic_bsz: bool) -> None:
    if use_dynamic_bsz:
        return
    if micro is None or int(micro) <= 0:
        raise ConfigError(f"{prefix}.{key} must be a positive number of sequences (or set {prefix}.use_dynamic_bsz)")
    if per_rank_mini % int(micro):
        raise ConfigError(
            f"{prefix}.{key} ({micro}) must divide the per-rank mini-batch of {per_rank_mini} sequences "
            f"({prefix}.ppo_mini_batch_size x rollout.n / ranks); change one of them"
        )


def check_positive(value: Any, key: str) -> None:
    if value is None or int(value) <= 0:
        raise ConfigError(f"{key} must be a positive integer, got {value}")


def check_offload(fsdp_config: Any, prefix: str) -> None:
    """`offload_policy` (FSDP2's CPUOffloadPolicy: shards, gradients and optimizer step stay on the host)
    excludes the per-phase switches, which move the same state to the device and back around each call."""
    if not fsdp_config.get("offload_policy", False):
        return
    clashing = [f"{prefix}.{key}" for key in ("param_offload", "optimizer_offload") if fsdp_config.get(key, False)]
    if clashing:
        raise ConfigError(
            f"{prefix}.offload_policy=true cannot be combined with {' and '.join(clashing)}=true: the policy "
            "already keeps that state on the host; set one of them to false"
        )


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
        actor.ppo_mini_batch_size = per_rank_mini_batch(
            actor.ppo_mini_batch_size, n, world_size, f"{prefix}.actor", f"{prefix}.rollout.n")
        check_micro_batch(actor.ppo_mini_batch_size, actor.ppo_micro_batch_size_per_gpu, f"{prefix}.actor",
                          "ppo_micro_batch_size_per_gpu", actor.use_dynamic_bsz)
        check_positive(actor.ppo_epochs, f"{prefix}.actor.ppo_epochs")
    if role in ("rollout", "actor_rollout", "actor_rollout_ref"):
        tp = int(cfg.rollout.tensor_model_parallel_size)
        if tp < 1 or world_size % tp:
            raise ConfigError(
                f"{prefix}.rollout.tensor_model_parallel_size ({tp}) must divide the number of ranks "
                f"({world_size}, {WORLD_KEYS})"
            )
        if cfg.rollout.name not in ("vllm", "hf"):
            raise ConfigError(f"{prefix}.rollout.name must be 'vllm' or 'hf', got {cfg.rollout.name!r}")
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
    cfg.ppo_mini_batch_size = per_rank_mini_batch(
        cfg.ppo_mini_batch_size, int(cfg.rollout_n), world_size, "critic", "critic.rollout_n")
    check_micro_batch(cfg.ppo_mini_batch_size, cfg.ppo_micro_batch_size_per_gpu, "critic",
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
