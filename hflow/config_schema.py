"""The one typed source of the configuration: every key's type and default, and every rule about them.

`config/ppo_trainer.yaml` is the file users read and override (it keeps the comments); the dataclasses
below mirror it key for key and default for default, which `tests/test_config_schema.py` checks in both
directions. `main_ppo` composes the YAML with Hydra and then passes it through `validate_config` once, so
a typo in a key or a value of the wrong type stops the run with a `ConfigError` naming the key, and every
later reader may rely on every key being present (plain attribute access, no `.get(key, default)`).

Keys whose default is another key (`${...}`) keep the interpolation here too. Free-form maps
(`override_config`, `engine_kwargs.vllm`, `reward_kwargs`, ...) are dicts that accept any key.

The second half holds the rules that more than one place applies (batch sizes against the number of
ranks, tensor parallelism, the names the algorithms know): one function each, called by the trainer's
preflight and by the workers alike.

This module sits at the bottom of the house: it imports only `hflow.algorithms` and `hflow.utils`.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from hflow.algorithms import core_algos
from hflow.sandbox.config import SandboxConfig
from hflow.utils.errors import ConfigError

__all__ = [
    "ConfigError",
    "PPOTrainerConfig",
    "RMTrainerConfig",
    "SCHEMAS",
    "SFTTrainerConfig",
    "default_config",
    "default_section",
    "validate_config",
    "check_override_key",
    "KL_TYPES",
    "LOSS_AGG_MODES",
    "ROLLOUT_NAMES",
    "check_choice",
    "check_positive",
    "check_train_batch",
    "check_mini_batch",
    "per_rank_mini_batch",
    "check_micro_batch",
    "check_tensor_parallel",
    "check_offload",
    "check_optim",
]


def ref(key: str) -> Any:
    """A default that is the value of another key (an OmegaConf interpolation)."""
    return "${" + key + "}"


# ==================================================================================================
# The schema (same order and names as config/ppo_trainer.yaml; comments there)
# ==================================================================================================


@dataclass
class DataConfig:
    train_files: Any = None  # a parquet file or a list of them; None = the built-in task
    val_files: Any = None
    prompt_key: str = "prompt"
    reward_fn_key: str = "data_source"
    max_prompt_length: int = 128
    max_response_length: int = 64
    train_batch_size: int = 32  # prompts per training step
    val_batch_size: Optional[int] = None
    truncation: str = "error"
    filter_overlong_prompts: bool = True
    return_raw_chat: bool = False
    shuffle: bool = True
    seed: int = 1
    dataloader_num_workers: int = 0
    chat_template: Optional[str] = None
    ptx_files: Any = None  # PPO-ptx pre-training text: a parquet file or a list of them
    ptx_text_key: str = "text"


@dataclass
class ModelConfig:
    path: Optional[str] = None
    tokenizer_path: Optional[str] = None
    override_config: dict[str, Any] = field(default_factory=dict)
    enable_gradient_checkpointing: bool = False
    trust_remote_code: bool = False
    attn_implementation: Optional[str] = None
    use_remove_padding: bool = False  # actor/ref forwards on the valid tokens packed into one row
    lora_rank: int = 0  # LoRA (PEFT) adapters of this rank on the actor; 0 = train every weight
    lora_alpha: float = 16.0  # LoRA scaling is lora_alpha / lora_rank
    target_modules: Any = "all-linear"  # the linears that get adapters: "all-linear" or a list of module names


@dataclass
class PolicyLossConfig:
    loss_mode: str = "vanilla"


@dataclass
class CheckpointConfig:
    contents: list[str] = field(default_factory=lambda: ["model", "optimizer", "extra"])


@dataclass
class OptimConfig:
    lr: float = 1.0e-6
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 0.01
    lr_warmup_steps: int = -1  # negative = lr_warmup_steps_ratio x total steps
    lr_warmup_steps_ratio: float = 0.0
    warmup_style: str = "constant"
    min_lr_ratio: float = 0.0
    num_cycles: float = 0.5
    total_training_steps: int = -1  # filled in by the trainer


@dataclass
class FSDPConfig:
    param_offload: bool = False
    optimizer_offload: bool = False
    offload_policy: bool = False
    reshard_after_forward: bool = True
    gather_once_per_pass: Optional[bool] = None  # None = by model size and device memory
    model_dtype: Optional[str] = None
    mixed_precision: Optional[dict[str, Any]] = None


@dataclass
class PtxConfig:
    coef: float = 0.0  # PPO-ptx weight of the pre-training LM loss; 0 = off
    files: Any = ref("data.ptx_files")
    text_key: str = ref("data.ptx_text_key")
    batch_size_per_gpu: int = 8  # texts each rank adds to every optimizer step
    micro_batch_size_per_gpu: int = 8  # texts per forward/backward
    max_length: int = 512  # tokens per text
    seed: int = ref("data.seed")


@dataclass
class EMAConfig:
    enable: bool = False  # an EMA of the actor's weights, checkpointed and exported
    decay: float = 0.992


@dataclass
class ActorConfig:
    strategy: str = "fsdp2"
    ppo_mini_batch_size: int = 16  # prompts per optimizer step (global)
    ppo_micro_batch_size_per_gpu: int = 8  # sequences per forward/backward on one device
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    ppo_epochs: int = 1
    shuffle: bool = True
    grad_clip: float = 1.0
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None
    clip_ratio_high: Optional[float] = None
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    ptx: PtxConfig = field(default_factory=PtxConfig)
    ema: EMAConfig = field(default_factory=EMAConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class RefFSDPConfig:
    param_offload: bool = False
    offload_policy: bool = False
    reshard_after_forward: bool = True
    gather_once_per_pass: Optional[bool] = None  # None = by model size and device memory


@dataclass
class RefConfig:
    log_prob_micro_batch_size_per_gpu: int = 16
    log_prob_use_dynamic_bsz: bool = ref("actor_rollout_ref.actor.use_dynamic_bsz")
    log_prob_max_token_len_per_gpu: int = ref("actor_rollout_ref.actor.ppo_max_token_len_per_gpu")
    fsdp_config: RefFSDPConfig = field(default_factory=RefFSDPConfig)


@dataclass
class EngineKwargsConfig:
    vllm: dict[str, Any] = field(default_factory=dict)  # extra vllm.LLM(...) arguments


@dataclass
class ValKwargsConfig:
    n: int = 1
    do_sample: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1


@dataclass
class MultiTurnConfig:
    """Agent rollouts: assistant turns and tool results in one episode (`hflow.agent`)."""

    enable: bool = False
    max_assistant_turns: Optional[int] = None  # None = until the response budget is spent
    max_user_turns: Optional[int] = None  # tool-result turns; None = no limit
    max_parallel_calls: int = 1  # tool calls run per assistant turn (more get an error result)
    max_tool_response_length: Optional[int] = 256  # characters of a tool result the model sees
    tool_response_truncate_side: str = "middle"  # left | right | middle
    tool_config_path: Optional[str] = None  # None = the built-in calculator
    format: str = "hermes"  # tool-call parser (hflow.agent.parsers.register_parser adds others)
    tool_timeout_s: float = 30.0  # per call; a call past it returns an error result to the model
    max_concurrent_tools: int = 64  # tool calls running at once per rollout rank


@dataclass
class RolloutConfig:
    name: str = "vllm"
    n: int = 1  # samples per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    do_sample: bool = True
    ignore_eos: bool = False
    prompt_length: int = ref("data.max_prompt_length")
    response_length: int = ref("data.max_response_length")
    dtype: Optional[str] = None  # None = bfloat16 on GPU (float16 before Ampere), float32 on CPU (the worker decides)
    tensor_model_parallel_size: int = 1
    gpu_memory_utilization: Optional[float] = None  # None = 0.5 colocated, 0.9 on devices of its own
    kv_cache_memory_bytes: Optional[int] = None
    max_model_len: Optional[int] = None  # None = prompt_length + response_length
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    enforce_eager: Optional[bool] = None
    enable_chunked_prefill: bool = False
    enable_prefix_caching: bool = True
    free_cache_engine: bool = True
    load_format: str = "dummy"
    seed: int = 0
    calculate_log_probs: bool = True
    partial_rollout: bool = False  # split: a weight update stops the requests in flight, which continue with the new weights
    micro_batch_size: Optional[int] = None  # HF rollout: prompts per generate call; None = all
    log_prob_micro_batch_size_per_gpu: int = 16
    log_prob_use_dynamic_bsz: bool = ref("actor_rollout_ref.actor.use_dynamic_bsz")
    log_prob_max_token_len_per_gpu: int = ref("actor_rollout_ref.actor.ppo_max_token_len_per_gpu")
    engine_kwargs: EngineKwargsConfig = field(default_factory=EngineKwargsConfig)
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)


@dataclass
class ActorRolloutRefConfig:
    hybrid_engine: bool = True
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)


@dataclass
class CriticModelConfig:
    path: Optional[str] = ref("actor_rollout_ref.model.path")
    tokenizer_path: Optional[str] = ref("actor_rollout_ref.model.path")
    override_config: dict[str, Any] = field(default_factory=dict)
    enable_gradient_checkpointing: bool = False
    trust_remote_code: bool = ref("actor_rollout_ref.model.trust_remote_code")
    value_head_init: str = "zero"  # zero | normal; unused when path is a reward model's folder
    use_remove_padding: bool = False  # critic forwards on the valid tokens packed into one row
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
    use_dynamic_bsz: bool = ref("actor_rollout_ref.actor.use_dynamic_bsz")
    ppo_max_token_len_per_gpu: int = 32768
    forward_max_token_len_per_gpu: int = ref("critic.ppo_max_token_len_per_gpu")
    ppo_epochs: int = ref("actor_rollout_ref.actor.ppo_epochs")
    shuffle: bool = ref("actor_rollout_ref.actor.shuffle")
    grad_clip: float = 1.0
    cliprange_value: float = 0.5
    loss_agg_mode: str = ref("actor_rollout_ref.actor.loss_agg_mode")
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    optim: CriticOptimConfig = field(default_factory=CriticOptimConfig)


@dataclass
class RewardModelFSDPConfig:
    param_offload: bool = False
    reshard_after_forward: bool = True
    gather_once_per_pass: Optional[bool] = None  # None = by model size and device memory


@dataclass
class RewardModelModelConfig:
    path: Optional[str] = None
    input_tokenizer: Optional[str] = ref("actor_rollout_ref.model.path")
    trust_remote_code: bool = False
    fsdp_config: RewardModelFSDPConfig = field(default_factory=RewardModelFSDPConfig)


@dataclass
class RewardNormalizeConfig:
    enable: bool = False  # gain and bias fitted before training: reward-model scores get mean 0, std 1
    num_prompts: int = 64  # training prompts sampled (one response each) to fit them


@dataclass
class OverlongBufferConfig:
    enable: Optional[bool] = None  # DAPO soft overlong punishment (training only); None = on for reward_manager=dapo
    len: Optional[int] = None  # the buffer's tokens before data.max_response_length; null = a fifth of it
    penalty_factor: float = 1.0  # the penalty at data.max_response_length


@dataclass
class JudgeConfig:
    prompt_template: Optional[str] = None  # {question} {response} {reference}; None = built-in per parser
    parser: str = "yes_no"  # yes_no | number
    yes_word: str = "yes"
    no_word: str = "no"
    score_min: float = 0.0
    score_max: float = 10.0
    max_prompt_length: int = 1024
    max_new_tokens: int = 16
    dtype: str = "auto"
    gpu_memory_utilization: float = 0.2
    free_cache_engine: bool = True
    engine_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class RewardModelConfig:
    enable: bool = False
    style: str = "discriminative"  # discriminative | generative
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)
    micro_batch_size_per_gpu: int = 16
    max_length: Optional[int] = None
    reward_manager: str = "naive"
    normalize: RewardNormalizeConfig = field(default_factory=RewardNormalizeConfig)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)


@dataclass
class CustomRewardFunctionConfig:
    path: Optional[str] = None
    name: str = "compute_score"
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    timeout_s: Optional[float] = 30  # None: call the function in the driver, no limit (debugging, seeded controls)
    on_error: str = "raise"  # raise | zero
    url: Optional[str] = None  # a remote scorer (hflow.reward.managers.remote) instead of path
    max_concurrency: int = 8  # remote: requests in flight at once
    batch_size: int = 32  # remote: samples per request
    request_timeout_s: float = 60  # remote: one request's limit (a timed-out request is retried)
    max_retries: int = 3  # remote: retries after a connection error, a timeout or a 5xx (never after a 4xx)


@dataclass
class KLControlConfig:
    type: str = "fixed"
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


@dataclass
class FilterGroupsConfig:
    enable: bool = False  # DAPO dynamic sampling: drop prompt groups whose samples all score the same
    metric: str = "score"  # score (sequence score) or a per-sample key the reward function returns (e.g. acc)
    max_num_gen_batches: int = 10  # generation batches per step before giving up; 0 = no limit


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "gae"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_rollout_log_probs: bool = False
    reuse_update_log_probs: Optional[bool] = None  # None = wherever it is exact (reuses_update_log_probs)
    rollout_check_freq: int = 10  # with reused log-probs: the separate pass (and its checks) every N steps
    rollout_is: Optional[str] = None  # token | sequence: truncated IS weights pi_old / pi_rollout on the pg loss
    rollout_is_threshold: float = 2.0  # C, the truncation of those weights
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    reward_clip: Optional[float] = None  # clip each sequence's score to [-c, c] before the KL penalty
    stop_token: Optional[str] = None  # the reward sees each response cut after this (one-token) text
    missing_stop_penalty: Optional[float] = None  # the score of a response without stop_token
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)


@dataclass
class HealthConfig:
    """The health watch (trainer.health): detectors on each step's metrics; on a trigger the trainer
    restores the last healthy state and applies `remedy`."""

    enable: bool = False
    window: int = 20  # steps of history for the gradient-norm z-score
    grad_norm_zscore: Optional[float] = 6.0  # trigger above mean + z * std of the window's grad norms
    entropy_min: Optional[float] = None  # trigger when actor/entropy falls below
    ppo_kl_max: Optional[float] = None  # trigger when |actor/ppo_kl| exceeds
    rollout_probs_diff_max: Optional[float] = None  # trigger when training/rollout_probs_diff_max exceeds
    max_length_frac: Optional[float] = None  # trigger when this share of responses ends at the length limit
    zero_adv_group_frac: Optional[float] = None  # trigger when this share of groups has zero advantage
    remedy: str = "skip"  # skip | lr_scale | tighten_clip | stop
    lr_scale: float = 0.5  # remedy lr_scale: multiply the learning rate by this on each rollback
    clip_scale: float = 0.5  # remedy tighten_clip: multiply clip_ratio (low, high) by this on each rollback
    max_rollbacks: int = 3  # stop (health_report.json) at the next trigger after this many rollbacks in a row
    snapshot: str = "memory"  # memory: keep the last healthy state in host memory | checkpoint: the last saved one
    inject: list = field(default_factory=list)  # fault injection to test the watch: [{step, kind, value}]


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
    memory_plan: str = "summary"  # off | summary | enforce (hflow.cli.memory_plan)
    device_memory_gb: Optional[float] = None  # memory of one device for the plan; None = the device's own
    health: HealthConfig = field(default_factory=HealthConfig)


@dataclass
class RayInitConfig:
    num_cpus: Optional[int] = None
    address: Optional[str] = None


@dataclass
class PPOTrainerConfig:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)  # where model-written code runs
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    ray_init: RayInitConfig = field(default_factory=RayInitConfig)


# ---- the supervised stages (config/sft_trainer.yaml, config/rm_trainer.yaml; comments there) ------


@dataclass
class StageDataConfig:
    train_files: Any = None  # None = the built-in RLHF task's data for the stage
    val_files: Any = None
    prompt_key: str = "prompt"
    max_length: int = 256  # tokens per sequence (prompt + response)
    truncation: str = "error"  # error | right (SFT) / left (reward model)
    train_batch_size: int = 32  # sequences (SFT) or preference groups (RM) per optimizer step, global
    micro_batch_size_per_gpu: int = 8
    val_batch_size: Optional[int] = None  # None = the whole validation set at once
    shuffle: bool = True
    seed: int = 1
    dataloader_num_workers: int = 0
    chat_template: Optional[str] = None


@dataclass
class SFTDataConfig(StageDataConfig):
    messages_key: str = "messages"
    response_key: str = "response"


@dataclass
class RMDataConfig(StageDataConfig):
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    responses_key: str = "responses"
    label_key: str = "label"


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
class _StageConfig:
    """What the supervised stages share; each adds its `data` and its `trainer` defaults."""

    model: StageModelConfig = field(default_factory=StageModelConfig)
    optim: StageOptimConfig = field(default_factory=StageOptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    ray_init: RayInitConfig = field(default_factory=RayInitConfig)


@dataclass
class SFTTrainerConfig(_StageConfig):
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    trainer: StageTrainerConfig = field(default_factory=lambda: StageTrainerConfig(experiment_name="sft"))


@dataclass
class RMTrainerConfig(_StageConfig):
    data: RMDataConfig = field(default_factory=RMDataConfig)
    trainer: StageTrainerConfig = field(default_factory=lambda: StageTrainerConfig(experiment_name="rm"))


SCHEMAS = {"ppo_trainer": PPOTrainerConfig, "sft_trainer": SFTTrainerConfig, "rm_trainer": RMTrainerConfig}


def default_config(schema: type = PPOTrainerConfig) -> DictConfig:
    """The whole configuration at its defaults: typed, every key present, unknown keys refused.
    Code that builds a config by hand (tests, benchmarks) starts here and sets what it needs. `schema`: the
    stage (`PPOTrainerConfig`, `SFTTrainerConfig`, `RMTrainerConfig`)."""
    return OmegaConf.structured(schema)


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
    `ConfigError` naming the first key that is unknown or holds a value of the wrong type.
    Interpolations stay unresolved."""
    try:
        return OmegaConf.merge(default_config(schema), config)
    except ConfigKeyError as err:
        raise _unknown_key(str(err.full_key), schema) from None
    except OmegaConfBaseException as err:
        reason = str(err.msg).splitlines()[0] if err.msg else type(err).__name__
        raise ConfigError(f"{err.full_key}: {reason}; give it a value of the type the key takes") from None


def check_override_key(full_key: str, schema: type = PPOTrainerConfig) -> None:
    """`full_key` of a command-line `key=value` is a key of the `schema`.

    Hydra refuses an unknown key itself, before hflow sees the configuration, with a message that
    names neither the key that was meant nor the keys that exist; this check comes first and does.
    """
    node: Any = default_config(schema)
    parts = full_key.split(".")
    for depth, part in enumerate(parts):
        if not isinstance(node, DictConfig):
            return  # below a list or a null section: Hydra and validate_config judge it
        if part not in node:
            if OmegaConf.get_type(node) is dict:  # a free-form map (reward_kwargs, override_config, ...)
                raise ConfigError(f"{full_key} is not set yet, so it cannot be overridden; add it with a "
                                  f"leading +: +{full_key}=...")
            raise _unknown_key(".".join(parts[:depth + 1]), schema)
        node = node[part]


def _unknown_key(full_key: str, schema: type) -> ConfigError:
    """The error for a key that `schema` lacks: the closest key of its section, and all of them."""
    parent, _, key = full_key.rpartition(".")
    section = OmegaConf.select(default_config(schema), parent) if parent else default_config(schema)
    known = list(section.keys()) if isinstance(section, DictConfig) else []
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean {parent + '.' if parent else ''}{close[0]}? " if close else ""
    return ConfigError(f"{full_key} is not a configuration key; {hint}the keys of "
                       f"{parent or 'the top level'} are: {', '.join(known)}")


# ==================================================================================================
# Rules: each written once, applied by preflight (before Ray) and by the workers (with their real size)
# ==================================================================================================

WORLD_KEYS = "trainer.n_gpus_per_node x trainer.nnodes"
LOSS_AGG_MODES = tuple(mode.value for mode in core_algos.LossAggMode)
KL_TYPES = core_algos.KL_PENALTY_NAMES  # each also with a trailing '+' (straight-through gradient)
ROLLOUT_NAMES = ("vllm", "hf")


def check_choice(value: Any, choices: Any, key: str) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not one of {list(choices)}")


def check_positive(value: Any, key: str) -> None:
    if value is None or int(value) <= 0:
        raise ConfigError(f"{key} must be a positive integer, got {value}")


WARMUP_STYLES = ("constant", "cosine")  # hflow.workers.fsdp.build_lr_scheduler


def check_optim(optim: Any, prefix: str) -> None:
    """An `optim` section that AdamW and the schedule accept (unchecked, a bad value fails in every worker
    after Ray started, as torch's "Invalid learning rate", or silently trains nothing at lr=0)."""
    if not float(optim.lr) > 0:
        raise ConfigError(f"{prefix}.lr must be > 0 (e.g. 1e-6), got {optim.lr}")
    betas = list(optim.betas)
    if len(betas) != 2 or not all(0.0 <= float(beta) < 1.0 for beta in betas):
        raise ConfigError(f"{prefix}.betas must be two numbers in [0, 1) (e.g. [0.9, 0.999]), got {betas}")
    if float(optim.weight_decay) < 0:
        raise ConfigError(f"{prefix}.weight_decay must be >= 0, got {optim.weight_decay}")
    check_choice(optim.warmup_style, WARMUP_STYLES, f"{prefix}.warmup_style")
    for key in ("lr_warmup_steps_ratio", "min_lr_ratio"):
        if not 0.0 <= float(optim[key]) <= 1.0:
            raise ConfigError(f"{prefix}.{key} must be in [0, 1], got {optim[key]}")


def check_train_batch(batch_prompts: int, n: int, world_size: int) -> None:
    """A training batch of `data.train_batch_size` prompts x `rollout.n` samples splits evenly over the ranks."""
    if batch_prompts < 1:
        raise ConfigError(f"data.train_batch_size must be >= 1, got {batch_prompts}")
    if batch_prompts * n % world_size:
        raise ConfigError(
            f"data.train_batch_size ({batch_prompts}) x actor_rollout_ref.rollout.n ({n}) = {batch_prompts * n} "
            f"sequences cannot be split evenly over {world_size} ranks ({WORLD_KEYS})")


def check_mini_batch(mini_batch_prompts: int, batch_prompts: int, prefix: str) -> None:
    """`<prefix>.ppo_mini_batch_size` prompts cut the training batch into whole mini-batches."""
    check_positive(mini_batch_prompts, f"{prefix}.ppo_mini_batch_size")  # before dividing by it
    if mini_batch_prompts > batch_prompts:
        raise ConfigError(
            f"{prefix}.ppo_mini_batch_size ({mini_batch_prompts}) is larger than data.train_batch_size "
            f"({batch_prompts}); it counts prompts of one batch")
    if batch_prompts % mini_batch_prompts:
        raise ConfigError(
            f"data.train_batch_size ({batch_prompts}) must be a multiple of {prefix}.ppo_mini_batch_size "
            f"({mini_batch_prompts})")


def per_rank_mini_batch(mini_batch_prompts: int, n: int, world_size: int, prefix: str, n_key: str) -> int:
    """Sequences per rank in one optimizer step: ppo_mini_batch_size x n / ranks."""
    if mini_batch_prompts is None or mini_batch_prompts <= 0:
        raise ConfigError(f"{prefix}.ppo_mini_batch_size must be a positive number of prompts, got {mini_batch_prompts}")
    sequences = mini_batch_prompts * n
    if sequences % world_size:
        raise ConfigError(
            f"{prefix}.ppo_mini_batch_size ({mini_batch_prompts}) x {n_key} ({n}) = {sequences} sequences "
            f"cannot be split evenly over {world_size} ranks ({WORLD_KEYS}); make it a multiple of {world_size}")
    return sequences // world_size


def check_micro_batch(per_rank_mini: int, micro: Any, prefix: str, key: str, use_dynamic_bsz: bool) -> None:
    """Micro-batches of `<prefix>.<key>` sequences cut the per-rank mini-batch evenly (unless cut by tokens)."""
    if use_dynamic_bsz:
        return
    if micro is None or int(micro) <= 0:
        raise ConfigError(f"{prefix}.{key} must be a positive number of sequences (or set {prefix}.use_dynamic_bsz)")
    if per_rank_mini % int(micro):
        raise ConfigError(
            f"{prefix}.{key} ({micro}) must divide the per-rank mini-batch of {per_rank_mini} sequences "
            f"({prefix}.ppo_mini_batch_size x rollout.n / ranks); change one of them")


PLACEMENTS = ("colocate", "split")


def reuses_update_log_probs(config: Any) -> bool:
    """Whether the actor update takes its own detached log-probs as the old ones (no separate pass).

    `algorithm.reuse_update_log_probs` true / false decides; null (the default) reuses them wherever that
    is exact: one on-policy update per step (ppo_epochs 1, one mini-batch) whose old log-probs nothing
    needs before the update (no KL in the reward, no rollout correction, no sampler log-probs in their
    place) and whose sampler is the current policy (trainer.async_steps 0)."""
    algo, actor = config.algorithm, config.actor_rollout_ref.actor
    if algo.reuse_update_log_probs is not None:
        return bool(algo.reuse_update_log_probs)
    return (int(actor.ppo_epochs) == 1 and int(actor.ppo_mini_batch_size) == int(config.data.train_batch_size)
            and not algo.use_kl_in_reward and algo.get("rollout_is") is None and not algo.use_rollout_log_probs
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


def check_tensor_parallel(tp: int, world_size: int) -> None:
    """vLLM tensor-parallel groups are consecutive ranks: their size must divide the number of ranks."""
    if tp < 1 or world_size % tp:
        raise ConfigError(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size ({tp}) must divide the number of ranks "
            f"({world_size}, {WORLD_KEYS})")


def check_offload(fsdp_config: Any, prefix: str) -> None:
    """`offload_policy` (FSDP2's CPUOffloadPolicy: shards, gradients and optimizer step stay on the host)
    excludes the per-phase switches, which move the same state to the device and back around each call."""
    if not fsdp_config.offload_policy:
        return
    clashing = [f"{prefix}.{key}" for key in ("param_offload", "optimizer_offload") if fsdp_config.get(key)]
    if clashing:
        raise ConfigError(
            f"{prefix}.offload_policy=true cannot be combined with {' and '.join(clashing)}=true: the policy "
            "already keeps that state on the host; set one of them to false")
