"""Reward managers: turn generated responses into token-level scores (``reward_model.reward_manager``:
naive, batch, dapo, or one a user registers); `RemoteScorer` scores over HTTP (``custom_reward_function.url``)."""

from hflow.reward.managers.batch import BatchRewardManager
from hflow.reward.managers.dapo import DAPORewardManager, OverlongBuffer
from hflow.reward.managers.loader import get_custom_reward_fn, load_reward_manager
from hflow.reward.managers.naive import NaiveRewardManager, RewardFunctionError
from hflow.reward.managers.registry import get_reward_manager_cls, register
from hflow.reward.managers.remote import RemoteScorer

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
