"""PPO critics: value estimates of response states and the value-function update."""

from hflow.workers.critic.base import BasePPOCritic
from hflow.workers.critic.dp_critic import DataParallelPPOCritic

__all__ = ["BasePPOCritic", "DataParallelPPOCritic"]
