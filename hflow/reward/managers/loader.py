"""Build the reward function and reward manager that the config asks for."""

from __future__ import annotations

import inspect
from typing import Any

from omegaconf import DictConfig, OmegaConf

from hflow.utils.errors import UserError
from hflow.utils.user_code import FileFunction
from hflow.reward.managers.batch import BATCH_ARGUMENTS
from hflow.reward.managers.dapo import OverlongBuffer, overlong_buffer_enabled
from hflow.reward.managers.registry import get_reward_manager_cls
from hflow.reward.managers.remote import RemoteScorer

__all__ = ["check_reward_fn_signature", "get_custom_reward_fn", "get_remote_scorer", "load_reward_manager"]

# What the reward manager passes a rule-based function for every sample (`NaiveRewardManager`), beside
# `custom_reward_function.reward_kwargs`.
SCORE_ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")


class RewardSignatureError(UserError, TypeError):
    """A reward function that the reward manager cannot call with its arguments."""


def get_custom_reward_fn(config: DictConfig) -> FileFunction | None:
    """``custom_reward_function.name`` from the file ``custom_reward_function.path``, called with
    ``custom_reward_function.reward_kwargs`` added; None when no path is set. `config` is the whole
    configuration (build one by hand from `hflow.trainer.config.default_config()`).

    Errors: a missing file is a FileNotFoundError, a file that fails to import (syntax error, failing
    import) a RuntimeError, a missing function an AttributeError; each names the key and the file.
    """
    section = config.custom_reward_function
    if not section.path:
        return None
    kwargs = OmegaConf.to_container(section.reward_kwargs, resolve=True)
    return FileFunction(section.path, section.name, kwargs, config_key="custom_reward_function")


def check_reward_fn_signature(fn: FileFunction | None, manager: str = "naive") -> None:
    """`fn` can be called as the reward manager calls it: with the keyword arguments `SCORE_ARGUMENTS` (the
    ``batch`` manager: their lists, `BATCH_ARGUMENTS`) and its bound `reward_kwargs`. Unchecked, a function
    that cannot take them fails on the first sample, once Ray and the models have started. Other managers
    (a user's) call the function their own way: not checked."""
    if fn is None or manager not in ("naive", "dapo", "batch"):
        return
    try:
        signature = inspect.signature(fn.function)
    except (TypeError, ValueError):
        return  # a builtin or C function: its call will tell
    names = tuple(BATCH_ARGUMENTS) if manager == "batch" else SCORE_ARGUMENTS
    arguments = dict.fromkeys(names) | fn.kwargs
    try:
        signature.bind(**arguments)
    except TypeError as err:
        raise RewardSignatureError(
            f"{fn.config_key}.name={fn.name!r} in {fn.path} is {fn.name}{signature}, which cannot be called with "
            f"the keyword arguments {', '.join(arguments)} ({err}); define it as def {fn.name}({names[0]}, "
            f"{names[1]}, {names[2]}, {names[3]}=None, **kwargs)"
            + (" (reward_model.reward_manager=batch passes lists)" if manager == "batch" else "")) from None


def get_remote_scorer(config: DictConfig) -> RemoteScorer | None:
    """The remote scorer of ``custom_reward_function.url``; None when no URL is set."""
    section = config.custom_reward_function
    if not section.url:
        return None
    return RemoteScorer(section.url, max_concurrency=section.max_concurrency, batch_size=section.batch_size,
                        request_timeout_s=section.request_timeout_s, max_retries=section.max_retries,
                        reward_kwargs=OmegaConf.to_container(section.reward_kwargs, resolve=True))


def load_reward_manager(config: DictConfig, tokenizer: Any, num_examine: int, training: bool = True,
                        **reward_kwargs: Any) -> Any:
    """The ``reward_model.reward_manager`` class, scoring with the custom function if one is configured, or
    the remote scorer of ``custom_reward_function.url`` (else by data source, or the reward model's scores
    alone when it ran). A `training` manager gets DAPO's overlong buffer when it is on
    (`hflow.reward.managers.dapo.overlong_buffer_enabled`); a validation one never does."""
    manager_cls = get_reward_manager_cls(config.reward_model.reward_manager)
    section = config.custom_reward_function
    if training and overlong_buffer_enabled(config.reward_model):
        overlong = config.reward_model.overlong_buffer
        reward_kwargs["overlong_buffer"] = OverlongBuffer(
            int(config.data.max_response_length), overlong.len, float(overlong.penalty_factor))
    remote = get_remote_scorer(config)
    if remote is not None:
        reward_kwargs["remote"] = remote
    return manager_cls(
        tokenizer=tokenizer,
        num_examine=num_examine,
        compute_score=get_custom_reward_fn(config),
        reward_fn_key=config.data.reward_fn_key,
        timeout_s=section.timeout_s,
        on_error=section.on_error,
        **reward_kwargs,
    )
