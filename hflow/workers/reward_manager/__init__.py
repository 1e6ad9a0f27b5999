"""Reward managers: turn generated responses into token-level scores (see `NaiveRewardManager`)."""

from hflow.workers.reward_manager.loader import get_custom_reward_fn, load_reward_manager
from hflow.workers.reward_manager.naive import NaiveRewardManager, RewardFunctionError
from hflow.workers.reward_manager.registry import get_reward_manager_cls, register

__all__ = [
    "NaiveRewardManager",
    "RewardFunctionError",
    "get_custom_reward_fn",
    "get_reward_manager_cls",
    "load_reward_manager",
    "register",
]
