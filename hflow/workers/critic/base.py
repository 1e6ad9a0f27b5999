"""The interface a PPO critic offers its worker: value estimates, and a value-function update."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from hflow.protocol import DataProto

__all__ = ["BasePPOCritic"]


class BasePPOCritic(ABC):
    """A value function V(s_t) over response tokens.

    `config` is the `critic` subtree, with batch sizes already normalised to this rank by the worker.
    """

    def __init__(self, config: Any) -> None:
        self.config = config

    @abstractmethod
    def compute_values(self, data: DataProto) -> torch.Tensor:
        """Values of the states before each response token, shape (batch, response_length)."""

    @abstractmethod
    def update_critic(self, data: DataProto) -> dict[str, list[float]]:
        """Run the PPO epochs over `data`; return metric lists (one entry per optimizer step)."""
