"""Hand an FSDP2-trained policy to the vLLM engine in the same process, and take the device back.

    with sharding_manager:                      # weights FSDP -> vLLM, KV cache up, generation RNG
        prompts = sharding_manager.preprocess_data(prompts)
        output = rollout.generate_sequences(prompts)
        output = sharding_manager.postprocess_data(output)
                                                # engine asleep, training RNG back

Weights travel a bucket at a time (`rollout.weight_bucket_mb`, by device when null): each rank casts its
FSDP shards to the engine's dtype, one all-gather assembles the bucket's full tensors, which are handed to
`vLLMRollout.update_weights` (vLLM's `reload_weights`, then a prefix-cache reset) and dropped, so at most
one bucket of full tensors exists beside the shards (`hflow.workers.fsdp.gather`); `last_sync_bytes` is
what the last sync gathered. On CUDA the engine wakes in two stages, weights
before the sync and KV cache after the gathered tensors are freed, so the cache can take the memory
they used; on exit it sleeps at level 2 (weights discarded, not copied to host memory). On CPU there
is no sleep mode and those steps do nothing.
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hflow.protocol import DataProto, all_gather_data_proto
from hflow.utils.device import empty_cache, is_cuda
from hflow.workers.fsdp import GatherStats, iter_full_params, load_fsdp_model_to_device, offload_fsdp_model_to_cpu
from hflow.workers.sharding_manager.base import BaseShardingManager

if TYPE_CHECKING:
    from hflow.workers.rollout.vllm_rollout import vLLMRollout

__all__ = ["FSDPVLLMShardingManager", "VLLMGenerationContext"]

# Generation seeds of data-parallel ranks are this far apart, so `rollout.seed` values that differ
# by less than this never give two ranks the same stream.
DP_SEED_STRIDE = 1000


class VLLMGenerationContext(BaseShardingManager):
    """Generation mode for a worker that owns a vLLM engine: its own RNG stream and the data layout of
    tensor parallelism. The engine's weights arrive some other way (`FSDPVLLMShardingManager` syncs
    them on entry; a standalone rollout worker receives them over the weight stream).

    `device_mesh` is the rollout mesh with dims `("dp", "infer_tp")`; without it the whole world is
    data-parallel with TP=1. Generation draws from its own torch RNG stream, seeded with
    `rollout.seed + 1000 * dp_rank` (ranks of one TP group must sample identically; DP replicas
    must not), while the caller's RNG is saved on `__enter__` and restored on `__exit__`, so
    training randomness does not depend on how many tokens were sampled. `last_sync_s` is the wall
    time of the latest weight sync made on entry.
    """

    def __init__(self, rollout: vLLMRollout, device_mesh: DeviceMesh | None = None) -> None:
        self.rollout = rollout
        self.device_mesh = device_mesh
        if device_mesh is not None:
            self.tp_size = device_mesh["infer_tp"].size()
            self.tp_rank = device_mesh["infer_tp"].get_local_rank()
            self.dp_rank = device_mesh["dp"].get_local_rank()
        else:
            self.tp_size, self.tp_rank = 1, 0
            self.dp_rank = dist.get_rank() if dist.is_initialized() else 0
        self.last_sync_s = 0.0

        caller_rng = _get_rng_state()
        torch.manual_seed(int(rollout.config.seed) + DP_SEED_STRIDE * self.dp_rank)  # the CUDA generators too
        self._generation_rng = _get_rng_state()
        _set_rng_state(caller_rng)
        self._training_rng: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def _sync_weights(self) -> None:
        """Bring the engine's weights up to date (nothing here: they are delivered separately)."""

    def __enter__(self) -> VLLMGenerationContext:
        started = time.perf_counter()
        self._sync_weights()
        self.last_sync_s = time.perf_counter() - started
        self._training_rng = _get_rng_state()
        _set_rng_state(self._generation_rng)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._training_rng is None:
            raise RuntimeError(f"{type(self).__name__}.__exit__ without a matching __enter__")
        self._generation_rng = _get_rng_state()
        _set_rng_state(self._training_rng)
        self._training_rng = None
        # Level 2: drop the engine's weights rather than copy them to host memory; the next sync
        # overwrites every parameter anyway. A no-op for engines without sleep mode.
        self.rollout.sleep(level=2)
        empty_cache()

    def state_dict(self) -> dict:
        """The generation RNG stream, saved in checkpoints so a resumed run samples as an uninterrupted one."""
        return {"generation_rng": self._generation_rng}

    def load_state_dict(self, state: dict) -> None:
        self._generation_rng = state["generation_rng"]

    def preprocess_data(self, data: DataProto) -> DataProto:
        """All ranks of a TP group generate the same requests: give each the union of the group's shards."""
        if self.tp_size > 1:
            all_gather_data_proto(data, self.device_mesh["infer_tp"].get_group())
        return data

    def postprocess_data(self, data: DataProto) -> DataProto:
        """Keep this rank's share of the TP group's output, so the collect step sees each row once."""
        if self.tp_size > 1:
            return data.chunk(self.tp_size)[self.tp_rank]
        return data


class FSDPVLLMShardingManager(VLLMGenerationContext):
    """Generation mode for a fused actor/rollout worker: FSDP2 `module` -> `rollout`'s vLLM engine on
    every entry (see the module docstring), plus what `VLLMGenerationContext` does. `offload_param`
    means the FSDP shards live in host memory between steps: they visit the GPU only for the gather
    (on CPU they are in host memory anyway).
    """

    def __init__(
        self,
        module: nn.Module,
        rollout: vLLMRollout,
        device_mesh: DeviceMesh | None = None,
        offload_param: bool = False,
    ) -> None:
        super().__init__(rollout, device_mesh)
        self.module = module
        self.offload_param = offload_param
        self.last_sync_bytes = 0

    def _sync_weights(self) -> None:
        if self.offload_param:
            load_fsdp_model_to_device(self.module)
        self.rollout.wake_up(tags=["weights"])
        # HF names, one full tensor at a time; every rank consumes them in the same order, since each
        # gather is a collective.
        config, stats = self.rollout.config, GatherStats()
        bucket_mb = config.weight_bucket_mb
        self.rollout.update_weights(iter_full_params(self.module, getattr(torch, str(config.dtype)),
                                                     None if bucket_mb is None else int(float(bucket_mb) * 2**20),
                                                     stats))
        self.last_sync_bytes = stats.bytes
        if self.offload_param:
            offload_fsdp_model_to_cpu(self.module, empty_cache=False)
        empty_cache()
        self.rollout.wake_up(tags=["kv_cache"])


def _get_rng_state() -> tuple[torch.Tensor, torch.Tensor | None]:
    """The host RNG (vLLM's CPU sampler draws its seeds from it) and, on CUDA, the device RNG."""
    return torch.random.get_rng_state(), torch.cuda.get_rng_state() if is_cuda() else None


def _set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    host, device = state
    torch.random.set_rng_state(host)
    if device is not None:
        torch.cuda.set_rng_state(device)
