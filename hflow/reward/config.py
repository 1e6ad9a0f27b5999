"""The reward's config sections: `reward_model` (the discriminative model or the generative judge, the
normalisation of its scores, DAPO's overlong buffer) and `custom_reward_function` (a scoring function of
the user's, local or remote). Typed defaults here; comments in `config/ppo_trainer.yaml`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hflow.config_schema import (
    ConfigError,
    ConfigErrors,
    check_choice,
    check_fraction,
    check_non_negative,
    check_positive,
    ref,
)


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


ON_ERROR = ("raise", "zero")


def check_custom_reward_path(custom: Any) -> None:
    """`custom_reward_function.path`, when set, is a file (it is imported next, before any model)."""
    if custom.path is not None and not Path(str(custom.path)).expanduser().is_file():
        raise ConfigError(f"custom_reward_function.path: file {custom.path} does not exist")


def check_custom_reward_on_error(custom: Any) -> None:
    check_choice(custom.on_error, ON_ERROR, "custom_reward_function.on_error")


def check_custom_reward_settings(custom: Any) -> None:
    """`custom_reward_function`'s numbers in range (the remote scorer's too, whether or not .url is set yet):
    all of their errors together."""
    key = "custom_reward_function"
    errors = ConfigErrors()
    with errors.catch():
        if custom.timeout_s is not None and not float(custom.timeout_s) > 0:
            raise ConfigError(f"{key}.timeout_s={custom.timeout_s}; give a positive number of seconds, or null for "
                              "no limit")
    for name, least in (("max_concurrency", 1), ("batch_size", 1), ("max_retries", 0)):
        with errors.catch():
            if int(custom[name]) < least:
                raise ConfigError(f"{key}.{name}={custom[name]}; it must be >= {least}")
    with errors.catch():
        if not float(custom.request_timeout_s) > 0:
            raise ConfigError(f"{key}.request_timeout_s={custom.request_timeout_s}; give a positive number")
    errors.raise_any()


def check_reward_model_settings(reward_model: Any) -> None:
    """`reward_model`'s numbers in range: the judge's lengths and memory share (with style=generative), the
    overlong buffer's penalty (its length: `check_dapo_config`); all of their errors together."""
    errors = ConfigErrors()
    if reward_model.enable and str(reward_model.style) == "generative":
        judge, key = reward_model.judge, "reward_model.judge"
        errors.run(check_positive, judge.max_prompt_length, f"{key}.max_prompt_length")
        errors.run(check_positive, judge.max_new_tokens, f"{key}.max_new_tokens")
        errors.run(check_fraction, judge.gpu_memory_utilization, f"{key}.gpu_memory_utilization",
                   "a share of each device's memory", zero_ok=False)
    errors.run(check_non_negative, reward_model.overlong_buffer.penalty_factor,
               "reward_model.overlong_buffer.penalty_factor", "the penalty at data.max_response_length; 0: none")
    errors.raise_any()


def check_reward_normalize(reward_model: Any) -> None:
    """`reward_model.normalize`: only with a reward model, fitted on at least two prompts."""
    normalize = reward_model.normalize
    if not normalize.enable:
        return
    if not reward_model.enable:
        raise ConfigError("reward_model.normalize.enable=true normalises the reward model's scores, but "
                          "reward_model.enable=false; enable the reward model or set reward_model.normalize.enable=false")
    if int(normalize.num_prompts) < 2:
        raise ConfigError(f"reward_model.normalize.num_prompts must be >= 2 (a std needs two samples), "
                          f"got {normalize.num_prompts}")
