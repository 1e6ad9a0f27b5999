"""`RayPPOTrainer`: the single controller that runs PPO / GRPO (and relatives) step by step.

The workers run on Ray (`trainer.backend=ray`, one process per device) or in this process
(`trainer.backend=local`, one rank); the trainer drives both the same way. Every role lives in one
resource pool and, through the colocated worker class, in one process per device: actor+rollout (`actor_rollout`), the reference policy (`ref`, only when a KL term is used), the
critic (`critic`, only for GAE) and the reward model (`rm`, only when enabled). `fit()` reads like the
algorithm; each heavy phase is one worker-group call.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from hflow.protocol import DataProto, pad_dataproto_to_divisor, unpad_dataproto
from hflow.single_controller.base import ClassWithInitArgs, GroupCall, WorkerGroup, create_colocated_worker_cls
from hflow.algorithms import core_algos
from hflow.reward import dynamic_sampling as dapo
from hflow.reward import shaping as reward_shaping
from hflow.trainer.config import placement_pools, reuses_update_log_probs
from hflow.trainer.ppo.health import HealthWatch, UnhealthyRun, faults_at, poison_scores, zero_advantage_group_frac
from hflow.reward.managers.dapo import GENERATED_RESPONSE_MASK
from hflow.trainer.checkpoints import LATEST_MARKER, StepCheckpoints  # noqa: F401  (LATEST_MARKER: re-exported)
from hflow.trainer.ppo.metric_utils import (
    compute_data_metrics,
    compute_throughout_metrics,
    compute_timing_metrics,
    format_validation_metrics,
    process_validation_metrics,
    reduce_metrics,
)
from hflow.utils.errors import UserError
from hflow.utils.torch_functional import masked_mean
from hflow.utils.tracking import Tracking



def pop_generation_inputs(batch: DataProto) -> DataProto:
    """Move what generation reads (prompt ids, masks, positions, raw prompts) out of `batch`."""
    return batch.pop(batch_keys=["input_ids", "attention_mask", "position_ids"],
                     non_tensor_batch_keys=[k for k in ("raw_prompt_ids", "raw_prompt", "tools_kwargs")
                                            if k in batch.non_tensor_batch])


@dataclass
class PendingRollout:
    """A batch of prompts whose responses are being (or have been) generated.

    `version` is the oldest policy version whose weights may sample them (actor updates so far when it
    was submitted; the rollout pool's tokens record their own, which may be newer); `loader_state`
    is the data loader's position before this batch was drawn (a checkpoint saved while the batch is
    in flight resumes by drawing it again). `receive` is the weight update submitted to the rollout
    pool just before this batch, if any (its errors surface when the batch is taken).
    """

    batch: DataProto
    gen_batch: DataProto
    call: GroupCall
    version: int
    loader_state: dict
    output: DataProto | None = None
    receive: GroupCall | None = None
    scored: Future | None = None  # (batch, reward, metrics): scored on the scoring thread as generation ends


class Role(Enum):
    ActorRollout = "actor_rollout"
    RefPolicy = "ref"
    Critic = "critic"
    RewardModel = "rm"


@contextmanager
def timer(name: str, timing: dict[str, float]):
    start = time.perf_counter()
    yield
    timing[name] = timing.get(name, 0.0) + time.perf_counter() - start


def compute_response_mask(batch: DataProto) -> torch.Tensor:
    response_length = batch.batch["responses"].shape[-1]
    return batch.batch["attention_mask"][:, -response_length:]


def apply_kl_penalty(batch: DataProto, kl_ctrl, kl_penalty: str, scores: torch.Tensor | None = None) -> dict[str, float]:
    """token_level_rewards = token_level_scores (or the given `scores`, e.g. clipped ones) - beta * KL(pi_old ||
    pi_ref) per token; updates the controller."""
    mask = batch.batch["response_mask"]
    kld = core_algos.kl_penalty(batch.batch["old_log_probs"], batch.batch["ref_log_prob"], kl_penalty) * mask
    beta = kl_ctrl.value
    scores = batch.batch["token_level_scores"] if scores is None else scores
    batch.batch["token_level_rewards"] = scores - beta * kld
    current_kl = masked_mean(kld, mask, axis=-1).mean().item()
    kl_ctrl.update(current_kl=current_kl, n_steps=len(batch))
    return {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}


def compute_advantage(batch: DataProto, algorithm: DictConfig) -> None:
    """Write `advantages` and `returns` with the estimator named by `algorithm.adv_estimator`."""
    inputs = {
        "token_level_rewards": batch.batch["token_level_rewards"],
        "response_mask": batch.batch["response_mask"],
        "values": batch.batch.get("values"),
        "reward_baselines": batch.batch.get("reward_baselines"),
        "index": batch.non_tensor_batch["uid"],
        "gamma": algorithm.gamma,
        "lam": algorithm.lam,
        "norm_adv_by_std_in_grpo": algorithm.norm_adv_by_std_in_grpo,
    }
    advantages, returns = core_algos.call_adv_estimator(
        algorithm.adv_estimator, **{k: v for k, v in inputs.items() if v is not None})
    batch.batch["advantages"] = advantages
    batch.batch["returns"] = returns


def describe_rollout_pool(ranks: list[dict[str, int]]) -> str:
    """One line on what the rollout pool's engines really run (from each rank's `engine_info`)."""
    tp = ranks[0]["tensor_parallel_size"]
    rows = ", ".join(str(r["embedding_rows"]) for r in ranks)
    return (f"rollout pool: {len(ranks)} ranks = {len(ranks) // tp} vLLM engine(s) x tensor_parallel_size {tp}; "
            f"embedding rows held per rank: {rows} (vocabulary {ranks[0]['vocab_size']})")


def make_worker_group(trainer_cfg: DictConfig, cls_with_init: ClassWithInitArgs,
                      process_on_nodes: list[int] | None = None, name: str = "global_pool") -> WorkerGroup:
    """The workers of `trainer.backend`: Ray actors, one per device of `process_on_nodes` (by default
    every device of every node) (`ray`), or one rank in this process (`local`: no Ray needed, debuggers
    and plain stack traces work)."""
    if trainer_cfg.backend == "local":
        from hflow.single_controller.local import LocalWorkerGroup

        return LocalWorkerGroup(cls_with_init)
    import ray

    from hflow.single_controller.ray import RayResourcePool, RayWorkerGroup
    from hflow.utils import device

    nodes, per_node = int(trainer_cfg.nnodes), int(trainer_cfg.n_gpus_per_node)
    threads = trainer_cfg.threads_per_worker
    use_gpu = device.cluster_has_gpus(ray.cluster_resources())
    if threads is None and use_gpu:
        # A GPU worker reserves one Ray CPU but its host-side work (data, tokenisation, optimizer
        # offload) wants more threads than one: share the node's cores among its workers.
        threads = max(1, int(ray.cluster_resources().get("CPU", 1) // nodes // per_node))
    pool = RayResourcePool(process_on_nodes or [per_node] * nodes, use_gpu=use_gpu, name_prefix=name,
                           cpus_per_worker=int(trainer_cfg.cpus_per_worker),
                           threads_per_worker=None if threads is None else int(threads))
    return RayWorkerGroup(pool, cls_with_init)


class RayPPOTrainer:
    def __init__(self, config: DictConfig, tokenizer, reward_fn, val_reward_fn, train_dataset, val_dataset,
                 collate_fn, train_dataloader, n_workers: int | None = None):
        self.config = config
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.val_reward_fn = val_reward_fn
        self.train_dataset = train_dataset
        self.val_dataset = val_dataset
        self.collate_fn = collate_fn
        self.train_dataloader = train_dataloader
        trainer_cfg = config.trainer
        self.n_workers = n_workers or trainer_cfg.n_gpus_per_node * trainer_cfg.nnodes
        algo = config.algorithm
        actor = config.actor_rollout_ref.actor
        self.use_critic = algo.adv_estimator == core_algos.AdvantageEstimator.GAE
        self.use_reference_policy = bool(algo.use_kl_in_reward or actor.use_kl_loss)
        self.use_rm = bool(config.reward_model.enable)
        self.reuse_update_log_probs = reuses_update_log_probs(config)
        self.kl_ctrl_in_reward = core_algos.get_kl_controller(algo.kl_ctrl) if algo.use_kl_in_reward else None
        # algorithm.stop_token (checked by preflight to be one token of this tokenizer) and reward_model.normalize
        self.stop_token_id = (None if algo.stop_token is None
                              else reward_shaping.resolve_stop_token_id(tokenizer, algo.stop_token))
        self.reward_norm = (reward_shaping.RewardNormalization()
                            if self.use_rm and config.reward_model.normalize.enable else None)
        self.total_training_steps = self._total_training_steps()
        for section in (actor.optim, config.critic.optim):
            section.total_training_steps = self.total_training_steps
        self.global_steps = 0
        self.policy_version = 0  # actor updates so far
        self.engine_version = -1  # the version the rollout pool's engines hold (split placement)
        self.async_steps = int(trainer_cfg.async_steps)  # k: batches generated ahead, the staleness bound
        self._pending: deque[PendingRollout] = deque()  # submitted, oldest first
        self._receive: GroupCall | None = None  # the last weight update submitted to the rollout pool
        # Asynchronous runs score each batch on a driver thread as soon as its generation ends, while
        # training goes on (a reward model is a worker of the training pool: it scores in the step).
        self._scoring = (ThreadPoolExecutor(1, thread_name_prefix="hflow-scoring")
                         if self.async_steps and not self.use_rm else None)
        self._stream_metrics: dict[str, float] = {}  # the latest weight stream's, for the next step's log
        # trainer.health (its rules: preflight's check_health_config)
        self.health = HealthWatch(trainer_cfg.health, trainer_cfg.log_dir) if trainer_cfg.health.enable else None
        self._driver_snapshots: dict[str, dict] = {}  # the driver's share of the candidate / healthy state
        self._healthy_checkpoint: int | None = None  # snapshot=checkpoint: the newest saved step a healthy step followed
        self._unconfirmed_checkpoint: int | None = None

    def _total_training_steps(self) -> int:
        if self.config.trainer.total_training_steps:
            return int(self.config.trainer.total_training_steps)
        return len(self.train_dataloader) * int(self.config.trainer.total_epochs)

    # ------------------------------------------------------------------ workers

    def init_workers(self) -> None:
        """The training pool: one process per device, every training role colocated in it. With
        `trainer.placement=split`, also the rollout pool of standalone vLLM engines, joined to the actor
        by the weight stream; otherwise the actor's own engine generates (built last, in its process)."""
        from hflow.workers.fsdp_workers import ActorRolloutRefWorker, CriticWorker, RewardModelWorker

        trainer_cfg = self.config.trainer
        train_nodes, rollout_nodes = placement_pools(int(trainer_cfg.nnodes), int(trainer_cfg.n_gpus_per_node),
                                                     trainer_cfg.placement, int(trainer_cfg.rollout_n_gpus))
        arr = self.config.actor_rollout_ref
        roles = {Role.ActorRollout.value: ClassWithInitArgs(
            ActorRolloutRefWorker, config=arr, role="actor" if rollout_nodes else "actor_rollout")}
        if self.use_critic:
            roles[Role.Critic.value] = ClassWithInitArgs(CriticWorker, config=self.config.critic)
        # LoRA: the actor answers the reference's log-probs with its adapters off (no second model)
        ref_in_actor = self.use_reference_policy and int(arr.model.lora_rank) > 0
        if self.use_reference_policy and not ref_in_actor:
            roles[Role.RefPolicy.value] = ClassWithInitArgs(ActorRolloutRefWorker, config=arr, role="ref")
        if self.use_rm:
            if self.config.reward_model.style == "generative":  # a chat model judges, on its own vLLM engine
                from hflow.reward.judge_worker import GenerativeRewardModelWorker as RewardModelWorker
            roles[Role.RewardModel.value] = ClassWithInitArgs(RewardModelWorker, config=self.config.reward_model)
        self.worker_group = make_worker_group(trainer_cfg, create_colocated_worker_cls(roles), train_nodes,
                                              name="train_pool")
        groups = self.worker_group.spawn(roles.keys())
        self.critic_wg = groups.get(Role.Critic.value)
        self.ref_policy_wg = groups.get(Role.RefPolicy.value)
        self.rm_wg = groups.get(Role.RewardModel.value)
        self.actor_rollout_wg = groups[Role.ActorRollout.value]
        self.worker_group.execute_all_sync("seed_everything", int(trainer_cfg.seed))
        rollout_init = None
        if rollout_nodes:
            from hflow.workers.rollout_worker import RolloutWorker

            self.rollout_group = make_worker_group(trainer_cfg, ClassWithInitArgs(RolloutWorker, config=arr),
                                                   rollout_nodes, name="rollout_pool")
            self.rollout_wg = self.rollout_group
            self.rollout_group.execute_all_sync("seed_everything", int(trainer_cfg.seed))
            rollout_init = self.rollout_wg.init_model.submit()  # the engines start while the models load
        else:
            self.rollout_wg = self.actor_rollout_wg
        for wg in (self.critic_wg, self.ref_policy_wg, self.rm_wg, self.actor_rollout_wg):
            if wg is not None:
                wg.init_model()
        if ref_in_actor:
            self.ref_policy_wg = self.actor_rollout_wg
        if rollout_init is not None:
            rollout_init.result()
            self._connect_weight_stream()
        if arr.rollout.name == "vllm":  # colocated or split: what the engines hold, rank by rank
            print(describe_rollout_pool(self.rollout_wg.engine_info()))

    def _connect_weight_stream(self) -> None:
        """A process group over the actor's rank 0 and every rollout rank (see hflow.workers.weight_sync)."""
        addr, port = self.actor_rollout_wg.execute_rank_zero_sync("pick_rendezvous_address")
        world = 1 + self.rollout_wg.world_size
        self._weight_manifest = self.actor_rollout_wg.weight_manifest()
        joins = [self.actor_rollout_wg.join_weight_group.submit(addr, port, world),
                 self.rollout_wg.join_weight_group.submit(addr, port, world, self._weight_manifest)]
        for join in joins:
            join.result()

    def _push_weights(self) -> None:
        """Stream the actor's weights to the rollout pool unless the engines already have this version
        (split placement only; colocated engines are synced by the worker on every generation). Its
        timing is reported with the step that follows.

        The send returns once every rollout rank took the update: an idle rank through `receive_weights`,
        a rank that is generating between two engine steps (with trainer.async_steps >= 2 or partial
        rollouts; at k <= 1 the pool is idle here). The rollout pool's own call is collected later."""
        if self.rollout_wg is self.actor_rollout_wg or self.engine_version == self.policy_version:
            return
        started = time.perf_counter()
        send = self.actor_rollout_wg.send_weights.submit(self._weight_manifest, self.policy_version)
        self._receive = self.rollout_wg.receive_weights.submit(self._weight_manifest, self.policy_version)
        sent = send.result()[0]
        self.engine_version = self.policy_version
        self._stream_metrics = {"timing_s/weight_stream": time.perf_counter() - started,
                                "perf/weight_stream_gb": sent["bytes"] / 1e9}

    def shutdown(self) -> None:
        if getattr(self, "_scoring", None) is not None:
            self._scoring.shutdown(cancel_futures=True)
        for name in ("rollout_group", "worker_group"):
            group = getattr(self, name, None)
            if group is not None:
                group.shutdown()
                setattr(self, name, None)

    # ------------------------------------------------------------------ the training loop

    def fit(self) -> dict[str, float]:
        """Train for `total_training_steps`; returns the last validation metrics."""
        trainer_cfg = self.config.trainer
        self.tracker = Tracking(trainer_cfg.project_name, trainer_cfg.experiment_name, trainer_cfg.logger,
                                trainer_cfg.log_dir, OmegaConf.to_container(self.config, resolve=True))
        self._check_checkpoint_dir()
        self._load_checkpoint()
        if self.reward_norm is not None and not self.reward_norm.fitted:  # a resumed run keeps its own
            self._fit_reward_normalization()
        val_metrics = {}
        if self.val_reward_fn is not None and trainer_cfg.val_before_train and self.global_steps == 0:
            val_metrics = self._validate()
            self.tracker.log(val_metrics, step=0)
        progress = tqdm(total=self.total_training_steps, initial=self.global_steps, desc="training")
        while self.global_steps < self.total_training_steps:
            self.global_steps += 1
            is_last_step = self.global_steps >= self.total_training_steps
            timing: dict[str, float] = {}
            if self.health is not None:
                self._keep_step_start()
            with timer("step", timing):
                rollout, rollout_metrics = self._next_rollout(timing)
                metrics = self.train_step(rollout, timing)
            metrics.update(rollout_metrics)
            metrics.update(self._step_summary(rollout.batch, timing))
            rolled_back = self.health is not None and self._watch_health(metrics)
            if self.val_reward_fn is not None and (
                    is_last_step or (trainer_cfg.test_freq > 0 and self.global_steps % trainer_cfg.test_freq == 0)):
                with timer("testing", timing):
                    val_metrics = self._validate()
                metrics.update(val_metrics)
            # after a rollback the restored state is saved at once, so a resume never starts from the unhealthy one
            if trainer_cfg.save_freq > 0 and (is_last_step or self.global_steps % trainer_cfg.save_freq == 0
                                              or rolled_back):
                with timer("save_checkpoint", timing):
                    self._save_checkpoint(healthy=rolled_back)
            metrics.update({f"timing_s/{k}": v for k, v in timing.items() if k in ("testing", "save_checkpoint")})
            metrics["training/global_step"] = self.global_steps
            metrics["training/epoch"] = self.train_dataloader.epoch
            self.tracker.log(metrics, step=self.global_steps)
            progress.update(1)
        progress.close()
        self.tracker.close()
        return val_metrics

    # ------------------------------------------------------------------ generation

    def _start_rollout(self) -> PendingRollout:
        """Draw the next batch of prompts and start generating for it with the actor's latest weights
        (the rollout pool waits for them: `min_weights_version`)."""
        loader_state = self.train_dataloader.state_dict()  # a checkpoint taken meanwhile re-draws this batch
        batch = DataProto.from_single_dict(next(self._batches))
        gen_batch = pop_generation_inputs(batch)
        self._push_weights()
        if self.rollout_wg is not self.actor_rollout_wg:  # the rollout pool waits for this version's weights
            gen_batch.meta_info["min_weights_version"] = self.policy_version
            # more batches queue behind this one: updates must reach the pool while it generates
            gen_batch.meta_info["updates_in_flight"] = self.async_steps >= 2
        receive, self._receive = self._receive, None
        rollout = PendingRollout(batch, gen_batch, self.rollout_wg.generate_sequences.submit(gen_batch),
                                 self.policy_version, loader_state, receive=receive)
        if self._scoring is not None:
            rollout.scored = self._scoring.submit(self._generate_and_score, rollout)
        return rollout

    def _generate_and_score(self, rollout: PendingRollout) -> tuple[DataProto, dict, dict[str, float]]:
        """On the scoring thread: wait for the batch's responses, then score them (steps 1-3)."""
        self._collect(rollout)
        metrics, timing = {}, {}
        batch, reward = self._score_batch(rollout, metrics, timing)
        metrics["timing_s/reward_overlapped"] = timing.get("reward", 0.0)
        return batch, reward, metrics

    @staticmethod
    def _collect(rollout: PendingRollout) -> None:
        if rollout.receive is not None:
            rollout.receive.result()  # the weight update before it: its errors surface here
        rollout.output = rollout.call.result()

    def _take_rollout(self, timing: dict[str, float]) -> PendingRollout:
        """The oldest batch in flight (started now if none), with its responses; then the pipeline is
        topped up to `trainer.async_steps` batches ahead, each generated with the weights of now."""
        if not self._pending:
            self._pending.append(self._start_rollout())
        rollout = self._pending.popleft()
        with timer("gen", timing):  # with async_steps >= 1: only the part of generation training did not hide
            if rollout.scored is not None:
                rollout.scored.exception()  # generated and scored (its errors are raised where it is used)
            else:
                self._collect(rollout)
        while len(self._pending) < min(self.async_steps, self.total_training_steps - self.global_steps):
            self._pending.append(self._start_rollout())
        return rollout

    def _next_rollout(self, timing: dict[str, float]) -> tuple[PendingRollout, dict[str, float]]:
        """This step's prompts and their sampled responses (`rollout.output`).

        With `trainer.async_steps=0` they are generated now, with the current weights. With k >= 1 they
        were generated while earlier steps trained, on the rollout pool's own devices, with weights at
        most k updates old, and the batch k steps ahead starts generating before this one trains.
        """
        rollout = self._take_rollout(timing)
        metrics, self._stream_metrics = self._stream_metrics, {}
        metrics.update(reduce_metrics(rollout.output.meta_info.pop("metrics", {})))
        return rollout, metrics

    # ------------------------------------------------------------------ the algorithm

    def train_step(self, rollout: PendingRollout, timing: dict[str, float]) -> dict[str, float]:
        """One PPO/GRPO iteration on a batch of prompts and their sampled responses: the steps below, in
        the order of the algorithm (step 1, generation, is `_next_rollout`)."""
        algo = self.config.algorithm
        metrics: dict[str, float] = {}
        # 2-3. group ids, samples aligned with their prompts, rewards
        batch, reward = self._scored_batch(rollout, metrics, timing)
        faults = faults_at(self.config.trainer.health.inject, self.global_steps)
        for fault in faults:
            if fault["kind"] == "reward":  # a broken reward, on purpose (trainer.health.inject)
                batch.batch["token_level_scores"] = poison_scores(
                    batch.batch["token_level_scores"], batch.batch["response_mask"], fault["value"])
        if algo.filter_groups.enable:  # DAPO dynamic sampling: train only on groups whose samples differ
            batch = self._fill_batch_with_informative_groups(batch, reward, metrics, timing)
        metrics.update(self._bound_staleness(batch, rollout.version))
        batch.meta_info["global_token_num"] = batch.batch["attention_mask"].sum(-1).tolist()

        # 4. old log-probs: the sampled responses under the policy before this update (with
        #    trainer.async_steps=1 that is the actor now, one update newer than the sampler)
        if algo.use_rollout_log_probs:  # the sampler already computed them
            batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]
        elif self.reuse_update_log_probs and not self._rollout_check_step():
            pass  # on-policy update: its forward pass runs the sampling weights and detaches them
        else:
            with timer("old_log_prob", timing):
                old_log_prob = self.actor_rollout_wg.compute_log_prob(batch)
            entropys = old_log_prob.batch.pop("entropys")
            metrics["actor/entropy"] = core_algos.agg_loss(
                entropys, batch.batch["response_mask"], self.config.actor_rollout_ref.actor.loss_agg_mode).item()
            batch = batch.union(old_log_prob)
            if "rollout_log_probs" in batch.batch:
                metrics.update(_rollout_vs_training_metrics(batch))
            if algo.get("rollout_is") is not None:  # correct for the sampler's probabilities (preflight: present here)
                batch.batch["rollout_is_weights"], is_metrics = core_algos.compute_rollout_is_weights(
                    batch.batch["old_log_probs"], batch.batch["rollout_log_probs"], batch.batch["response_mask"],
                    level=algo.rollout_is, threshold=float(algo.rollout_is_threshold))
                metrics.update(is_metrics)

        # 5. reference log-probs and values
        if self.use_reference_policy:
            with timer("ref", timing):
                batch = batch.union(self.ref_policy_wg.compute_ref_log_prob(batch))
        if self.use_critic:
            with timer("values", timing):
                batch = batch.union(self.critic_wg.compute_values(batch))

        # 6. rewards (optionally KL-penalised) and advantages, on the driver
        with timer("adv", timing):
            scores = batch.batch["token_level_scores"]
            if algo.reward_clip is not None:  # DeepSpeed-Chat: clip the score, not the KL-penalised reward
                scores, clip_metrics = reward_shaping.clip_sequence_scores(
                    scores, batch.batch["response_mask"], float(algo.reward_clip))
                metrics.update(clip_metrics)
            if algo.use_kl_in_reward:
                metrics.update(apply_kl_penalty(batch, self.kl_ctrl_in_reward, algo.kl_penalty, scores))
            else:
                batch.batch["token_level_rewards"] = scores
            compute_advantage(batch, algo)
        metrics["training/zero_adv_group_frac"] = zero_advantage_group_frac(
            batch.batch["advantages"], batch.batch["response_mask"], batch.non_tensor_batch["uid"])

        # 7. update the critic, then (after the warm-up) the actor
        if self.use_critic:
            with timer("update_critic", timing):
                critic_output = self.critic_wg.update_critic(batch)
            metrics.update(reduce_metrics(critic_output.meta_info["metrics"]))
        if self.config.trainer.critic_warmup <= self.global_steps - 1:
            update_faults = [f for f in faults if f["kind"] != "reward"]
            if update_faults:  # trainer.health.inject: the worker applies it to this update only
                batch.meta_info["inject_fault"] = update_faults[0]
            with timer("update_actor", timing):
                actor_output = self.actor_rollout_wg.update_actor(batch)
            self.policy_version += 1
            metrics.update(reduce_metrics(actor_output.meta_info["metrics"]))

        if self.reward_norm is not None:
            metrics.update(self.reward_norm.metrics())
        if self.config.trainer.rollout_data_dir:
            self._dump_generations(batch, Path(self.config.trainer.rollout_data_dir) / f"{self.global_steps}.jsonl")
        rollout.batch = batch  # with every column the step added, for the step's summary metrics
        return metrics

    def _rollout_check_step(self) -> bool:
        """With reused log-probs, whether this step still runs the separate pass: step 1 and every
        `algorithm.rollout_check_freq` steps after, so that the sampler-vs-trainer check keeps running."""
        freq = int(self.config.algorithm.rollout_check_freq)
        return freq > 0 and (self.global_steps - 1) % freq == 0

    def _scored_batch(self, rollout: PendingRollout, metrics: dict[str, float],
                      timing: dict[str, float]) -> tuple[DataProto, dict]:
        """Steps 2 and 3 (`_score_batch`), or their result from the scoring thread when it ran there."""
        if rollout.scored is None:
            return self._score_batch(rollout, metrics, timing)
        batch, reward, scored_metrics = rollout.scored.result()
        metrics.update(scored_metrics)
        return batch, reward

    def _score_batch(self, rollout: PendingRollout, metrics: dict[str, float],
                     timing: dict[str, float]) -> tuple[DataProto, dict]:
        """Steps 2 and 3: one group id per prompt, prompts aligned with their n samples, and the samples'
        `token_level_scores` (of each response cut after algorithm.stop_token, when set). Returns the
        batch and the reward function's full result; adds the reward metrics to `metrics`."""
        batch = rollout.batch
        if self.config.algorithm.adv_estimator == core_algos.AdvantageEstimator.REMAX:
            with timer("gen_max", timing):
                batch.batch["reward_baselines"] = self._greedy_baseline(batch, rollout.gen_batch)
        batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch))], dtype=object)
        batch = batch.repeat(self.config.actor_rollout_ref.rollout.n, interleave=True).union(rollout.output)
        if "response_mask" not in batch.batch.keys():  # multi-turn rollouts bring theirs (0 on tool tokens)
            batch.batch["response_mask"] = compute_response_mask(batch)
        with timer("reward", timing):
            batch.batch["token_level_scores"], reward, score_metrics = self._score(batch, self.reward_fn)
        metrics.update(score_metrics)
        metrics.update(reward.get("reward_metrics", {}))
        metrics.update(_reward_extra_metrics(reward.get("reward_extra_info", {})))
        return batch, reward

    def _bound_staleness(self, batch: DataProto, submitted_version: int) -> dict[str, float]:
        """Per token, how many policy versions the sampler was behind the policy this step updates
        (`rollout_versions`: each token's own; without them, the version the batch was submitted with).
        A sample with a token more than `trainer.async_steps` versions old is dropped from the loss (its
        response mask zeroed) and counted; the pipeline never makes one, so this is the bound's guard."""
        mask = batch.batch["response_mask"].bool()
        if "rollout_versions" in batch.batch.keys():
            staleness = self.policy_version - batch.batch["rollout_versions"]
        else:
            staleness = torch.full(mask.shape, self.policy_version - submitted_version)
        too_old = ((staleness > self.async_steps) & mask).any(-1)
        if too_old.any():
            batch.batch["response_mask"][too_old] = 0
        values = staleness[mask].float()
        if values.numel() == 0:
            values = torch.zeros(1)
        return {"training/staleness/mean": values.mean().item(), "training/staleness/max": values.max().item(),
                "training/staleness": values.max().item(),  # the batch's oldest token (its name before k > 1)
                "training/staleness/dropped_samples": float(too_old.sum())}

    def _fill_batch_with_informative_groups(self, batch: DataProto, reward: dict, metrics: dict[str, float],
                                            timing: dict[str, float]) -> DataProto:
        """DAPO dynamic sampling (`algorithm.filter_groups`): keep the prompt groups whose samples' metric
        is not all equal; while fewer than data.train_batch_size are kept, draw, generate and score the
        next batch of prompts. The kept groups are trimmed to exactly data.train_batch_size. Drawing
        moves the data loader, so a checkpoint after this step resumes after the last batch drawn.
        Reward metrics are the first generation batch's; the step's data metrics are the kept batch's."""
        cfg = self.config.algorithm.filter_groups
        wanted, limit = int(self.config.data.train_batch_size), int(cfg.max_num_gen_batches)
        kept, num_kept, num_groups, num_gen = [], 0, 0, 1
        while True:
            uids = batch.non_tensor_batch["uid"]
            values = dapo.group_metric_values(cfg.metric, batch.batch["token_level_scores"],
                                              reward.get("reward_extra_info", {}))
            keep = dapo.informative_groups(uids, values)
            if keep.any():
                kept.append(batch.select_idxs(keep))
            num_groups += len(set(uids))
            num_kept += len(set(uids[keep]))
            if num_kept >= wanted:
                break
            if 0 < limit <= num_gen:
                raise UserError(
                    f"algorithm.filter_groups: {num_gen} generation batches (algorithm.filter_groups.max_num_gen_batches"
                    f"={limit}) gave only {num_kept} of the data.train_batch_size={wanted} prompt groups whose samples "
                    f"differ in {cfg.metric!r}; the prompts are too hard or too easy for the policy. Raise "
                    "max_num_gen_batches (0 = no limit), use more samples per prompt (actor_rollout_ref.rollout.n), "
                    "or other data")
            more = self._take_rollout(timing)  # async: the next batch in flight, generated within the bound
            more.output.meta_info.pop("metrics", None)
            batch, reward = self._scored_batch(more, {}, timing)
            num_gen += 1
        metrics["train/num_gen_batches"] = num_gen
        metrics["train/filtered_groups_frac"] = 1.0 - num_kept / num_groups  # of all groups generated this step
        return dapo.take_groups(DataProto.concat(kept), wanted)

    def _step_summary(self, batch: DataProto, timing: dict[str, float]) -> dict[str, float]:
        metrics = compute_data_metrics(batch, use_critic=self.use_critic,
                                       max_prompt_length=self.config.data.max_prompt_length)
        metrics.update(compute_timing_metrics(batch, timing))
        metrics.update(compute_throughout_metrics(batch, timing, n_gpus=self.n_workers))
        return metrics

    def _greedy_baseline(self, batch: DataProto, gen_batch: DataProto) -> torch.Tensor:
        """ReMax: the reward of the greedy response is each prompt's baseline."""
        greedy_batch = DataProto(batch=gen_batch.batch, non_tensor_batch=dict(gen_batch.non_tensor_batch),
                                 meta_info={**gen_batch.meta_info, "do_sample": False})
        greedy = self.rollout_wg.generate_sequences(greedy_batch)
        scored = DataProto(batch=batch.batch.clone(), non_tensor_batch=dict(batch.non_tensor_batch)).union(greedy)
        baseline = self._score(scored, self.reward_fn)[0].sum(-1)  # scored as the samples are
        clip = self.config.algorithm.reward_clip
        return baseline if clip is None else baseline.clamp(-float(clip), float(clip))

    def _score(self, batch: DataProto, reward_fn) -> tuple[torch.Tensor, dict, dict[str, float]]:
        """Token-level scores of `batch`'s responses, `reward_fn`'s full result and the shaping metrics.

        The reward model (its scores normalised when `reward_model.normalize` is on) and `reward_fn` see
        each response cut after `algorithm.stop_token`; a response without it then scores
        `algorithm.missing_stop_penalty` (when set). DAPO's soft overlong penalty, when on, is `reward_fn`'s
        (the training reward manager's; see `hflow.reward.managers.dapo`). `batch` stays as generated.
        """
        view, has_stop = batch, None
        if self.stop_token_id is not None:
            view, has_stop = reward_shaping.stop_token_view(batch, self.stop_token_id, self.tokenizer.pad_token_id)
        if self.use_rm:
            view = view.union(self._rm_scores(view))
        if has_stop is not None:  # the overlong buffer measures the responses as generated, not as cut
            view.batch[GENERATED_RESPONSE_MASK] = compute_response_mask(batch)
        reward = reward_fn(view, return_dict=True)
        scores, metrics = reward["reward_tensor"], {}
        if has_stop is not None:
            scores, metrics = reward_shaping.finish_stop_token_scores(
                scores, compute_response_mask(batch), has_stop, self.config.algorithm.missing_stop_penalty)
        return scores, reward, metrics

    def _rm_scores(self, batch: DataProto) -> DataProto:
        """The reward model's `rm_scores`, normalised with the fitted gain and bias (reward_model.normalize)."""
        output = self.rm_wg.compute_rm_score(batch)
        if self.reward_norm is not None and self.reward_norm.fitted:
            output.batch["rm_scores"] = self.reward_norm.apply(output.batch["rm_scores"], compute_response_mask(batch))
        return output

    def _fit_reward_normalization(self) -> None:
        """lm-human-preferences: sample one response (training sampling settings) for each of
        `reward_model.normalize.num_prompts` training prompts, drawn with a seeded generator straight from
        the dataset (the training loader does not move), score them with the reward model, and fit a gain
        and bias that give those scores mean 0 and std 1."""
        num = int(self.config.reward_model.normalize.num_prompts)
        generator = torch.Generator().manual_seed(int(self.config.data.seed))
        order = torch.randperm(len(self.train_dataset), generator=generator)
        indices = order[torch.arange(num) % len(order)].tolist()  # repeats prompts only when there are fewer
        batch = DataProto.from_single_dict(self.collate_fn([self.train_dataset[i] for i in indices]))
        gen_batch = pop_generation_inputs(batch)
        gen_batch.meta_info["n"] = 1  # one sample per prompt, otherwise sampled as in training
        self._push_weights()
        padded, pad_size = pad_dataproto_to_divisor(gen_batch, self.rollout_wg.world_size)
        output = unpad_dataproto(self.rollout_wg.generate_sequences(padded), pad_size)
        output.meta_info.pop("metrics", None)
        batch = batch.union(output)
        if self.stop_token_id is not None:  # fit on what the reward model sees in training
            batch, _ = reward_shaping.stop_token_view(batch, self.stop_token_id, self.tokenizer.pad_token_id)
        rm_scores = self.rm_wg.compute_rm_score(batch).batch["rm_scores"]
        has_response = compute_response_mask(batch).sum(-1) > 0
        self.reward_norm.fit(rm_scores.sum(-1)[has_response])
        print(f"reward_model.normalize: gain={self.reward_norm.gain:.6g} bias={self.reward_norm.bias:.6g} "
              f"from {int(has_response.sum())} samples")

    # ------------------------------------------------------------------ validation

    def _validate(self) -> dict[str, float]:
        val_kwargs = self.config.actor_rollout_ref.rollout.val_kwargs
        data_sources, inputs, outputs, scores = [], [], [], []
        extra_infos: dict[str, list] = {}
        self._push_weights()  # validate the current policy (split placement: the engines may be one update behind)
        for batch_dict in self._val_batches():
            batch = DataProto.from_single_dict(batch_dict).repeat(val_kwargs.n, interleave=True)
            gen_batch = pop_generation_inputs(batch)
            gen_batch.meta_info.update(do_sample=val_kwargs.do_sample, validate=True)
            padded, pad_size = pad_dataproto_to_divisor(gen_batch, self.rollout_wg.world_size)
            output = unpad_dataproto(self.rollout_wg.generate_sequences(padded), pad_size)
            output.meta_info.pop("metrics", None)
            batch = batch.union(output)
            # The task score: the rule score of the response (cut after algorithm.stop_token when set, but
            # never replaced by missing_stop_penalty, nor clipped: those shape training only).
            view = batch if self.stop_token_id is None else reward_shaping.stop_token_view(
                batch, self.stop_token_id, self.tokenizer.pad_token_id)[0]
            result = self.val_reward_fn(view, return_dict=True)
            scores.extend(result["reward_tensor"].sum(-1).tolist())
            if self.use_rm:  # reported beside it (val-aux/<data_source>/rm_score/...), normalised as in training
                extra_infos.setdefault("rm_score", []).extend(self._rm_scores(view).batch["rm_scores"].sum(-1).tolist())
            for key, values in result.get("reward_extra_info", {}).items():
                extra_infos.setdefault(key, []).extend(values)
            inputs.extend(self.tokenizer.batch_decode(batch.batch["prompts"], skip_special_tokens=True))
            outputs.extend(self.tokenizer.batch_decode(batch.batch["responses"], skip_special_tokens=True))
            data_sources.extend(batch.non_tensor_batch.get("data_source", ["unknown"] * len(batch)))
        if self.config.trainer.validation_data_dir:
            self._write_jsonl(Path(self.config.trainer.validation_data_dir) / f"{self.global_steps}.jsonl",
                              [{"input": i, "output": o, "score": s, "step": self.global_steps}
                               for i, o, s in zip(inputs, outputs, scores)])
        for i in range(min(self.config.trainer.log_val_generations, len(inputs))):
            print(f"[validation {i}] score={scores[i]:.3f}\n  prompt: {inputs[i]!r}\n  response: {outputs[i]!r}")
        infos = {"reward": scores, **{k: v for k, v in extra_infos.items() if len(v) == len(scores)}}
        return format_validation_metrics(process_validation_metrics(np.array(data_sources, dtype=object), inputs, infos))

    # ------------------------------------------------------------------ the health watch (trainer.health)

    def _trainable_groups(self) -> list[WorkerGroup]:
        return [self.actor_rollout_wg] + ([self.critic_wg] if self.use_critic else [])

    def _driver_state(self) -> dict:
        return {"kl_ctrl": getattr(self.kl_ctrl_in_reward, "value", None)}

    def _keep_step_start(self) -> None:
        """snapshot=memory: copy the state this step starts from to host memory (a candidate that becomes
        the last healthy state if the step passes)."""
        if self.config.trainer.health.snapshot != "memory":
            return
        for wg in self._trainable_groups():
            wg.snapshot_state()
        self._driver_snapshots["candidate"] = self._driver_state()

    def _watch_health(self, metrics: dict[str, float]) -> bool:
        """Check the step's metrics; on a trigger restore the last healthy state and apply the remedy, or
        stop with the report. Adds `health/*` to `metrics`; returns whether the step was rolled back."""
        health = self.health
        trigger = health.check(self.global_steps, metrics)
        if trigger is None:
            health.passed(self.global_steps, metrics)
            self._step_was_healthy()
            metrics.update(health.metrics(triggered=False))
            return False
        health.failed(trigger, metrics)
        stop = health.must_stop()
        restored = self._restore_healthy_state()
        if restored is None:
            stop = True
        else:
            health.rolled_back()
        self._apply_health_factors()
        report = health.write_report(stopped=stop)
        metrics.update(health.metrics(triggered=True))
        if stop:
            self.tracker.log(metrics, step=self.global_steps)
            self.tracker.close()
            why = ("trainer.health.remedy=stop" if self.config.trainer.health.remedy == "stop" else
                   "no healthy checkpoint to restore" if restored is None else
                   f"{health.rollbacks_in_a_row} rollbacks in a row (trainer.health.max_rollbacks)")
            raise UnhealthyRun(f"{trigger.describe()}; stopping ({why}). The report with the metrics around it: "
                               f"{report}" + ("" if restored is None else f"; the weights were restored to {restored}"))
        print(f"{trigger.describe()}; restored {restored}, remedy {self.config.trainer.health.remedy} "
              f"(lr x{health.lr_factor:g}, clip x{health.clip_factor:g}); report: {report}")
        return True

    def _apply_health_factors(self) -> None:
        """The remedies so far, on the workers: learning rates (actor and critic) and the actor's clip."""
        for wg in self._trainable_groups():
            wg.set_health_factors(self.health.lr_factor, self.health.clip_factor if wg is self.actor_rollout_wg else 1.0)

    def _step_was_healthy(self) -> None:
        if self.config.trainer.health.snapshot == "memory":
            for wg in self._trainable_groups():
                wg.commit_snapshot()
            self._driver_snapshots["healthy"] = self._driver_snapshots.pop("candidate")
        elif self._unconfirmed_checkpoint == self.global_steps - 1:  # the saved state started a healthy step
            self._healthy_checkpoint = self._unconfirmed_checkpoint

    def _restore_healthy_state(self) -> str | None:
        """Put the actor (and critic) back to the last healthy state; None when there is none to restore.
        The data loader is not rewound: the batches since are skipped."""
        if self.config.trainer.health.snapshot == "memory":
            # before any step passed, the state this run (re)started from
            slot = "healthy" if "healthy" in self._driver_snapshots else "candidate"
            for wg in self._trainable_groups():
                wg.restore_snapshot(slot)
            driver, where = self._driver_snapshots[slot], "the start of the last healthy step (host memory)"
        else:
            if self._healthy_checkpoint is None:
                return None
            step_dir = self.checkpoints.step_dir(self._healthy_checkpoint)
            self.actor_rollout_wg.load_checkpoint(str(step_dir / "actor"))
            if self.use_critic:
                self.critic_wg.load_checkpoint(str(step_dir / "critic"))
            driver, where = self.checkpoints.load_driver_state(step_dir), str(step_dir)
        if self.kl_ctrl_in_reward is not None and driver.get("kl_ctrl") is not None:
            self.kl_ctrl_in_reward.value = driver["kl_ctrl"]
        self.engine_version = -1  # split placement: the rollout pool gets the restored weights next
        return where

    # ------------------------------------------------------------------ data order and checkpoints

    def _epoch_batches(self):
        """Batches from the current position on, epoch after epoch (the loader is resumable and
        counts its own epochs; each epoch's order is a permutation seeded by data.seed + epoch)."""
        while True:
            yield from self.train_dataloader

    def _val_batches(self):
        from torch.utils.data import DataLoader

        size = self.config.data.val_batch_size or len(self.val_dataset)
        return DataLoader(self.val_dataset, batch_size=size, shuffle=False, drop_last=False,
                          collate_fn=self.collate_fn)

    @property
    def checkpoints(self) -> StepCheckpoints:
        trainer_cfg = self.config.trainer
        return StepCheckpoints(trainer_cfg.default_local_dir, trainer_cfg.resume_mode, trainer_cfg.resume_from_path,
                               trainer_cfg.max_actor_ckpt_to_keep)

    @property
    def checkpoint_root(self) -> Path:
        return self.checkpoints.root

    def _check_checkpoint_dir(self) -> None:
        """All nodes must see trainer.default_local_dir: fail now, not at the first save, when they do not."""
        trainer_cfg = self.config.trainer
        if trainer_cfg.save_freq <= 0 and trainer_cfg.resume_mode == "disable":
            return
        self.checkpoints.check_shared(self.worker_group)

    def _save_checkpoint(self, healthy: bool = False) -> None:
        """global_step_N/{actor,critic,data}; the `latest` marker is written last, so it names a complete step.
        `healthy`: the state saved is one the health watch already trusts (just restored)."""
        checkpoints = self.checkpoints
        step_dir = checkpoints.step_dir(self.global_steps)
        self.actor_rollout_wg.save_checkpoint(str(step_dir / "actor"), global_step=self.global_steps)
        if self.use_critic:
            self.critic_wg.save_checkpoint(str(step_dir / "critic"), global_step=self.global_steps)
        # Batches in flight are not saved: a resumed run draws them again and generates them with its weights
        loader_state = self._pending[0].loader_state if self._pending else self.train_dataloader.state_dict()
        state = {"dataloader": loader_state, **self._driver_state()}
        if self.health is not None:
            state["health"] = self.health.state_dict()
        if self.reward_norm is not None:
            state["reward_norm"] = self.reward_norm.state_dict()
        if self.rollout_wg is not self.actor_rollout_wg:
            state["rollout_generation"] = self.rollout_wg.generation_state()
        checkpoints.save_driver_state(self.global_steps, state)
        checkpoints.commit(self.global_steps)
        if healthy:
            self._healthy_checkpoint = self.global_steps
        else:
            self._unconfirmed_checkpoint = self.global_steps

    def _load_checkpoint(self) -> None:
        step_dir = self.checkpoints.find()
        if step_dir is not None:
            self.global_steps = StepCheckpoints.step_of(step_dir)
            print(f"resuming from {step_dir} (step {self.global_steps})")
            self.actor_rollout_wg.load_checkpoint(str(step_dir / "actor"))
            if self.use_critic:
                self.critic_wg.load_checkpoint(str(step_dir / "critic"))
            state = self.checkpoints.load_driver_state(step_dir)
            self.train_dataloader.load_state_dict(state["dataloader"])
            if self.kl_ctrl_in_reward is not None and state.get("kl_ctrl") is not None:
                self.kl_ctrl_in_reward.value = state["kl_ctrl"]
            if self.reward_norm is not None and state.get("reward_norm") is not None:
                self.reward_norm.load_state_dict(state["reward_norm"])  # never refitted: same rewards as before
            generation = state.get("rollout_generation")
            if self.rollout_wg is not self.actor_rollout_wg and generation and len(generation) == self.rollout_wg.world_size:
                self.rollout_wg.load_generation_state(generation)
            self.policy_version = max(0, self.global_steps - int(self.config.trainer.critic_warmup))
            self._unconfirmed_checkpoint = self.global_steps
            if self.health is not None and state.get("health") is not None:  # the remedies so far stay in force
                self.health.load_state_dict(state["health"])
                self._apply_health_factors()
        self._batches = self._epoch_batches()

    # ------------------------------------------------------------------ dumps

    def _dump_generations(self, batch: DataProto, path: Path) -> None:
        inputs = self.tokenizer.batch_decode(batch.batch["prompts"], skip_special_tokens=True)
        outputs = self.tokenizer.batch_decode(batch.batch["responses"], skip_special_tokens=True)
        scores = batch.batch["token_level_scores"].sum(-1).tolist()
        rows = [{"input": i, "output": o, "score": s, "step": self.global_steps} for i, o, s in zip(inputs, outputs, scores)]
        for row, episode in zip(rows, batch.non_tensor_batch.get("episode", [])):
            row["episode"] = episode  # multi-turn: each message and tool call, readable
        self._write_jsonl(path, rows)

    @staticmethod
    def _write_jsonl(path: Path, rows: list[dict]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


def _reward_extra_metrics(extra_info: dict[str, list]) -> dict[str, float]:
    metrics = {}
    for key, values in extra_info.items():
        numeric = [float(v) for v in values if isinstance(v, (int, float, bool, np.number))]
        if numeric and len(numeric) == len(values):
            metrics[f"reward/{key}/mean"] = float(np.mean(numeric))
    return metrics


def _rollout_vs_training_metrics(batch: DataProto) -> dict[str, float]:
    """How far the sampler's log-probs are from the trainer's for the same tokens (should be ~0 in fp32)."""
    mask = batch.batch["response_mask"].bool()
    diff = (batch.batch["rollout_log_probs"] - batch.batch["old_log_probs"]).abs()[mask]
    prob_diff = (batch.batch["rollout_log_probs"].exp() - batch.batch["old_log_probs"].exp()).abs()[mask]
    if diff.numel() == 0:
        return {}
    return {
        "training/rollout_probs_diff_mean": prob_diff.mean().item(),
        "training/rollout_probs_diff_max": prob_diff.max().item(),
        "training/rollout_log_probs_diff_max": diff.max().item(),
    }
