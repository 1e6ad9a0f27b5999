"""`RolloutWorker`: a standalone vLLM engine of the rollout pool (`trainer.placement=split`).

It holds no training state: the engine starts with placeholder weights and takes every update from
the training pool over the weight stream (`hflow.workers.weight_sync`). The rollout pool is its own
torch.distributed world, so vLLM's tensor parallelism (`rollout.tensor_model_parallel_size`) groups
consecutive rollout ranks exactly as in the colocated engine, and each TP group is one data-parallel
replica that generates its share of the prompts.
"""

from __future__ import annotations

import logging

from omegaconf import DictConfig

from hflow.protocol import DataProto
from hflow.single_controller.base import Dispatch, Worker, register
from hflow.utils import device
from hflow.workers.config import normalize_actor_rollout_ref
from hflow.workers.fsdp_workers import _load_tokenizer, engine_info_of, generate_with
from hflow.workers.weight_sync import SENDER, StreamedWeights, WeightGroup, WeightManifest

__all__ = ["RolloutWorker"]

logger = logging.getLogger(__name__)


class RolloutWorker(Worker):
    """`config` is the `actor_rollout_ref` subtree (its `model` and `rollout` sections)."""

    def __init__(self, config: DictConfig):
        super().__init__()
        self.raw_config = config
        self.weights_version = -1  # no update received yet: the engine holds placeholder weights

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        import os

        from torch.distributed.device_mesh import init_device_mesh
        from transformers import AutoConfig, GenerationConfig

        self.config = normalize_actor_rollout_ref(self.raw_config, "rollout", self.world_size, own_device=True)
        model_cfg, rollout_cfg = self.config.model, self.config.rollout
        # The engine owns its device for the whole run: nothing to hand back between generations.
        rollout_cfg.free_cache_engine = False
        self.init_distributed()
        self.tokenizer = _load_tokenizer(model_cfg.tokenizer_path or model_cfg.path, model_cfg.trust_remote_code)
        self.hf_config = AutoConfig.from_pretrained(model_cfg.path, trust_remote_code=model_cfg.trust_remote_code)
        try:
            self.generation_config = GenerationConfig.from_pretrained(model_cfg.path)
        except OSError:  # no generation_config.json: the tokenizer's EOS ends responses
            self.generation_config = None
        tp = int(rollout_cfg.tensor_model_parallel_size)
        mesh = init_device_mesh(device.device_name(), (self.world_size // tp, tp), mesh_dim_names=("dp", "infer_tp"))
        if not device.is_cuda():
            os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # see ActorRolloutRefWorker._build_rollout
        from hflow.workers.rollout import vLLMRollout
        from hflow.workers.sharding_manager import VLLMGenerationContext

        rollout_cfg.load_format = "dummy"  # every weight arrives over the stream before the first generation
        self.rollout = vLLMRollout(model_cfg.path, rollout_cfg, self.tokenizer, self.hf_config, device_mesh=mesh)
        self.context = VLLMGenerationContext(self.rollout, mesh)
        info = self.engine_info()
        logger.info("rollout rank %d: vLLM engine with tensor_parallel_size=%d (TP rank %d of DP replica %d), "
                    "holding %d of the model's %d embedding rows", self.rank, info["tensor_parallel_size"],
                    info["tp_rank"], info["dp_rank"], info["embedding_rows"], info["vocab_size"])

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def engine_info(self) -> dict[str, int]:
        """What this rank's engine really runs (`engine_info_of`)."""
        return engine_info_of(self.rollout, self.context, self.hf_config)

    # ------------------------------------------------------------------ weights

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def join_weight_group(self, master_addr: str, master_port: str, world_size: int) -> None:
        """Join the stream from the training pool (its rank 0 is group rank 0; this rank is 1 + rank)."""
        self.weight_group = WeightGroup(master_addr, master_port, rank=SENDER + 1 + self.rank, world_size=world_size)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def receive_weights(self, manifest: WeightManifest, version: int) -> float:
        """Load one update, streamed tensor by tensor into the engine; returns the seconds it took."""
        import time

        started = time.perf_counter()
        stream = StreamedWeights(self.weight_group, manifest)
        self.rollout.update_weights(stream)
        left = stream.drain()
        if left:
            raise RuntimeError(f"vLLM's weight loader stopped {left} tensors before the end of the update")
        self.weights_version = int(version)
        return time.perf_counter() - started

    # ------------------------------------------------------------------ generation

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Sample responses with the latest weights received; `meta_info["weights_version"]` says which."""
        if self.weights_version < 0:
            raise RuntimeError("generate_sequences() before any weights arrived; call receive_weights() first")
        output = generate_with(self.rollout, self.context, prompts, self.generation_config, self.tokenizer)
        output.meta_info["weights_version"] = self.weights_version
        return output

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def generation_state(self) -> dict:
        """This rank's generation RNG stream (saved with checkpoints, like the colocated worker's)."""
        return self.context.state_dict()

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def load_generation_state(self, state: dict) -> None:
        self.context.load_state_dict(state)

    def close(self) -> None:
        if getattr(self, "rollout", None) is not None:
            self.rollout.close()

