"""The roots of the configuration: the `trainer` and `ray_init` sections, the stages' root schemas
(`PPOTrainerConfig`, `SFTTrainerConfig`, `RMTrainerConfig`, `DPOTrainerConfig`) assembled from the sections their owners
define, and the trainer's own rules (world size, placement, resume, the reuse of the update's log-probs).

Code that builds a configuration by hand (tests, benchmarks) starts from `default_config()` or
`default_section(...)` and sets what it needs. Typed defaults here and in the sections' modules; the
comments in `config/*.yaml`, which mirror them key for key (`tests/test_config_schema.py`).
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from hflow.algorithms.config import AlgorithmConfig, rollout_mask_on
from hflow.config_schema import (
    WORLD_KEYS,
    ConfigError,
    ConfigErrors,
    check_choice,
    check_non_negative,
    check_positive,
    defaults,
    validate,
)
from hflow.reward.config import CustomRewardFunctionConfig, RewardModelConfig
from hflow.sandbox.config import SandboxConfig
from hflow.trainer.ppo.health_config import HealthConfig
from hflow.utils.dataset.config import DataConfig, DPODataConfig, RMDataConfig, SFTDataConfig
from hflow.utils.tracking import check_backends
from hflow.workers.config import ActorRolloutRefConfig, CheckpointConfig, DPOConfig, FSDPConfig, OptimConfig
from hflow.workers.critic.config import CriticConfig
from hflow.workers.teacher.config import TeacherConfig, uses_teacher

__all__ = [
    "DPOTrainerConfig",
    "PPOTrainerConfig",
    "RMTrainerConfig",
    "SCHEMAS",
    "SFTTrainerConfig",
    "check_placement",
    "default_config",
    "default_section",
    "placement_pools",
    "reuses_update_log_probs",
    "validate_config",
]


@dataclass
class TrainerConfig:
    project_name: str = "hflow"
    experiment_name: str = "default"
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    backend: str = "ray"  # ray | local
    nnodes: int = 1
    n_gpus_per_node: int = 2
    cpus_per_worker: int = 1
    threads_per_worker: Optional[int] = None
    placement: str = "colocate"  # colocate | split
    rollout_n_gpus: int = 1  # split: devices of the rollout pool
    async_steps: int = 0  # k >= 0: train on rollouts at most k policy versions old (k >= 1: split only)
    deterministic: bool = False  # the same command writes the same metrics and checkpoints (model.batch_invariant)
    total_epochs: int = 1
    total_training_steps: Optional[int] = None
    critic_warmup: int = 0
    test_freq: int = -1
    val_before_train: bool = True
    save_freq: int = -1
    resume_mode: str = "auto"
    resume_from_path: Optional[str] = None
    max_actor_ckpt_to_keep: Optional[int] = None
    max_critic_ckpt_to_keep: Optional[int] = None
    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"
    log_dir: str = "logs/${trainer.project_name}/${trainer.experiment_name}"
    rollout_data_dir: Optional[str] = None
    validation_data_dir: Optional[str] = None
    log_val_generations: int = 0
    seed: int = 42
    reward_audit: bool = False  # audit the reward for gaming responses before training (hflow.reward.audit)
    reward_audit_max_accept: float = 0.05
    memory_plan: str = "summary"  # off | summary | enforce (hflow.trainer.memory)
    device_memory_gb: Optional[float] = None  # memory of one device for the plan; None = the device's own
    health: HealthConfig = field(default_factory=HealthConfig)


@dataclass
class RayInitConfig:
    num_cpus: Optional[int] = None
    address: Optional[str] = None


@dataclass
class PPOTrainerConfig:
    """config/ppo_trainer.yaml"""

    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)  # on-policy distillation's teacher
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    ray_init: RayInitConfig = field(default_factory=RayInitConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)  # where model-written code runs


# ---- the supervised stages (config/{sft,rm,dpo}_trainer.yaml; comments there) ------


@dataclass
class StageModelConfig:
    path: Optional[str] = None  # None = the built-in model
    tokenizer_path: Optional[str] = None
    override_config: dict[str, Any] = field(default_factory=dict)
    enable_gradient_checkpointing: bool = False
    trust_remote_code: bool = False
    attn_implementation: Optional[str] = None
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class StageOptimConfig(OptimConfig):
    lr: float = 1.0e-5
    grad_clip: float = 1.0


@dataclass
class StageTrainerConfig:
    project_name: str = "hflow"
    experiment_name: str = "default"
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    backend: str = "ray"
    nnodes: int = 1
    n_gpus_per_node: int = 2
    cpus_per_worker: int = 1
    threads_per_worker: Optional[int] = None
    total_epochs: int = 1
    total_training_steps: Optional[int] = None
    test_freq: int = -1
    val_before_train: bool = True
    save_freq: int = -1
    resume_mode: str = "auto"
    resume_from_path: Optional[str] = None
    max_ckpt_to_keep: Optional[int] = None
    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"
    log_dir: str = "logs/${trainer.project_name}/${trainer.experiment_name}"
    hf_output_dir: str = "${trainer.default_local_dir}/huggingface"
    seed: int = 42


@dataclass
class StageConfig:
    """What the supervised stages share; each adds its `data` and its `trainer` defaults."""

    model: StageModelConfig = field(default_factory=StageModelConfig)
    optim: StageOptimConfig = field(default_factory=StageOptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    ray_init: RayInitConfig = field(default_factory=RayInitConfig)


@dataclass
class SFTTrainerConfig(StageConfig):
    """config/sft_trainer.yaml"""

    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    trainer: StageTrainerConfig = field(default_factory=lambda: StageTrainerConfig(experiment_name="sft"))


@dataclass
class RMTrainerConfig(StageConfig):
    """config/rm_trainer.yaml"""

    data: RMDataConfig = field(default_factory=RMDataConfig)
    trainer: StageTrainerConfig = field(default_factory=lambda: StageTrainerConfig(experiment_name="rm"))


@dataclass
class DPOTrainerConfig(StageConfig):
    """config/dpo_trainer.yaml"""

    data: DPODataConfig = field(default_factory=DPODataConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    trainer: StageTrainerConfig = field(default_factory=lambda: StageTrainerConfig(experiment_name="dpo"))


SCHEMAS = {"ppo_trainer": PPOTrainerConfig, "sft_trainer": SFTTrainerConfig, "rm_trainer": RMTrainerConfig,
           "dpo_trainer": DPOTrainerConfig}


def default_config(schema: type = PPOTrainerConfig) -> DictConfig:
    """The whole configuration at its defaults: typed, every key present, unknown keys refused.
    `schema`: the stage (`PPOTrainerConfig`, `SFTTrainerConfig`, `RMTrainerConfig`)."""
    return defaults(schema)


def default_section(key: str, **overrides: Any) -> DictConfig:
    """One section of `default_config()` (e.g. `"actor_rollout_ref.rollout"`) with `overrides` set (typed,
    interpolations to other sections resolved against the defaults): what tests and benchmarks hand to a
    component that takes one section."""
    section = OmegaConf.select(default_config(), key)
    for name, value in overrides.items():
        OmegaConf.update(section, name, value, merge=True)
    return section


def validate_config(config: DictConfig | dict, schema: type = PPOTrainerConfig) -> DictConfig:
    """`config` checked against the `schema` (default: PPO's): a typed copy with every key, or a
    `ConfigError` naming the first key that is unknown or holds a value of the wrong type."""
    return validate(config, schema)


# ==================================================================================================
# The trainer's rules
# ==================================================================================================

BACKENDS = ("ray", "local")
PLACEMENTS = ("colocate", "split")
RESUME_MODES = ("auto", "resume_path", "disable")
MEMORY_PLAN_MODES = ("off", "summary", "enforce")


def check_world(trainer: Any) -> int:
    """`trainer.backend` and the number of ranks it runs (returned)."""
    world = int(trainer.n_gpus_per_node) * int(trainer.nnodes)
    if world < 1:
        raise ConfigError(f"trainer.n_gpus_per_node x trainer.nnodes must be >= 1, got {world}")
    check_choice(trainer.backend, BACKENDS, "trainer.backend")
    if trainer.backend == "local" and world != 1:
        raise ConfigError(
            f"trainer.backend=local runs one rank in this process, but trainer.n_gpus_per_node x trainer.nnodes "
            f"= {world}; set trainer.n_gpus_per_node=1 trainer.nnodes=1, or use trainer.backend=ray")
    return world


def check_run(trainer: Any) -> None:
    """The run's logging, resumption and length, its counts in range; all of their errors together."""
    errors = ConfigErrors()
    with errors.catch():
        try:
            check_backends(trainer.logger)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    errors.run(check_resume, trainer)
    errors.run(check_output_dirs, trainer)
    with errors.catch():
        if trainer.total_training_steps is None and int(trainer.total_epochs) < 1:
            raise ConfigError("set trainer.total_epochs >= 1 or trainer.total_training_steps")
    for key, hint in (("critic_warmup", "steps that train the critic alone"),
                      ("log_val_generations", "0: none")):
        errors.run(check_non_negative, trainer[key], f"trainer.{key}", hint)
    for key in ("max_actor_ckpt_to_keep", "max_critic_ckpt_to_keep"):
        with errors.catch():
            if trainer[key] is not None and int(trainer[key]) < 1:
                raise ConfigError(f"trainer.{key} must be a number of step folders >= 1, or null to keep all, "
                                  f"got {trainer[key]}")
    errors.raise_any()


def check_output_dirs(trainer: Any) -> None:
    """The folders the run writes, each one it can make and write here: the checkpoints' (saved, or looked in
    for one to resume: the trainer makes it), the logs' (jsonl, tensorboard) and a supervised stage's exported
    model (written after the last step: a run would otherwise train to the end and lose it)."""
    keys = []
    if int(trainer.save_freq) > 0 or trainer.resume_mode != "disable":
        keys.append("default_local_dir")
    logger = trainer.logger
    if {"jsonl", "tensorboard"} & set([logger] if isinstance(logger, str) else list(logger or [])):
        keys.append("log_dir")
    if "hf_output_dir" in trainer:
        keys.append("hf_output_dir")
    errors = ConfigErrors()
    for key in keys:
        errors.run(check_output_dir, trainer[key], f"trainer.{key}")
    errors.raise_any()


def check_output_dir(path: Any, key: str) -> None:
    """`path` is a folder, or one this process can make: its missing part is made (and removed) inside a
    temporary folder of its nearest existing parent, which tries permissions, read-only file systems and the
    names themselves without leaving anything behind."""
    folder = Path(str(path)).expanduser().absolute()
    parent = folder
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{key}={path}: {parent} is a file, not a folder, so the run cannot make its folder there; "
                          f"point {key} elsewhere")
    try:
        probe = Path(tempfile.mkdtemp(prefix=".hflow_write_probe_", dir=parent))
    except OSError as err:
        raise ConfigError(f"{key}={path}: the run cannot write in {parent} ({err.strerror or err}); point {key} at "
                          "a folder this user can write") from None
    try:
        if folder != parent:
            (probe / folder.relative_to(parent)).mkdir(parents=True)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{key}={path}: the folder cannot be made in {parent} ({getattr(err, 'strerror', None) or err}); "
                          f"point {key} at a folder this user can write") from None
    finally:
        shutil.rmtree(probe, ignore_errors=True)


def check_ray_init(ray_init: Any) -> None:
    if ray_init.num_cpus is not None:
        check_positive(ray_init.num_cpus, "ray_init.num_cpus")


def check_resume(trainer: Any) -> None:
    """`trainer.resume_mode`, and with `resume_path` a checkpoint folder that exists."""
    check_choice(trainer.resume_mode, RESUME_MODES, "trainer.resume_mode")
    if trainer.resume_mode != "resume_path":
        return
    path = trainer.resume_from_path
    folder = Path(str(path)).expanduser()
    if path is None:
        problem = "it is not set"
    elif not folder.is_dir():
        problem = "no such folder"
    elif not folder.name.startswith("global_step_"):
        problem = "not a global_step_N folder"
    elif not (folder / "data" / "state.pt").is_file():
        problem = "an incomplete checkpoint: it has no data/state.pt"
    else:
        return
    raise ConfigError(f"trainer.resume_mode=resume_path needs trainer.resume_from_path to be a global_step_N "
                      f"checkpoint folder, got {path} ({problem}); give one under trainer.default_local_dir, or set "
                      "trainer.resume_mode=auto")


def check_reward_audit(trainer: Any) -> None:
    if not 0 <= float(trainer.reward_audit_max_accept) <= 1:
        raise ConfigError(f"trainer.reward_audit_max_accept must be in [0, 1], got {trainer.reward_audit_max_accept}")


def check_memory_plan_keys(trainer: Any) -> None:
    """`trainer.memory_plan` and `trainer.device_memory_gb` (the plan itself: preflight's `check_memory`)."""
    check_choice(trainer.memory_plan, MEMORY_PLAN_MODES, "trainer.memory_plan")
    if trainer.device_memory_gb is not None and not float(trainer.device_memory_gb) > 0:
        raise ConfigError(f"trainer.device_memory_gb must be > 0 (GiB of one device) or null, "
                          f"got {trainer.device_memory_gb}")


def reuses_update_log_probs(config: Any) -> bool:
    """Whether the actor update takes its own detached log-probs as the old ones (no separate pass).

    `algorithm.reuse_update_log_probs` true / false decides; null (the default) reuses them wherever that
    is exact: one on-policy update per step (ppo_epochs 1, one mini-batch) whose old log-probs nothing
    needs before the update (no KL in the reward, no rollout correction, no distillation teacher, no sampler
    log-probs in their place) and whose sampler is the current policy (trainer.async_steps 0)."""
    algo, actor = config.algorithm, config.actor_rollout_ref.actor
    if algo.reuse_update_log_probs is not None:
        return bool(algo.reuse_update_log_probs)
    return (int(actor.ppo_epochs) == 1 and int(actor.ppo_mini_batch_size) == int(config.data.train_batch_size)
            and not algo.use_kl_in_reward and algo.rollout_is is None and not rollout_mask_on(algo)
            and not algo.use_rollout_log_probs and not uses_teacher(config)
            and int(config.trainer.async_steps) == 0)


def placement_pools(nnodes: int, n_gpus_per_node: int, placement: str, rollout_n_gpus: int) -> tuple[list[int], list[int]]:
    """Devices per node of the training pool and of the rollout pool (`[]` when colocated).

    With `split` the rollout pool takes `rollout_n_gpus` devices from the last nodes, so the training
    pool keeps whole nodes first (its FSDP collectives are the heaviest traffic).
    """
    nodes = [int(n_gpus_per_node)] * int(nnodes)
    if placement == "colocate":
        return nodes, []
    total = sum(nodes)
    if total < 2:
        raise ConfigError(f"trainer.placement=split needs at least 2 devices, one to train and one to generate, "
                          f"but {WORLD_KEYS} = {total}; use trainer.placement=colocate")
    if not 1 <= rollout_n_gpus < total:
        raise ConfigError(
            f"trainer.placement=split gives trainer.rollout_n_gpus={rollout_n_gpus} of the {total} devices "
            f"({WORLD_KEYS}) to generation; it must be between 1 and {total - 1}, so that training keeps at "
            "least one (or use trainer.placement=colocate)")
    rollout, left = [], rollout_n_gpus
    for index in reversed(range(len(nodes))):
        take = min(nodes[index], left)
        if take:
            rollout.insert(0, take)
            nodes[index] -= take
            left -= take
    return [n for n in nodes if n], rollout


def check_placement(trainer: Any, rollout_name: str, tp: int, batch_prompts: int, n: int) -> tuple[int, int]:
    """`trainer.placement`, `.rollout_n_gpus` and `.async_steps`; returns (training ranks, rollout ranks)."""
    check_choice(trainer.placement, PLACEMENTS, "trainer.placement")
    if int(trainer.async_steps) < 0:
        raise ConfigError(f"trainer.async_steps must be >= 0 (0 = synchronous), got {trainer.async_steps}")
    if int(trainer.async_steps) and trainer.placement != "split":
        raise ConfigError(f"trainer.async_steps={trainer.async_steps} generates later batches while this one trains, "
                          "which needs devices of its own for generation: set trainer.placement=split")
    if trainer.placement == "split":
        if trainer.backend != "ray":
            raise ConfigError("trainer.placement=split runs two pools of worker processes: it needs trainer.backend=ray")
        if rollout_name != "vllm":
            raise ConfigError(f"trainer.placement=split runs standalone vLLM engines; actor_rollout_ref.rollout.name="
                              f"{rollout_name!r} only works colocated (trainer.placement=colocate)")
    train_nodes, rollout_nodes = placement_pools(int(trainer.nnodes), int(trainer.n_gpus_per_node),
                                                 trainer.placement, int(trainer.rollout_n_gpus))
    if trainer.placement == "colocate":
        return sum(train_nodes), sum(train_nodes)
    training, rollout = sum(train_nodes), sum(rollout_nodes)
    if rollout % tp:
        raise ConfigError(f"actor_rollout_ref.rollout.tensor_model_parallel_size ({tp}) must divide the rollout "
                          f"pool's trainer.rollout_n_gpus ({rollout})")
    if batch_prompts % (rollout // tp):
        raise ConfigError(f"data.train_batch_size ({batch_prompts}) prompts cannot be split evenly over the "
                          f"{rollout // tp} vLLM engines of the rollout pool (trainer.rollout_n_gpus / "
                          "actor_rollout_ref.rollout.tensor_model_parallel_size)")
    if batch_prompts * n % training:
        raise ConfigError(
            f"data.train_batch_size ({batch_prompts}) x actor_rollout_ref.rollout.n ({n}) = {batch_prompts * n} "
            f"sequences cannot be split evenly over the training pool's {training} ranks "
            f"({WORLD_KEYS} - trainer.rollout_n_gpus with trainer.placement=split)")
    return training, rollout
