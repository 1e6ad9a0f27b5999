"""Switching a fused worker between FSDP training and vLLM generation (weights, memory, RNG, data)."""

from hflow.workers.sharding_manager.base import BaseShardingManager
from hflow.workers.sharding_manager.fsdp_vllm import FSDPVLLMShardingManager, VLLMGenerationContext

__all__ = ["BaseShardingManager", "FSDPVLLMShardingManager", "VLLMGenerationContext"]
