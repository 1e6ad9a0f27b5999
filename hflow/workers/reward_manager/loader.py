"""Build the reward function and reward manager that the config asks for."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from hflow.utils.reward_score.runner import FileFunction
from hflow.workers.reward_manager.registry import get_reward_manager_cls

__all__ = ["get_custom_reward_fn", "load_reward_manager"]


def get_custom_reward_fn(config: DictConfig | Mapping) -> FileFunction | None:
    """``custom_reward_function.name`` from the file ``custom_reward_function.path``, called with
    ``custom_reward_function.reward_kwargs`` added; None when no path is set.

    Errors: a missing file is a FileNotFoundError, a file that fails to import (syntax error, failing
    import) a RuntimeError, a missing function an AttributeError; each names the key and the file.
    """
    section = _select(config, "custom_reward_function") or {}
    path = section.get("path")
    if not path:
        return None
    kwargs = section.get("reward_kwargs") or {}
    if isinstance(kwargs, DictConfig):
        kwargs = OmegaConf.to_container(kwargs, resolve=True)
    return FileFunction(path, section.get("name") or "compute_score", kwargs, config_key="custom_reward_function")


def load_reward_manager(config: DictConfig | Mapping, tokenizer: Any, num_examine: int, **reward_kwargs: Any) -> Any:
    """The ``reward_model.reward_manager`` class, scoring with the custom function if one is configured
    (else by data source, or the reward model's scores alone when it ran)."""
    manager_cls = get_reward_manager_cls(_select(config, "reward_model.reward_manager") or "naive")
    section = _select(config, "custom_reward_function") or {}
    return manager_cls(
        tokenizer=tokenizer,
        num_examine=num_examine,
        compute_score=get_custom_reward_fn(config),
        reward_fn_key=_select(config, "data.reward_fn_key") or "data_source",
        timeout_s=section.get("timeout_s", 30.0),
        on_error=section.get("on_error", "raise"),
        **reward_kwargs,
    )


def _select(config: DictConfig | Mapping, key: str) -> Any:
    if not isinstance(config, DictConfig):
        config = OmegaConf.create(dict(config))
    return OmegaConf.select(config, key, default=None)
