"""The interface a PPO actor offers its worker: log-probabilities of given responses, and a policy update."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from hflow.protocol import DataProto

__all__ = ["BasePPOActor"]


class BasePPOActor(ABC):
    """A policy that can score responses and learn from advantages.

    `config` is the `actor_rollout_ref.actor` (or `.ref`) subtree, with batch sizes already
    normalised to this rank by the worker.
    """

    def __init__(self, config: Any) -> None:
        self.config = config

    @abstractmethod
    def compute_log_prob(
        self, data: DataProto, calculate_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probabilities (and optionally entropies) of `responses`, shape (batch, response_length)."""

    @abstractmethod
    def update_policy(self, data: DataProto) -> dict[str, list[float]]:
        """Run the PPO epochs over `data`; return metric lists (one entry per optimizer step)."""
