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
import json
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
    try:
        json.loads((folder / "config.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ConfigError(f"{key}={path}: its config.json is not readable JSON ({err}); restore the file") from None
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        raise ConfigError(f"{key}={path} has no weights (*.safetensors or *.bin)")


# Any of these makes a folder a tokenizer's; without one, transformers builds an empty tokenizer of the
# model's type from config.json alone (no vocabulary, no chat template) instead of failing.
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


def check_tokenizer_path(model: Any, prefix: str) -> None:
    """The tokenizer folder of a model section (`tokenizer_path`, else `path`) holds a tokenizer."""
    key = f"{prefix}.tokenizer_path" if model.tokenizer_path else f"{prefix}.path"
    path = model.tokenizer_path or model.path
    folder = Path(str(path)).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"{key}={path} is not a folder; give a local folder with the tokenizer's files")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        hint = "" if model.tokenizer_path else f", or set {prefix}.tokenizer_path to a folder that has them"
        raise ConfigError(f"{key}={path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); copy the "
                          f"tokenizer's files there{hint}")


# vLLM's share of each device when `rollout.gpu_memory_utilization` is null: half of it beside the training
# models that take turns with the engine (colocated), most of it on a device of the engine's own (the rollout
# pool of `trainer.placement=split`), leaving room for CUDA graphs and the weight stream's buffer.
GPU_MEMORY_UTILIZATION = {"colocated": 0.5, "own_device": 0.9}


def resolve_gpu_memory_utilization(value: Any, own_device: bool, key: str) -> float:
    """`rollout.gpu_memory_utilization`: the user's fraction, or for null the default of where the engine
    runs (`GPU_MEMORY_UTILIZATION`)."""
    if value is None:
        return GPU_MEMORY_UTILIZATION["own_device" if own_device else "colocated"]
    if not 0.0 < float(value) <= 1.0:
        raise ConfigError(f"{key} must be in (0, 1] (a fraction of each device's memory) or null, got {value}")
    return float(value)


def normalize_actor_rollout_ref(config: DictConfig, role: str, world_size: int, own_device: bool = False) -> DictConfig:
    """Check the `actor_rollout_ref` subtree for `role` and turn global batch sizes into per-rank ones.
    `own_device`: the rollout engine has its devices to itself (a standalone engine of the rollout pool)."""
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
        check_ptx(actor.ptx, f"{prefix}.actor.ptx")
        check_ema(actor.ema, f"{prefix}.actor.ema")
        check_lora(cfg, prefix)
    if cfg.rollout.dtype is None:  # the engine's dtype, and the weight stream's (fp16 on GPUs without bf16)
        from hflow.utils.device import rollout_dtype

        cfg.rollout.dtype = str(rollout_dtype()).removeprefix("torch.")
    cfg.rollout.gpu_memory_utilization = resolve_gpu_memory_utilization(
        cfg.rollout.gpu_memory_utilization, own_device, f"{prefix}.rollout.gpu_memory_utilization")
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
    # The model-level flag, where DataParallelPPOActor reads it (the actor and the reference share it).
    cfg.actor.use_remove_padding = cfg.ref.use_remove_padding = bool(cfg.model.get("use_remove_padding", False))
    if role in ("ref", "actor_rollout_ref"):
        check_offload(cfg.ref.fsdp_config, f"{prefix}.ref.fsdp_config")
    return cfg


def check_ptx(ptx: Any, prefix: str) -> None:
    """PPO-ptx sizes, when it is on (`coef > 0`); the files are checked where they are read."""
    coef = float(ptx.coef)
    if coef < 0:
        raise ConfigError(f"{prefix}.coef must be >= 0 (0 = off), got {coef}")
    if coef == 0:
        return
    check_positive(ptx.batch_size_per_gpu, f"{prefix}.batch_size_per_gpu")
    check_positive(ptx.micro_batch_size_per_gpu, f"{prefix}.micro_batch_size_per_gpu")
    if int(ptx.batch_size_per_gpu) % int(ptx.micro_batch_size_per_gpu):
        raise ConfigError(f"{prefix}.micro_batch_size_per_gpu ({ptx.micro_batch_size_per_gpu}) must divide "
                          f"{prefix}.batch_size_per_gpu ({ptx.batch_size_per_gpu})")
    if int(ptx.max_length) < 2:
        raise ConfigError(f"{prefix}.max_length must be >= 2 tokens (one predicts the next), got {ptx.max_length}")


def check_lora(arr: Any, prefix: str) -> None:
    """`model.lora_rank` is 0 (off) or positive, with an alpha and targets; the EMA of the weights is not
    kept for adapters."""
    model = arr.model
    rank = int(model.get("lora_rank", 0) or 0)
    if rank < 0:
        raise ConfigError(f"{prefix}.model.lora_rank must be >= 0 (0 = no LoRA), got {rank}")
    if rank == 0:
        return
    if float(model.lora_alpha) <= 0:
        raise ConfigError(f"{prefix}.model.lora_alpha must be > 0, got {model.lora_alpha}")
    if not model.target_modules:
        raise ConfigError(f"{prefix}.model.target_modules is empty; use all-linear or a list of module names")
    if arr.actor.ema.enable:
        raise ConfigError(f"{prefix}.actor.ema.enable=true is not supported with {prefix}.model.lora_rank > 0")


def check_ema(ema: Any, prefix: str) -> None:
    if ema.enable and not 0.0 <= float(ema.decay) < 1.0:
        raise ConfigError(f"{prefix}.decay must be in [0, 1), got {ema.decay}")


def check_value_head(model: Any, prefix: str) -> None:
    """`value_head_init` is a known choice; a reward model's folder as the critic has one label."""
    from hflow.workers.fsdp import VALUE_HEAD_INITS, is_sequence_classifier

    check_choice(model.value_head_init, VALUE_HEAD_INITS, f"{prefix}.value_head_init")
    config_file = Path(str(model.path)).expanduser() / "config.json"
    folder_config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    labels = len(folder_config.get("id2label") or {}) or folder_config.get("num_labels", 1)
    if is_sequence_classifier(folder_config) and labels != 1:
        raise ConfigError(f"{prefix}.path={model.path} is a sequence classifier with {labels} labels; a critic can "
                          "start from a reward model with one label (num_labels=1) only")


def normalize_critic(config: DictConfig, world_size: int) -> DictConfig:
    cfg = resolved_copy(config)
    check_model_path(cfg.model.path, "critic.model.path")
    check_value_head(cfg.model, "critic.model")
    cfg.ppo_mini_batch_size_per_rank = per_rank_mini_batch(
        cfg.ppo_mini_batch_size, int(cfg.rollout_n), world_size, "critic", "critic.rollout_n")
    check_micro_batch(cfg.ppo_mini_batch_size_per_rank, cfg.ppo_micro_batch_size_per_gpu, "critic",
                      "ppo_micro_batch_size_per_gpu", cfg.use_dynamic_bsz)
    if not cfg.use_dynamic_bsz:
        check_positive(cfg.forward_micro_batch_size_per_gpu, "critic.forward_micro_batch_size_per_gpu")
    check_positive(cfg.ppo_epochs, "critic.ppo_epochs")
    check_offload(cfg.model.fsdp_config, "critic.model.fsdp_config")
    cfg.use_remove_padding = bool(cfg.model.get("use_remove_padding", False))  # where DataParallelPPOCritic reads it
    return cfg


def normalize_reward_model(config: DictConfig) -> DictConfig:
    cfg = resolved_copy(config)
    check_model_path(cfg.model.path, "reward_model.model.path")
    check_positive(cfg.micro_batch_size_per_gpu, "reward_model.micro_batch_size_per_gpu")
    return cfg
