"""`critic`: the value model's section (typed defaults; comments in `config/ppo_trainer.yaml`), its check
before Ray starts, and its per-rank normalisation in the worker."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig

from hflow.config_schema import ConfigError, ConfigErrors, check_choice, check_positive, check_positive_number, ref
from hflow.workers.config import (
    CheckpointConfig,
    FSDPConfig,
    OptimConfig,
    check_micro_batch,
    check_model_path,
    check_offload,
    check_optim,
    check_update_batches,
    per_rank_mini_batch,
    resolved_copy,
)


@dataclass
class CriticModelConfig:
    path: Optional[str] = ref("actor_rollout_ref.model.path")
    tokenizer_path: Optional[str] = ref("actor_rollout_ref.model.path")
    override_config: dict[str, Any] = field(default_factory=dict)
    enable_gradient_checkpointing: bool = False
    trust_remote_code: bool = ref("actor_rollout_ref.model.trust_remote_code")
    value_head_init: str = "zero"  # zero | normal; unused when path is a reward model's folder
    use_remove_padding: Optional[bool] = ref("actor_rollout_ref.model.use_remove_padding")  # None = by device
    use_liger: bool = ref("actor_rollout_ref.model.use_liger")
    use_torch_compile: bool = ref("actor_rollout_ref.model.use_torch_compile")
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class CriticOptimConfig(OptimConfig):
    lr: float = 1.0e-5


@dataclass
class CriticConfig:
    strategy: str = "fsdp2"
    rollout_n: int = ref("actor_rollout_ref.rollout.n")
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    ppo_mini_batch_size: int = ref("actor_rollout_ref.actor.ppo_mini_batch_size")  # prompts (global)
    ppo_micro_batch_size_per_gpu: int = ref("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu")
    forward_micro_batch_size_per_gpu: int = ref("critic.ppo_micro_batch_size_per_gpu")
    use_dynamic_bsz: Optional[bool] = ref("actor_rollout_ref.actor.use_dynamic_bsz")
    ppo_max_token_len_per_gpu: int = 32768
    forward_max_token_len_per_gpu: int = ref("critic.ppo_max_token_len_per_gpu")
    ppo_epochs: int = ref("actor_rollout_ref.actor.ppo_epochs")
    shuffle: bool = ref("actor_rollout_ref.actor.shuffle")
    grad_clip: float = 1.0
    cliprange_value: float = 0.5
    loss_agg_mode: str = ref("actor_rollout_ref.actor.loss_agg_mode")
    freeze_vision_tower: bool = ref("actor_rollout_ref.actor.freeze_vision_tower")
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    optim: CriticOptimConfig = field(default_factory=CriticOptimConfig)


def check_value_head(model: Any, prefix: str) -> None:
    """`value_head_init` is a known choice; a reward model's folder as the critic has one label."""
    from hflow.workers.fsdp import VALUE_HEAD_INITS, is_sequence_classifier  # here: it imports transformers

    check_choice(model.value_head_init, VALUE_HEAD_INITS, f"{prefix}.value_head_init")
    config_file = Path(str(model.path)).expanduser() / "config.json"
    folder_config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    labels = len(folder_config.get("id2label") or {}) or folder_config.get("num_labels", 1)
    if is_sequence_classifier(folder_config) and labels != 1:
        raise ConfigError(f"{prefix}.path={model.path} is a sequence classifier with {labels} labels; a critic can "
                          "start from a reward model with one label (num_labels=1) only")


def check_vision_freeze(critic: Any) -> None:
    """`critic.freeze_vision_tower` needs a vision-language model (a folder whose config has a vision tower)."""
    from hflow.utils.vision import has_vision_tower

    if critic.freeze_vision_tower and not has_vision_tower(str(Path(str(critic.model.path)).expanduser())):
        raise ConfigError(f"critic.freeze_vision_tower=true (it follows actor_rollout_ref.actor.freeze_vision_tower), "
                          f"but critic.model.path={critic.model.path} is not a vision-language model (no vision_config "
                          "in its config.json); set critic.freeze_vision_tower=false")


def check_critic(critic: Any) -> None:
    """Before Ray starts (with `algorithm.adv_estimator=gae`): a model to start from, its value head, its
    optimizer and offload settings (its batch sizes: `check_critic_batches`)."""
    if critic.model.path is None:
        raise ConfigError("algorithm.adv_estimator=gae trains a critic: set critic.model.path "
                          "(by default it is the actor's model)")
    errors = ConfigErrors()
    errors.run(check_value_head, critic.model, "critic.model")
    errors.run(check_vision_freeze, critic)
    errors.run(check_optim, critic.optim, "critic.optim")
    errors.run(check_offload, critic.model.fsdp_config, "critic.model.fsdp_config")
    errors.run(check_positive_number, critic.grad_clip, "critic.grad_clip", "the largest gradient norm")
    errors.run(check_positive_number, critic.cliprange_value, "critic.cliprange_value",
               "the value clip around the old values")
    errors.raise_any()


def check_critic_batches(critic: Any, batch_prompts: int, n: int, world_size: int) -> None:
    check_update_batches(critic, batch_prompts, n, world_size, "critic", "critic.rollout_n")


def normalize_critic(config: DictConfig, world_size: int) -> DictConfig:
    """The worker's copy of `critic`, checked with the group's real size, with per-rank batch sizes."""
    cfg = resolved_copy(config)
    from hflow.utils.device import is_cuda

    for section, key in ((cfg.model, "use_remove_padding"), (cfg, "use_dynamic_bsz")):
        if section[key] is None:  # by the device; the trainer resolves them first (resolve_device_defaults)
            section[key] = is_cuda()
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
    cfg.use_remove_padding = bool(cfg.model.use_remove_padding)  # where DataParallelPPOCritic reads it
    return cfg
