"""The workers of the hybrid engine: their `@register` methods are what the trainer calls.

* `ActorRolloutRefWorker(config, role)` -- the fused policy worker. Depending on `role` it holds the
  trainable actor (FSDP2 + AdamW), the vLLM (or HF) rollout that generates with the actor's current
  weights, and/or a frozen reference copy of the initial policy.
* `CriticWorker(config)` -- the value model for PPO/GAE.
* `RewardModelWorker(config)` -- a sequence-classification reward model.

Each worker is one process per device; all of them can share the process through
`create_colocated_worker_cls`. Data methods use `DP_COMPUTE_PROTO` (each rank gets its chunk of the
batch) and return a `DataProto`, with metrics in `meta_info["metrics"]`; set-up and checkpoint
methods use `ONE_TO_ALL`.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch
from omegaconf import DictConfig

from hflow.protocol import DataProto
from hflow.single_controller.base import Dispatch, Worker, register
from hflow.utils.batch_invariant import batch_invariant
from hflow.utils import device
from hflow.utils.torch_functional import last_valid_index, response_attention_mask
from hflow.utils.vision import freeze_vision_tower
from hflow.workers.common import load_tokenizer, memory_metrics
from hflow.workers.config import normalize_actor_rollout_ref, normalize_reward_model
from hflow.workers.critic.config import normalize_critic
from hflow.workers.fsdp.checkpoint import FSDPCheckpointManager, save_hf_model
from hflow.workers.fsdp.kernels import compile_metrics
from hflow.workers.fsdp.lora import add_lora
from hflow.workers.weight_sync import WeightGroup, WeightManifest, manifest_of, send_weights

ROLES = ("actor", "rollout", "ref", "actor_rollout", "actor_rollout_ref")


def generate_with(rollout, context, prompts: DataProto, generation_config, tokenizer, **generate_kwargs) -> DataProto:
    """`rollout.generate_sequences` inside the generation `context` (a sharding manager: weights, RNG,
    tensor-parallel data layout), with the model's stop and pad ids and the phase's timings."""
    eos = getattr(generation_config, "eos_token_id", None)
    prompts.meta_info.setdefault("eos_token_id", eos if eos is not None else tokenizer.eos_token_id)
    prompts.meta_info.setdefault("pad_token_id", tokenizer.pad_token_id)
    started = time.perf_counter()
    with context:
        sync_s = getattr(context, "last_sync_s", 0.0)
        prompts = context.preprocess_data(prompts)
        output = rollout.generate_sequences(prompts, **generate_kwargs)
        output = context.postprocess_data(output)
    output.meta_info["metrics"] = {
        **output.meta_info.get("metrics", {}),  # the rollout's own (multi-turn: agent/*)
        "timing_s/weight_sync": sync_s,
        "timing_s/generate_worker": time.perf_counter() - started - sync_s,
    }
    if hasattr(context, "last_sync_bytes"):  # the colocated sync: what it gathered for the engine, per rank
        output.meta_info["metrics"]["perf/weight_sync_gb"] = context.last_sync_bytes / 1e9
    device.empty_cache()
    return output.to("cpu")


def engine_idle_metrics(engine: int, idle_s: float, window_s: float) -> dict[str, float]:
    """An engine's idle seconds (no request running) in a window of `window_s`, and their share; per engine and
    under the plain names, which the trainer averages over engines."""
    # idle and window are read from separate clock calls, so idle can pass the window by microseconds
    idle_s = min(idle_s, window_s) if window_s > 0 else idle_s
    share = idle_s / window_s if window_s > 0 else 0.0
    return {"perf/rollout_idle_s": idle_s, "perf/rollout_idle_share": share,
            f"perf/rollout_idle_s/engine{engine}": idle_s, f"perf/rollout_idle_share/engine{engine}": share}


def stop_ids_of(generation_config, tokenizer) -> dict:
    """The stop and pad ids a generation uses when its batch names none (as `generate_with` sets them)."""
    eos = getattr(generation_config, "eos_token_id", None)
    return {"eos_token_id": eos if eos is not None else tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}


def serve_with(rollout, context, router, generation_config, tokenizer, **serve_kwargs) -> dict:
    """Continuous admission: this rank's engine serves the rows `router` hands it (`vLLMRollout.serve`),
    inside the generation `context`, as engine `context.dp_rank`."""
    from hflow.workers.rollout.router import RouterClient

    if getattr(context, "tp_size", 1) != 1:
        raise ValueError("rollout.admission=continuous needs rollout.tensor_model_parallel_size=1")
    with context:
        metrics = rollout.serve(RouterClient(router), context.dp_rank, stop_ids_of(generation_config, tokenizer),
                                **serve_kwargs)
    device.empty_cache()
    return metrics


def engine_info_of(rollout, context, hf_config) -> dict[str, int]:
    """What one rank's vLLM engine really runs: its TP size and rank (from the generation `context`),
    and how many rows of the input embedding it holds (the padded vocabulary / TP when sharded)."""
    return {**rollout.parallel_layout(), "tp_rank": context.tp_rank, "dp_rank": context.dp_rank,
            "vocab_size": int(hf_config.get_text_config().vocab_size)}


class FSDPModelHolder:
    """What the actor and the critic share: a model in FSDP2, its optimizer, scheduler and checkpoints."""

    def _build_trainable(self, module: torch.nn.Module, fsdp_config: DictConfig, optim_config: DictConfig,
                         gradient_checkpointing: bool, train: bool, fp32_modules=(), kernels=None, role="model"):
        """`kernels`: the model section whose `use_liger` / `use_torch_compile` apply (actor, ref and critic alike)."""
        from hflow.workers import fsdp
        from hflow.workers.fsdp.kernels import apply_kernel_options

        # `module` was read from disk on rank 0 only (`rank0_only=True`): the shards get its weights
        cpu_offload = fsdp_config.offload_policy
        if kernels is not None:  # before sharding: FSDP2 wraps the patched / compiled layers
            apply_kernel_options(module, use_liger=bool(kernels.get("use_liger")),
                                 use_torch_compile=bool(kernels.get("use_torch_compile")), role=role)
        with fsdp.weights_from_rank0(module, cpu_offload=cpu_offload):
            if gradient_checkpointing:
                fsdp.enable_gradient_checkpointing(module)
            module = fsdp.apply_fsdp2(
                module,
                self.device_mesh,
                mixed_precision=fsdp_config.get("mixed_precision"),  # the ref's fsdp_config has none: the default
                reshard_after_forward=fsdp_config.reshard_after_forward,
                gather_once_per_pass=fsdp_config.get("gather_once_per_pass"),  # null: by size and device memory
                gather_once_per_update=fsdp_config.get("gather_once_per_update"),  # null: by size and device memory
                cpu_offload=cpu_offload,
                fp32_modules=fp32_modules,
            )
        if not train:
            module.requires_grad_(False)
            return module, None, None
        # frozen parameters (a LoRA model's base weights) get no optimizer state
        optimizer = fsdp.build_optimizer([p for p in module.parameters() if p.requires_grad], optim_config)
        scheduler = fsdp.build_lr_scheduler(optimizer, optim_config, optim_config.total_training_steps)
        return module, optimizer, scheduler

    def _offload(self, module, optimizer, param: bool, optim: bool) -> None:
        from hflow.workers import fsdp

        if param:
            fsdp.offload_fsdp_model_to_cpu(module)
        if optim and optimizer is not None:
            fsdp.offload_optimizer(optimizer)

    def _onload(self, module, optimizer, param: bool, optim: bool) -> None:
        from hflow.workers import fsdp

        if param:
            fsdp.load_fsdp_model_to_device(module)
        if optim and optimizer is not None:
            fsdp.load_optimizer(optimizer)

    # ---- the health watch's last healthy state (trainer.health; see hflow.workers.fsdp.snapshot) -----------

    def _trainable_parts(self) -> tuple:
        """(module, optimizer, scheduler, optim config, extra tensors to keep, loss config with clip ratios)."""
        raise NotImplementedError

    def _health_snapshots(self) -> dict:
        if getattr(self, "_snapshots", None) is None:
            from hflow.workers.fsdp.snapshot import HostSnapshot

            module, optimizer, scheduler, _, extra, _ = self._trainable_parts()
            # two host copies: the state at the start of this step, and the last one a step proved healthy
            self._snapshots = {slot: HostSnapshot(module, optimizer, scheduler, extra) for slot in ("candidate", "healthy")}
        return self._snapshots

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def snapshot_state(self) -> None:
        """Copy this rank's trainable state (shards, optimizer, scheduler) to host memory: the candidate."""
        self._health_snapshots()["candidate"].take()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def commit_snapshot(self) -> None:
        """The candidate is now the last healthy state (its step passed the health watch)."""
        snapshots = self._health_snapshots()
        snapshots["candidate"], snapshots["healthy"] = snapshots["healthy"], snapshots["candidate"]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def restore_snapshot(self, slot: str = "healthy") -> None:
        """Write a kept state (`healthy`, or `candidate`: this step's start) back into the live shards,
        optimizer and scheduler."""
        self._health_snapshots()[slot].restore()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def set_health_factors(self, lr_factor: float, clip_factor: float) -> None:
        """The health watch's remedies: learning rate = optim.lr x lr_factor (the schedule's shape kept),
        PPO clip ratios = their configured values x clip_factor (the actor only)."""
        _, optimizer, scheduler, optim_config, _, loss_config = self._trainable_parts()
        scheduler.base_lrs = [float(optim_config.lr) * lr_factor for _ in scheduler.base_lrs]
        lrs = [base * factor(scheduler.last_epoch) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr
        scheduler._last_lr = lrs  # what get_last_lr() reports
        if loss_config is not None:
            if not hasattr(self, "_configured_clip"):
                self._configured_clip = {key: loss_config.get(key) for key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high")}
            for key, value in self._configured_clip.items():
                if value is not None:
                    loss_config[key] = float(value) * clip_factor


class ActorRolloutRefWorker(Worker, FSDPModelHolder):
    """Actor, rollout and/or reference policy in one process (`role` says which).

    `config` is the `actor_rollout_ref` subtree. Nothing heavy happens before `init_model`, which
    first checks the configuration (batch sizes against the number of ranks, tensor parallelism,
    the model folder) and fails with a message naming the keys.
    """

    def __init__(self, config: DictConfig, role: str):
        super().__init__()
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.raw_config = config
        self.role = role
        self._is_actor = role in ("actor", "actor_rollout", "actor_rollout_ref")
        self._is_rollout = role in ("rollout", "actor_rollout", "actor_rollout_ref")
        # With LoRA the reference policy is the actor's own base model, its adapters switched off: the actor
        # answers compute_ref_log_prob and no second copy of the model is loaded.
        self._ref_in_actor = self._is_actor and int(config.model.lora_rank) > 0
        self._is_ref = role in ("ref", "actor_rollout_ref") or self._ref_in_actor

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from hflow.workers import fsdp

        self.config = normalize_actor_rollout_ref(self.raw_config, self.role, self.world_size)
        self.init_distributed()
        self.device_mesh = fsdp.build_device_mesh(self.world_size)
        model_cfg = self.config.model
        self.tokenizer = load_tokenizer(model_cfg.tokenizer_path or model_cfg.path, model_cfg.trust_remote_code)
        actor_fsdp = self.config.actor.fsdp_config
        self._offload_param = self._is_actor and actor_fsdp.param_offload
        self._offload_optim = self._is_actor and actor_fsdp.optimizer_offload
        self._offload_ref_param = self._is_ref and not self._ref_in_actor and self.config.ref.fsdp_config.param_offload

        if self._is_actor or self._is_rollout:
            module = fsdp.load_causal_lm(
                model_cfg.path,
                dtype=actor_fsdp.model_dtype,
                override_config=model_cfg.override_config,
                trust_remote_code=model_cfg.trust_remote_code,
                attn_implementation=model_cfg.attn_implementation,
                rank0_only=True,
            )
            self.hf_config = module.config
            self.generation_config = module.generation_config
            if self._ref_in_actor:  # adapters before sharding, so FSDP2 shards them with their layers
                module = add_lora(module, model_cfg.lora_rank, model_cfg.lora_alpha, model_cfg.target_modules)
            if self._is_actor and self.config.actor.freeze_vision_tower:  # before the optimizer: no state for it
                freeze_vision_tower(module)
            self.actor_module, self.actor_optimizer, self.actor_lr_scheduler = self._build_trainable(
                module, actor_fsdp, self.config.actor.optim,
                gradient_checkpointing=model_cfg.enable_gradient_checkpointing,
                train=self._is_actor, kernels=model_cfg, role="actor",
            )
        self.ptx_sampler = self.actor_ema = None
        if self._is_actor:
            from hflow.utils.flops_counter import device_peak_flops
            from hflow.workers.actor import DataParallelPPOActor

            self._build_ptx_and_ema()
            # perf/mfu/actor's denominator; a CPU measures its matmul peak here, once per machine (cached)
            self._peak_flops = device_peak_flops()
            if self.config.actor.router_aux_loss_coef is None:  # null: the model's own coefficient, if it has one
                self.config.actor.router_aux_loss_coef = float(getattr(self.hf_config, "router_aux_loss_coef", 0.0) or 0.0)
            self.actor = DataParallelPPOActor(self.config.actor, self.actor_module, self.actor_optimizer,
                                              ptx_sampler=self.ptx_sampler, ema=self.actor_ema)
        if self._is_rollout:
            self._build_rollout()
        if self._is_actor:
            stateful = {"sharding_manager": self.sharding_manager} if hasattr(
                getattr(self, "sharding_manager", None), "state_dict") else {}
            if self.ptx_sampler is not None:  # a resumed run continues the same draws
                stateful["ptx_sampler"] = self.ptx_sampler
            ema = {"ema": self.actor_ema} if self.actor_ema is not None else {}
            self.checkpoint_manager = FSDPCheckpointManager(
                self.actor_module, self.actor_optimizer, self.actor_lr_scheduler, self.tokenizer,
                contents=self.config.actor.checkpoint.contents, stateful=stateful, sharded_state=ema,
                hf_exports={"ema_huggingface": self._write_ema_hf_model} if ema else None,
            )
        if self._is_ref and self._ref_in_actor:
            from hflow.workers.actor import DataParallelPPOActor

            self.ref_policy = DataParallelPPOActor(self.config.ref, self.actor_module)
        elif self._is_ref:
            from hflow.workers.actor import DataParallelPPOActor

            self.ref_module, _, _ = self._build_trainable(
                fsdp.load_frozen_causal_lm(model_cfg), self.config.ref.fsdp_config, None, gradient_checkpointing=False, train=False,
                kernels=model_cfg, role="ref")
            self.ref_policy = DataParallelPPOActor(self.config.ref, self.ref_module)
        self._offload(getattr(self, "actor_module", None), getattr(self, "actor_optimizer", None),
                      self._offload_param, self._offload_optim)
        self._offload(getattr(self, "ref_module", None), None, self._offload_ref_param, False)

    def _trainable_parts(self) -> tuple:
        self._require(self._is_actor, "the health watch's snapshots", "actor")
        extra = {f"ema/{name}": average for name, average in self.actor_ema.averages.items()} if self.actor_ema else {}
        return (self.actor_module, self.actor_optimizer, self.actor_lr_scheduler, self.config.actor.optim, extra,
                self.config.actor)

    def _build_ptx_and_ema(self) -> None:
        """PPO-ptx's text sampler (this rank's own draws) and the EMA of the actor's shards, when configured."""
        actor_cfg = self.config.actor
        if float(actor_cfg.ptx.coef) > 0:
            from hflow.utils.dataset.ptx_dataset import PtxSampler

            ptx = actor_cfg.ptx
            self.ptx_sampler = PtxSampler(ptx.files, ptx.text_key, self.tokenizer, ptx.batch_size_per_gpu,
                                          ptx.max_length, seed=ptx.seed, rank=self.rank)
        if actor_cfg.ema.enable:
            from hflow.workers.fsdp.ema import ParamEMA

            # Offloaded parameters leave the device between phases; their average never takes it.
            self.actor_ema = ParamEMA(self.actor_module, actor_cfg.ema.decay,
                                      device="cpu" if self._offload_param else None)

    def _build_rollout(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        rollout_cfg = self.config.rollout
        tp = int(rollout_cfg.tensor_model_parallel_size)
        rollout_mesh = init_device_mesh(device.device_name(), (self.world_size // tp, tp),
                                        mesh_dim_names=("dp", "infer_tp"))
        if rollout_cfg.name == "hf":
            from hflow.workers.rollout import HFRollout
            from hflow.workers.sharding_manager import BaseShardingManager

            self.rollout = HFRollout(self.actor_module, rollout_cfg, self.tokenizer)
            self.sharding_manager = BaseShardingManager()
            return
        from hflow.workers.rollout import vLLMRollout
        from hflow.workers.sharding_manager import FSDPVLLMShardingManager

        self.rollout = vLLMRollout(self.config.model.path, rollout_cfg, self.tokenizer, self.hf_config,
                                   device_mesh=rollout_mesh)
        self.sharding_manager = FSDPVLLMShardingManager(self.actor_module, self.rollout, device_mesh=rollout_mesh,
                                                        offload_param=self._offload_param)

    # ------------------------------------------------------------------ data methods

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Sample responses with the actor's current weights (synced into the engine on entry)."""
        self._require(self._is_rollout, "generate_sequences", "rollout")
        return generate_with(self.rollout, self.sharding_manager, prompts, self.generation_config, self.tokenizer)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def generate_routed(self, router, batch: int) -> dict:
        """`rollout.admission=continuous`: sample the rows of `batch` that `router` hands this rank's engine,
        with the actor's current weights (synced on entry, freed on exit, as for `generate_sequences`)."""
        self._require(self._is_rollout, "generate_routed", "rollout")
        return serve_with(self.rollout, self.sharding_manager, router, self.generation_config, self.tokenizer,
                          only_batch=batch)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def engine_info(self) -> dict[str, int]:
        """What this rank's colocated vLLM engine really runs (`engine_info_of`)."""
        self._require(self._is_rollout, "engine_info", "rollout")
        return engine_info_of(self.rollout, self.sharding_manager, self.hf_config)

    def _log_prob_meta(self, data: DataProto, section: DictConfig) -> None:
        data.meta_info.update(
            micro_batch_size=section.log_prob_micro_batch_size_per_gpu,
            max_token_len=section.log_prob_max_token_len_per_gpu,
            use_dynamic_bsz=section.log_prob_use_dynamic_bsz,
            temperature=self.config.rollout.temperature,  # the sampler's T: both log-probs see logits / T
        )

    def _batch_invariant(self):
        """`model.batch_invariant` (trainer.deterministic): a row's log-prob independent of its companions."""
        return batch_invariant(bool(self.config.model.get("batch_invariant", False)))

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """Log-probs (and entropy) of the responses under the current actor: `old_log_probs`, `entropys`."""
        self._require(self._is_actor, "compute_log_prob", "actor")
        self._onload(self.actor_module, None, self._offload_param, False)
        self._log_prob_meta(data, self.config.rollout)
        with self._batch_invariant():
            log_probs, entropys = self.actor.compute_log_prob(data.to(device.get_device()), calculate_entropy=True)
        self._offload(self.actor_module, None, self._offload_param, False)
        return DataProto.from_dict({"old_log_probs": log_probs.cpu(), "entropys": entropys.cpu()},
                                   meta_info={"temperature": self.config.rollout.temperature})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """Log-probs of the responses under the frozen reference policy: `ref_log_prob`."""
        self._require(self._is_ref, "compute_ref_log_prob", "ref")
        if self._ref_in_actor:  # LoRA: the base model is the reference
            module, offload, context = self.actor_module, self._offload_param, self.actor_module.disable_adapter()
        else:
            module, offload, context = self.ref_module, self._offload_ref_param, nullcontext()
        self._onload(module, None, offload, False)
        self._log_prob_meta(data, self.config.ref)
        with context, self._batch_invariant():
            log_probs, _ = self.ref_policy.compute_log_prob(data.to(device.get_device()), calculate_entropy=False)
        self._offload(module, None, offload, False)
        return DataProto.from_dict({"ref_log_prob": log_probs.cpu()})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_actor(self, data: DataProto) -> DataProto:
        """PPO epochs over the batch; returns metrics only (`actor/*`, learning rate, memory)."""
        self._require(self._is_actor, "update_actor", "actor")
        self._onload(self.actor_module, self.actor_optimizer, self._offload_param, self._offload_optim)
        data.meta_info["temperature"] = self.config.rollout.temperature
        started = time.perf_counter()
        with self._batch_invariant():
            metrics = self.actor.update_policy(data.to(device.get_device()))
        device.synchronize()  # the last optimizer step is still running on the GPU
        elapsed = time.perf_counter() - started
        metrics["timing_s/update_actor_worker"] = elapsed
        from hflow.utils.flops_counter import actor_update_mfu
        from hflow.workers.actor.dp_actor import response_mask_of

        mfu = actor_update_mfu(self.hf_config, data.batch["attention_mask"], response_mask_of(data.batch), elapsed,
                               ppo_epochs=int(self.config.actor.ppo_epochs), peak_flops=self._peak_flops)
        if mfu is not None:  # a GPU missing from flops_counter's table has no known peak
            metrics["perf/mfu/actor"] = mfu
        metrics["actor/lr"] = self.actor_lr_scheduler.get_last_lr()[0]
        self.actor_lr_scheduler.step()
        metrics.update({**memory_metrics(), **compile_metrics()})  # (compile: this process's roles, e.g. the ref's)
        self._offload(self.actor_module, self.actor_optimizer, self._offload_param, self._offload_optim)
        return DataProto(meta_info={"metrics": metrics})

    # ------------------------------------------------------------------ weight stream (placement=split)

    @register(dispatch_mode=Dispatch.RANK_ZERO)
    def weight_manifest(self) -> WeightManifest:
        """The tensors each update streams to the rollout pool, in order, in the rollout's dtype."""
        from hflow.workers.fsdp import full_param_shapes

        self._require(self._is_actor, "weight_manifest", "actor")
        return manifest_of(full_param_shapes(self.actor_module), getattr(torch, self.config.rollout.dtype),
                           self.config.rollout.weight_bucket_mb)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def join_weight_group(self, master_addr: str, master_port: str, world_size: int) -> None:
        """Rank 0 joins the stream to the rollout pool as its sender; the other ranks only take part in
        the all-gathers that assemble each full tensor."""
        self._weight_group = WeightGroup(master_addr, master_port, rank=0, world_size=world_size) if self.rank == 0 else None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def send_weights(self, manifest: WeightManifest, version: int = 0) -> dict[str, float]:
        """Stream the actor's current weights, policy `version`, to the rollout pool (every rank gathers,
        rank 0 announces the update and sends)."""
        from hflow.workers.fsdp import iter_full_params

        self._require(self._is_actor, "send_weights", "actor")
        started = time.perf_counter()
        self._onload(self.actor_module, None, self._offload_param, False)
        full = iter_full_params(self.actor_module, manifest.float_dtype(), manifest.bucket_bytes)  # gathered as sent
        sent, broadcasts = send_weights(getattr(self, "_weight_group", None), manifest, full, version)
        self._offload(self.actor_module, None, self._offload_param, False)
        return {"seconds": time.perf_counter() - started, "bytes": float(sent), "collectives": float(broadcasts)}

    # ------------------------------------------------------------------ checkpoints

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path: str, global_step: int = 0) -> None:
        self._require(self._is_actor, "save_checkpoint", "actor")
        self._onload(self.actor_module, self.actor_optimizer, self._offload_param, self._offload_optim)
        self.checkpoint_manager.save_checkpoint(local_path, global_step=global_step)
        self._offload(self.actor_module, self.actor_optimizer, self._offload_param, self._offload_optim)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str) -> None:
        self._require(self._is_actor, "load_checkpoint", "actor")
        self._onload(self.actor_module, self.actor_optimizer, self._offload_param, self._offload_optim)
        self.checkpoint_manager.load_checkpoint(local_path)
        self._offload(self.actor_module, self.actor_optimizer, self._offload_param, self._offload_optim)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_hf_model(self, local_path: str) -> None:
        """Export the actor as a plain Hugging Face folder (transformers and vLLM load it as is)."""
        self._require(self._is_actor or self._is_rollout, "save_hf_model", "actor")
        # Offloaded shards come back first: gathering them is a device collective.
        self._onload(self.actor_module, None, self._offload_param, False)
        save_hf_model(self.actor_module, local_path, tokenizer=self.tokenizer)
        self._offload(self.actor_module, None, self._offload_param, False)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_ema_hf_model(self, local_path: str) -> None:
        """Export the EMA of the actor's weights (`actor.ema.enable`) as a plain Hugging Face folder, with
        the actor's config and tokenizer: transformers and vLLM load it as they load the actor's export."""
        self._require(self._is_actor, "save_ema_hf_model", "actor")
        if self.actor_ema is None:
            raise RuntimeError("save_ema_hf_model() needs actor_rollout_ref.actor.ema.enable=true")
        self._write_ema_hf_model(local_path)

    def _write_ema_hf_model(self, local_path) -> None:
        # the model gives the config, the tie and the buffers; the averages, gathered shard by shard, the weights
        save_hf_model(self.actor_module, local_path, tokenizer=self.tokenizer, weights=self.actor_ema.iter_full())

    def close(self) -> None:
        if getattr(self, "rollout", None) is not None:
            self.rollout.close()

    def _require(self, present: bool, method: str, role: str) -> None:
        if not present:
            raise RuntimeError(f"{method}() needs the {role!r} role, but this worker has role {self.role!r}")


class CriticWorker(Worker, FSDPModelHolder):
    """The value model (`critic` subtree): `compute_values` and `update_critic`."""

    def __init__(self, config: DictConfig):
        super().__init__()
        self.raw_config = config

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from hflow.workers import fsdp
        from hflow.workers.critic import DataParallelPPOCritic

        self.config = normalize_critic(self.raw_config, self.world_size)
        self.init_distributed()
        self.device_mesh = fsdp.build_device_mesh(self.world_size)
        model_cfg = self.config.model
        self.tokenizer = load_tokenizer(model_cfg.tokenizer_path or model_cfg.path, model_cfg.trust_remote_code)
        fsdp_cfg = model_cfg.fsdp_config
        self._offload_param = fsdp_cfg.param_offload
        self._offload_optim = fsdp_cfg.optimizer_offload
        module = fsdp.load_value_model(
            model_cfg.path,
            dtype=fsdp_cfg.model_dtype,
            override_config=model_cfg.override_config,
            trust_remote_code=model_cfg.trust_remote_code,
            rank0_only=True,
            value_head_init=model_cfg.value_head_init,  # unused when the path is a reward model's folder
        )
        if self.config.freeze_vision_tower:  # before the optimizer: no state for it
            freeze_vision_tower(module, "critic.freeze_vision_tower")
        self.critic_module, self.critic_optimizer, self.critic_lr_scheduler = self._build_trainable(
            module, fsdp_cfg, self.config.optim,
            gradient_checkpointing=model_cfg.enable_gradient_checkpointing, train=True,
            fp32_modules=[module.score],  # values (and the GAE built on them) in fp32, not bf16
            kernels=model_cfg, role="critic")
        self.critic = DataParallelPPOCritic(self.config, self.critic_module, self.critic_optimizer)
        self.checkpoint_manager = FSDPCheckpointManager(
            self.critic_module, self.critic_optimizer, self.critic_lr_scheduler, self.tokenizer,
            contents=self.config.checkpoint.contents)
        self._offload(self.critic_module, self.critic_optimizer, self._offload_param, self._offload_optim)

    def _trainable_parts(self) -> tuple:
        return self.critic_module, self.critic_optimizer, self.critic_lr_scheduler, self.config.optim, {}, None

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto:
        self._onload(self.critic_module, None, self._offload_param, False)
        data.meta_info.update(
            micro_batch_size=self.config.forward_micro_batch_size_per_gpu,
            max_token_len=self.config.forward_max_token_len_per_gpu,
            use_dynamic_bsz=self.config.use_dynamic_bsz,
        )
        values = self.critic.compute_values(data.to(device.get_device()))
        self._offload(self.critic_module, None, self._offload_param, False)
        return DataProto.from_dict({"values": values.cpu()})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_critic(self, data: DataProto) -> DataProto:
        self._onload(self.critic_module, self.critic_optimizer, self._offload_param, self._offload_optim)
        metrics = self.critic.update_critic(data.to(device.get_device()))
        metrics["critic/lr"] = self.critic_lr_scheduler.get_last_lr()[0]
        self.critic_lr_scheduler.step()
        self._offload(self.critic_module, self.critic_optimizer, self._offload_param, self._offload_optim)
        return DataProto(meta_info={"metrics": metrics})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path: str, global_step: int = 0) -> None:
        self._onload(self.critic_module, self.critic_optimizer, self._offload_param, self._offload_optim)
        self.checkpoint_manager.save_checkpoint(local_path, global_step=global_step)
        self._offload(self.critic_module, self.critic_optimizer, self._offload_param, self._offload_optim)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str) -> None:
        self._onload(self.critic_module, self.critic_optimizer, self._offload_param, self._offload_optim)
        self.checkpoint_manager.load_checkpoint(local_path)
        self._offload(self.critic_module, self.critic_optimizer, self._offload_param, self._offload_optim)


class RewardModelWorker(Worker):
    """A sequence-classification reward model (`reward_model` subtree): `compute_rm_score`.

    The score of a sequence is the model's output at its last valid token, written into `rm_scores`
    (N, L) at the last valid response position. When the reward model's tokenizer differs from the
    policy's (`model.input_tokenizer`), responses are decoded and re-encoded with the reward model's
    chat template first.
    """

    def __init__(self, config: DictConfig):
        super().__init__()
        self.raw_config = config

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from hflow.workers import fsdp

        self.config = normalize_reward_model(self.raw_config)
        self.init_distributed()
        self.device_mesh = fsdp.build_device_mesh(self.world_size)
        model_cfg = self.config.model
        trust = model_cfg.trust_remote_code
        self.tokenizer = load_tokenizer(model_cfg.path, trust)
        # Re-encoded inputs may be longer than the policy's; when reward_model.max_length cuts them, cut
        # from the left so that the response -- the part being scored -- survives.
        self.tokenizer.truncation_side = "left"
        input_tokenizer = model_cfg.input_tokenizer
        self.input_tokenizer = load_tokenizer(input_tokenizer, trust) if input_tokenizer else None
        self._retokenize = self.input_tokenizer is not None and (
            self.input_tokenizer.get_vocab() != self.tokenizer.get_vocab()
            or self.input_tokenizer.chat_template != self.tokenizer.chat_template
        )
        module = fsdp.load_reward_model(
            model_cfg.path, dtype=device.compute_dtype(), trust_remote_code=trust, rank0_only=True)
        module.config.pad_token_id = self.tokenizer.pad_token_id
        with fsdp.weights_from_rank0(module):
            self.module = fsdp.apply_fsdp2(
                module, self.device_mesh, mixed_precision=None,
                reshard_after_forward=model_cfg.fsdp_config.reshard_after_forward,
                gather_once_per_pass=model_cfg.fsdp_config.gather_once_per_pass)
        self.module.requires_grad_(False)
        self.module.eval()
        # The head scores every position inside the model's forward; keep that per-token output (the
        # model's own pooling guesses the last token from pad ids, which left padding confuses).
        head = getattr(self.module, "score", None) or getattr(self.module, "classifier", None)
        if head is None:
            raise ValueError(
                f"reward_model.model.path={model_cfg.path}: {type(module).__name__} has no 'score' or 'classifier' "
                "head; use a sequence-classification model with num_labels=1"
            )
        self._per_token_scores: torch.Tensor | None = None
        head.register_forward_hook(lambda _module, _inputs, output: setattr(self, "_per_token_scores", output))

    def _reencode(self, data: DataProto) -> dict[str, torch.Tensor]:
        """Decode prompt and response with the policy tokenizer, re-encode with the reward model's."""
        responses = data.batch["responses"]
        response_mask = response_attention_mask(data.batch["attention_mask"], responses)
        prompts = data.batch["input_ids"][:, : -responses.shape[1]]
        prompt_mask = data.batch["attention_mask"][:, : -responses.shape[1]]
        raw_chats = data.non_tensor_batch.get("raw_prompt")
        texts = []
        for i in range(len(data)):
            response = self.input_tokenizer.decode(responses[i][response_mask[i].bool()], skip_special_tokens=True)
            if raw_chats is not None:
                chat = list(raw_chats[i]) + [{"role": "assistant", "content": response}]
                texts.append(self.tokenizer.apply_chat_template(chat, tokenize=False))
            else:
                prompt = self.input_tokenizer.decode(prompts[i][prompt_mask[i].bool()], skip_special_tokens=True)
                texts.append(prompt + response)
        max_length = self.config.max_length
        encoded = self.tokenizer(texts, padding="longest", truncation=max_length is not None, max_length=max_length,
                                 return_tensors="pt", add_special_tokens=raw_chats is None)
        return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}

    @torch.no_grad()
    def _scores(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The classifier's output at each sequence's last valid token."""
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        self.module(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        return last_token_scores(self._per_token_scores, attention_mask)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        from hflow.workers import fsdp

        responses = data.batch["responses"]
        inputs = self._reencode(data) if self._retokenize else {
            "input_ids": data.batch["input_ids"], "attention_mask": data.batch["attention_mask"]}
        dev = device.get_device()
        scores = []
        micro = int(self.config.micro_batch_size_per_gpu)
        with fsdp.no_grad_pass(self.module):
            for start in range(0, len(data), micro):
                scores.append(self._scores(inputs["input_ids"][start:start + micro].to(dev),
                                           inputs["attention_mask"][start:start + micro].to(dev)).cpu())
        scores = torch.cat(scores) if scores else torch.zeros(0)
        response_mask = response_attention_mask(data.batch["attention_mask"], responses)
        rm_scores = torch.zeros(responses.shape, dtype=torch.float32)
        last = last_valid_index(response_mask)
        has_response = response_mask.sum(-1) > 0
        rm_scores[torch.arange(len(data))[has_response], last[has_response]] = scores[has_response]
        return DataProto.from_dict({"rm_scores": rm_scores})


def last_token_scores(per_token: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) fp32: a classifier head's per-position output (B, T, 1) -- captured by a forward hook on the head --
    read at each row's last valid token (the attention mask decides, never the pad id)."""
    last = last_valid_index(attention_mask)
    return per_token[torch.arange(len(last), device=per_token.device), last, 0].float()


