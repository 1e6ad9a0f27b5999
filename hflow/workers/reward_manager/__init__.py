"""Reward managers: turn generated responses into token-level scores (``reward_model.reward_manager``:
naive, batch, dapo, or one a user registers); `RemoteScorer` scores over HTTP (``custom_reward_function.url``)."""

from hflow.workers.reward_manager.batch import BatchRewardManager
from hflow.workers.reward_manager.dapo import DAPORewardManager, OverlongBuffer
from hflow.workers.reward_manager.loader import get_custom_reward_fn, load_reward_manager
from hflow.workers.reward_manager.naive import NaiveRewardManager, RewardFunctionError
from hflow.workers.reward_manager.registry import get_reward_manager_cls, register
from hflow.workers.reward_manager.remote import RemoteScorer

__all__ = [
    "BatchRewardManager",
    "DAPORewardManager",
    "NaiveRewardManager",
    "OverlongBuffer",
    "RemoteScorer",
    "RewardFunctionError",
    "get_custom_reward_fn",
    "get_reward_manager_cls",
    "load_reward_manager",
    "register",
]
