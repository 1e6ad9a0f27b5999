"""PPO actors: the policy's log-probabilities and its update (also used, without optimizer, as the reference)."""

from hflow.workers.actor.base import BasePPOActor
from hflow.workers.actor.dp_actor import DataParallelPPOActor

__all__ = ["BasePPOActor", "DataParallelPPOActor"]
