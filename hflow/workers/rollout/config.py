"""`actor_rollout_ref.rollout`: the rollout engine's section (typed defaults; comments in
`config/ppo_trainer.yaml`), with its `engine_kwargs` and `val_kwargs`, and its rules. The agent loop's
`multi_turn` subsection is `hflow.agent.config`'s."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from hflow.agent.config import MultiTurnConfig
from hflow.config_schema import (
    WORLD_KEYS,
    ConfigError,
    ConfigErrors,
    check_choice,
    check_fraction,
    check_non_negative,
    check_positive,
    ref,
)

PREFIX = "actor_rollout_ref.rollout"
ROLLOUT_NAMES = ("vllm", "hf")
ADMISSIONS = ("static", "continuous")


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
    enable_chunked_prefill: Optional[bool] = None  # None = on where a whole sequence exceeds max_num_batched_tokens
    enable_prefix_caching: bool = True
    free_cache_engine: bool = True
    load_format: str = "dummy"
    seed: int = 0
    calculate_log_probs: bool = True
    partial_rollout: bool = False  # split: a weight update stops the requests in flight, which continue with the new weights
    admission: str = "static"  # static: a fixed shard per engine; continuous: rows routed to the least-loaded engine
    weight_bucket_mb: Optional[float] = None  # MiB of full tensors per gather (colocated) and per broadcast (split); None = by device
    micro_batch_size: Optional[int] = None  # HF rollout: prompts per generate call; None = all
    log_prob_micro_batch_size_per_gpu: int = 16
    log_prob_use_dynamic_bsz: Optional[bool] = ref("actor_rollout_ref.actor.use_dynamic_bsz")
    log_prob_max_token_len_per_gpu: Optional[int] = ref("actor_rollout_ref.actor.ppo_max_token_len_per_gpu")
    engine_kwargs: EngineKwargsConfig = field(default_factory=EngineKwargsConfig)
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)


def engine_section(**overrides: Any) -> DictConfig:
    """A rollout section for an engine of its own, outside `actor_rollout_ref` (the generative judge's): the
    defaults with `overrides` set. `prompt_length` and `response_length` must be among them; the log-prob
    keys, which follow the actor's, stay unresolved (such an engine computes no log-probs for training)."""
    section = OmegaConf.structured(RolloutConfig)
    for name, value in overrides.items():
        OmegaConf.update(section, name, value, merge=True)
    return section


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


def check_tensor_parallel(tp: int, world_size: int) -> None:
    """vLLM tensor-parallel groups are consecutive ranks: their size must divide the number of ranks."""
    if tp < 1 or world_size % tp:
        raise ConfigError(
            f"{PREFIX}.tensor_model_parallel_size ({tp}) must divide the number of ranks "
            f"({world_size}, {WORLD_KEYS})")


def check_sampling(rollout: Any) -> None:
    """Sampling that the engine can do: a temperature > 0 wherever it samples, top_p in (0, 1], top_k -1
    (off) or a count; all of their errors together."""
    errors = ConfigErrors()
    with errors.catch():
        if rollout.val_kwargs.do_sample and float(rollout.val_kwargs.temperature) <= 0:
            raise ConfigError(f"{PREFIX}.val_kwargs.do_sample=true needs val_kwargs.temperature > 0")
    with errors.catch():
        if float(rollout.temperature) <= 0 and rollout.do_sample:
            raise ConfigError(f"{PREFIX}.temperature must be > 0 for sampling "
                              "(set rollout.do_sample=false for greedy)")
    for section, prefix in ((rollout, PREFIX), (rollout.val_kwargs, f"{PREFIX}.val_kwargs")):
        errors.run(check_non_negative, section.temperature, f"{prefix}.temperature", "0: greedy")
        errors.run(check_fraction, section.top_p, f"{prefix}.top_p", "the nucleus' probability mass; 1: off",
                   zero_ok=False)
        with errors.catch():
            if int(section.top_k) < -1:
                raise ConfigError(f"{prefix}.top_k must be -1 (off) or a number of tokens >= 1, got {section.top_k}")
    with errors.catch():
        if rollout.kv_cache_memory_bytes is not None:
            check_positive(rollout.kv_cache_memory_bytes, f"{PREFIX}.kv_cache_memory_bytes")
    errors.raise_any()


def check_rollout_name(name: str) -> None:
    check_choice(name, ROLLOUT_NAMES, f"{PREFIX}.name")


def check_admission(rollout: Any) -> None:
    """`rollout.admission`: continuous admission routes single requests to vLLM engines of one rank each."""
    check_choice(rollout.admission, ADMISSIONS, f"{PREFIX}.admission")
    if rollout.admission == "continuous" and (rollout.name != "vllm" or int(rollout.tensor_model_parallel_size) != 1):
        raise ConfigError(f"{PREFIX}.admission=continuous needs rollout.name=vllm and tensor_model_parallel_size=1 "
                          f"(got {rollout.name}, {rollout.tensor_model_parallel_size}); set admission=static")


def check_endpoint_rollout(rollout: Any) -> None:
    """`multi_turn.endpoint`: the agent endpoint runs on a vLLM engine of one rank, sharded statically."""
    endpoint = rollout.multi_turn.endpoint
    if not endpoint.enable:
        return
    key = f"{PREFIX}.multi_turn.endpoint.enable"
    if not rollout.multi_turn.enable:
        raise ConfigError(f"{key}=true runs agent episodes; set {PREFIX}.multi_turn.enable=true as well")
    if rollout.name != "vllm" or int(rollout.tensor_model_parallel_size) != 1 or rollout.admission != "static":
        raise ConfigError(f"{key}=true needs rollout.name=vllm, tensor_model_parallel_size=1 and admission=static (got "
                          f"{rollout.name}, {rollout.tensor_model_parallel_size}, {rollout.admission})")


# `rollout.weight_bucket_mb` when null: GPU-sized on CUDA (verl's default is 2 GiB; one bucket of full tensors
# then sits beside the engine while its weights load, two in flight on the weight stream), and on CPU the size
# measured there (bench/results/weight_buckets.md).
WEIGHT_BUCKET_MB = {"cuda": 1024.0, "cpu": 16.0}


def check_weight_bucket(rollout: Any) -> None:
    """`rollout.weight_bucket_mb`: a size > 0 in MiB, or null (by device: `WEIGHT_BUCKET_MB`)."""
    if rollout.weight_bucket_mb is not None and not float(rollout.weight_bucket_mb) > 0:
        raise ConfigError(f"{PREFIX}.weight_bucket_mb must be > 0 MiB (the weight sync's bucket; a tensor larger "
                          f"than it goes alone) or null (by device), got {rollout.weight_bucket_mb}")
