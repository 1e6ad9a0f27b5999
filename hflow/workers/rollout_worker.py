"""`RolloutWorker`: a standalone vLLM engine of the rollout pool (`trainer.placement=split`).

It holds no training state: the engine starts with placeholder weights and takes every update from
the training pool over the weight stream (`hflow.workers.weight_sync`). The rollout pool is its own
torch.distributed world, so vLLM's tensor parallelism (`rollout.tensor_model_parallel_size`) groups
consecutive rollout ranks exactly as in the colocated engine, and each TP group is one data-parallel
replica that generates its share of the prompts.

Updates are announced by the sender before their broadcasts (`WeightGroup.announce`). Between two
generations the worker loads every announced update; during a generation that allows it (asynchronous
training past one step, or partial rollouts) the engine takes an update between two scheduler steps,
so the training pool never waits for the longest response in flight (see `WeightUpdates`).
"""

from __future__ import annotations

import logging
import time
from collections import deque

import torch
from omegaconf import DictConfig

from hflow.protocol import DataProto
from hflow.single_controller.base import Dispatch, Worker, register
from hflow.utils import device
from hflow.workers.config import normalize_actor_rollout_ref
from hflow.workers.common import load_tokenizer
from hflow.workers.fsdp_workers import engine_idle_metrics, engine_info_of, generate_with, serve_with
from hflow.workers.rollout.base import WeightUpdates
from hflow.workers.weight_sync import SENDER, StagedWeights, StreamedWeights, WeightGroup, WeightManifest

__all__ = ["RolloutWorker"]

logger = logging.getLogger(__name__)


class RolloutWorker(Worker):
    """`config` is the `actor_rollout_ref` subtree (its `model` and `rollout` sections)."""

    def __init__(self, config: DictConfig):
        super().__init__()
        self.raw_config = config
        self.weights_version = -1  # no update received yet: the engine holds placeholder weights
        self._updates_received = 0  # of the updates the sender announced
        # updates taken off the stream but not in the engine yet, oldest first: the latest alone (a newer one
        # supersedes it), or each of them with exact weight versions (trainer.deterministic)
        self._staged: deque[StagedWeights] = deque()
        self._generation_end: float | None = None  # when the engine last ran out of work
        self._load_s = 0.0  # seconds spent loading weights since then
        self._exact_versions = False  # trainer.deterministic: each batch sampled by its own version's weights

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from transformers import AutoConfig, GenerationConfig

        self.config = normalize_actor_rollout_ref(self.raw_config, "rollout", self.world_size, own_device=True)
        model_cfg, rollout_cfg = self.config.model, self.config.rollout
        # The engine owns its device for the whole run: nothing to hand back between generations.
        rollout_cfg.free_cache_engine = False
        self.init_distributed()
        self.tokenizer = load_tokenizer(model_cfg.tokenizer_path or model_cfg.path, model_cfg.trust_remote_code)
        self.hf_config = AutoConfig.from_pretrained(model_cfg.path, trust_remote_code=model_cfg.trust_remote_code)
        try:
            self.generation_config = GenerationConfig.from_pretrained(model_cfg.path)
        except OSError:  # no generation_config.json: the tokenizer's EOS ends responses
            self.generation_config = None
        tp = int(rollout_cfg.tensor_model_parallel_size)
        mesh = init_device_mesh(device.device_name(), (self.world_size // tp, tp), mesh_dim_names=("dp", "infer_tp"))
        from hflow.workers.rollout import vLLMRollout
        from hflow.workers.rollout.vllm_rollout import tensor_parallel_agreement
        from hflow.workers.sharding_manager import VLLMGenerationContext

        rollout_cfg.load_format = "dummy"  # every weight arrives over the stream before the first generation
        self.rollout = vLLMRollout(model_cfg.path, rollout_cfg, self.tokenizer, self.hf_config, device_mesh=mesh)
        # The ranks of one tensor-parallel engine must take an update at the same point, or one would wait in
        # the weight broadcast while the other waits in the engine's step: the group's first rank decides.
        self._tp_agree = tensor_parallel_agreement(self.rollout.llm)
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
    def join_weight_group(self, master_addr: str, master_port: str, world_size: int,
                          manifest: WeightManifest | None = None) -> None:
        """Join the stream from the training pool (its rank 0 is group rank 0; this rank is 1 + rank)."""
        self.weight_group = WeightGroup(master_addr, master_port, rank=SENDER + 1 + self.rank, world_size=world_size)
        self.manifest = manifest

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def receive_weights(self, manifest: WeightManifest, version: int, exact: bool = False) -> float:
        """Load the updates announced so far, up to at least `version` (waiting for its announcement), or
        with `exact` up to `version` only; returns the seconds it took. A no-op for an update a generation
        already took."""
        started = time.perf_counter()
        self.manifest = manifest
        self._catch_up(int(version), exact)
        return time.perf_counter() - started

    def _catch_up(self, version: int, exact: bool = False) -> None:
        """Between generations: bring the engine to at least `version`, loading the staged updates and every
        announced one. `exact` (trainer.deterministic): to `version` itself, whatever newer update the sender
        announced meanwhile (that one is staged for a later batch), so which weights sample a batch never
        depends on how far ahead the training pool is."""
        if exact:
            while self._agreed_update_waiting():  # off the stream, so the sender does not wait on this batch
                self._receive(into_engine=False)
            self._load_staged_up_to(version)
            while self.weights_version < version:
                self._wait_for_announcement(version)
                self._receive(into_engine=False)
                self._load_staged_up_to(version)
            return
        while self._staged:
            staged = self._staged.popleft()
            self._load(staged, staged.version)
        while self._agreed_update_waiting() or self.weights_version < version:
            self._wait_for_announcement(version)
            self._receive(into_engine=True)

    def _load_staged_up_to(self, version: int) -> None:
        while self._staged and self._staged[0].version <= version:
            staged = self._staged.popleft()
            self._load(staged, staged.version)

    def _agreed_update_waiting(self) -> bool:
        waiting = self._update_waiting()
        return waiting if self._tp_agree is None else bool(self._tp_agree([waiting])[0])

    def _update_waiting(self) -> bool:
        return self.weight_group.updates_announced() > self._updates_received

    def _wait_for_announcement(self, version: int, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._update_waiting():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rollout rank {self.rank} waited {timeout_s:.0f} s for weights of policy version "
                                   f"{version} (it holds {self.weights_version}); the training pool never sent them")
            time.sleep(0.002)

    def _receive(self, into_engine: bool) -> None:
        """Take the announced update: into the engine now, or staged for the next generation."""
        if self.manifest is None:
            raise RuntimeError("an update arrived before its manifest; call receive_weights() first")
        version = self.weight_group.announced_version()
        if into_engine:
            stream = StreamedWeights(self.weight_group, self.manifest)
            self._load(stream, version)
            left = stream.drain()
            if left:
                raise RuntimeError(f"vLLM's weight loader stopped {left} tensors before the end of the update")
            self._staged.clear()  # an older staged update is superseded
        else:
            if not self._exact_versions:
                self._staged.clear()  # superseded: the next generation takes the newest
            self._staged.append(StagedWeights(self.weight_group, self.manifest, version))
        self._updates_received += 1

    def _load(self, tensors, version: int) -> None:
        started = time.perf_counter()
        self.rollout.update_weights(tensors)
        self.weights_version = int(version)
        self._load_s += time.perf_counter() - started

    # ------------------------------------------------------------------ generation

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Sample responses with the latest weights announced, at least `meta_info["min_weights_version"]`
        (waiting for them); `meta_info["updates_in_flight"]` lets updates arrive during the generation.

        The output's `rollout_versions` holds each token's policy version."""
        if self.weights_version < 0 and (getattr(self, "weight_group", None) is None or not self._update_waiting()):
            raise RuntimeError("generate_sequences() before any weights arrived; call receive_weights() first")
        control = {key: prompts.meta_info.get(key) for key in ("min_weights_version", "updates_in_flight",
                                                                 "exact_weights_version")}
        # (not passed on: batches generated apart must agree on their meta_info when concatenated)
        prompts.meta_info = {k: v for k, v in prompts.meta_info.items() if k not in control}
        self._exact_versions = bool(control["exact_weights_version"])
        self._catch_up(int(control["min_weights_version"] or 0), self._exact_versions)
        started = time.perf_counter()
        # the engine had nothing to do since its last generation, but for loading weights
        idle = 0.0 if self._generation_end is None else started - self._generation_end - self._load_s
        started_with = self.weights_version
        updates = None
        if self.config.rollout.partial_rollout or control["updates_in_flight"]:
            updates = _UpdatesDuringGeneration(self, partial=bool(self.config.rollout.partial_rollout))
        output = generate_with(self.rollout, self.context, prompts, self.generation_config, self.tokenizer,
                               weight_updates=updates)
        if "rollout_versions" not in output.batch.keys():
            versions = torch.full_like(output.batch["responses"], started_with)
            output.batch["rollout_versions"] = versions.masked_fill(output.batch["attention_mask"][:, -versions.shape[1]:] == 0, -1)
        ended = time.perf_counter()
        metrics = output.meta_info.setdefault("metrics", {})
        # idle: no batch since the last one ended, or no request running within this one (tools, the tail)
        idle += metrics.pop("perf/rollout_idle_in_call_s", 0.0)
        window = ended - (self._generation_end if self._generation_end is not None else started)
        metrics.update(engine_idle_metrics(self.context.dp_rank, idle, window))
        self._generation_end, self._load_s = ended, 0.0
        return output

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def serve_routed(self, router) -> dict:
        """`rollout.admission=continuous`: run the rows `router` hands this engine, from any submitted batch
        whose weights it holds, until none is left for it; updates are taken between engine steps."""
        if self.weights_version < 0 and (getattr(self, "weight_group", None) is None or not self._update_waiting()):
            raise RuntimeError("serve_routed() before any weights arrived; call receive_weights() first")
        self._catch_up(0)  # the engine is empty between serve calls: load what arrived meanwhile
        partial = bool(self.config.rollout.partial_rollout)

        def between_steps(busy: bool) -> None:
            if self._staged and not busy:  # nothing runs: the staged update goes in now
                staged = self._staged.pop()
                self._staged.clear()
                self._load(staged, staged.version)

        return serve_with(self.rollout, self.context, router, self.generation_config, self.tokenizer,
                          weight_updates=_UpdatesDuringGeneration(self, partial), between_steps=between_steps)

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


class _UpdatesDuringGeneration(WeightUpdates):
    """The worker's announced updates, as the engine sees them between two scheduler steps."""

    def __init__(self, worker: RolloutWorker, partial: bool):
        self.worker = worker
        self.partial = partial

    @property
    def version(self) -> int:
        return self.worker.weights_version

    def arrived(self) -> bool:
        return self.worker._update_waiting()

    def take(self) -> None:
        self.worker._receive(into_engine=self.partial)

