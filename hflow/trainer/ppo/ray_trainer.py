"""`RayPPOTrainer`: the single controller that runs PPO / GRPO (and relatives) step by step.

The workers run on Ray (`trainer.backend=ray`, one process per device) or in this process
(`trainer.backend=local`, one rank); the trainer drives both the same way. Every training role lives in
one resource pool and, through the colocated worker class, in one process per device: the actor (with
its rollout engine when colocated: `actor_rollout`), the reference policy (`ref`, only when a KL term is
used), the critic (`critic`, only for GAE), the distillation teacher (`teacher`, only with a local
teacher: `teacher.model.path`, `source=self` or `by_data_source`; `teacher.url` needs none) and the reward model (`rm`, only when enabled). `fit()` reads
like the algorithm; each heavy phase is one worker-group call. Its helpers, each in its own module: the
batches and their responses (`rollout_source`: the asynchronous pipeline, the weight stream), the scores
(`hflow.reward.batch_scorer`), validation (`validation`), the health watch and its rollback (`health`),
fault injection (`faults`) and the step folders (`hflow.trainer.checkpoints`).
"""

from __future__ import annotations

import uuid
from enum import Enum
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from hflow.protocol import DataProto
from hflow.single_controller.base import ClassWithInitArgs, WorkerGroup, create_colocated_worker_cls
from hflow.algorithms import core_algos
from hflow.algorithms.distill import mix_distillation_reward
from hflow.algorithms.config import rollout_mask_bands, rollout_mask_on
from hflow.reward import dynamic_sampling as dapo
from hflow.reward import multi_reward
from hflow.reward import shaping as reward_shaping
from hflow.reward.batch_scorer import BatchScorer, response_mask as compute_response_mask
from hflow.reward.judge import judge_has_own_process
from hflow.trainer.config import placement_pools, reuses_update_log_probs
from hflow.trainer.ppo import faults
from hflow.trainer.ppo.health import zero_advantage_group_frac
from hflow.trainer.ppo.rollback import HealthRollback
from hflow.trainer.resume import write_model_origin
from hflow.trainer.ppo.rollout_source import PendingRollout, RolloutSource, SplitRolloutSource, timer
from hflow.trainer.ppo.validation import dump_generations, validate
from hflow.trainer.checkpoints import LATEST_MARKER, StepCheckpoints  # noqa: F401  (LATEST_MARKER: re-exported)
from hflow.trainer.ppo.metric_utils import (
    compute_data_metrics,
    compute_mixture_metrics,
    compute_throughout_metrics,
    compute_timing_metrics,
    reduce_metrics,
)
from hflow.utils.errors import UserError
from hflow.utils.torch_functional import masked_mean
from hflow.utils.tracking import Tracking
from hflow.workers.fsdp_workers import ActorRolloutRefWorker, CriticWorker, RewardModelWorker
from hflow.workers.rollout_worker import RolloutWorker
from hflow.workers.teacher.config import teacher_models, uses_teacher
from hflow.workers.teacher.scorer import TeacherScorer
from hflow.workers.teacher.worker import TeacherWorker

__all__ = ["RayPPOTrainer", "Role", "apply_kl_penalty", "compute_advantage", "compute_response_mask",
           "make_worker_group", "timer"]


class Role(Enum):
    ActorRollout = "actor_rollout"
    RefPolicy = "ref"
    Critic = "critic"
    RewardModel = "rm"
    Teacher = "teacher"


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


def compute_advantage(batch: DataProto, algorithm: DictConfig) -> dict[str, float]:
    """Write `advantages` and `returns` with the estimator named by `algorithm.adv_estimator`; returns its
    metrics (GDPO: each reward's share of the advantage)."""
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
    metrics: dict[str, float] = {}
    if algorithm.get("reward_weights"):  # GDPO: the named rewards' columns (preflight: adv_estimator is gdpo)
        weights = dict(algorithm.reward_weights)
        inputs.update(reward_scores=multi_reward.reward_scores(batch, weights), reward_weights=weights)
        metrics = multi_reward.gdpo_metrics(inputs["reward_scores"], weights, inputs["index"],
                                            algorithm.norm_adv_by_std_in_grpo)
    if algorithm.turn_rewards == "turn_return":  # GRPO on per-turn returns (preflight: adv_estimator is grpo)
        advantages, returns = core_algos.compute_grpo_turn_return_advantage(
            inputs["token_level_rewards"], inputs["response_mask"], inputs["index"], turn_gamma=algorithm.turn_gamma,
            norm_adv_by_std_in_grpo=algorithm.norm_adv_by_std_in_grpo)
    else:
        advantages, returns = core_algos.call_adv_estimator(
            algorithm.adv_estimator, **{k: v for k, v in inputs.items() if v is not None})
    batch.batch["advantages"] = advantages
    batch.batch["returns"] = returns
    return metrics


def make_worker_group(trainer_cfg: DictConfig, cls_with_init: ClassWithInitArgs,
                      process_on_nodes: list[int] | None = None, name: str = "global_pool",
                      processes_per_device: int = 1) -> WorkerGroup:
    """The workers of `trainer.backend`: Ray actors, one per device of `process_on_nodes` (by default
    every device of every node) (`ray`), or one rank in this process (`local`: no Ray needed, debuggers
    and plain stack traces work). `processes_per_device` > 1 leaves room on each device for groups made
    `beside` this one (each process gets that share of the device's bundle)."""
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
                           threads_per_worker=None if threads is None else int(threads),
                           max_colocate_count=processes_per_device)
    return RayWorkerGroup(pool, cls_with_init)




class RayPPOTrainer:
    def __init__(self, config: DictConfig, tokenizer, reward_fn, val_reward_fn, train_dataset, val_dataset,
                 collate_fn, train_dataloader, n_workers: int | None = None):
        self.config = config
        self.tokenizer = tokenizer
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
        self.use_teacher = uses_teacher(config)  # on-policy distillation (algorithm.distill)
        self.teacher: TeacherScorer | None = None  # set with the workers
        self.reuse_update_log_probs = reuses_update_log_probs(config)
        self.kl_ctrl_in_reward = core_algos.get_kl_controller(algo.kl_ctrl) if algo.use_kl_in_reward else None
        self.scorer = BatchScorer(config, tokenizer, reward_fn, val_reward_fn)  # every score of a batch
        self.total_training_steps = self._total_training_steps()
        for section in (actor.optim, config.critic.optim):
            section.total_training_steps = self.total_training_steps
        self.global_steps = 0
        # set with the workers: where batches come from (per placement), and the health watch
        # (trainer.health; its rules: preflight's check_health_config), None when it is off
        self.rollouts: RolloutSource | None = None
        self.judge_group: WorkerGroup | None = None  # the generative judge's own processes (Ray), if any
        self.health: HealthRollback | None = None

    def _total_training_steps(self) -> int:
        if self.config.trainer.total_training_steps:
            return int(self.config.trainer.total_training_steps)
        return len(self.train_dataloader) * int(self.config.trainer.total_epochs)

    # ------------------------------------------------------------------ workers

    def init_workers(self) -> None:
        """The training pool: one process per device, every training role colocated in it. With
        `trainer.placement=split`, also the rollout pool of standalone vLLM engines, joined to the actor
        by the weight stream; otherwise the actor's own engine generates (built last, in its process)."""

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
        if teacher_models(self.config.teacher):  # placed like the reference: beside the actor, in the training pool
            roles[Role.Teacher.value] = ClassWithInitArgs(TeacherWorker, config=self.config.teacher)
        rm_role = None
        if self.scorer.use_rm:
            rm_worker = RewardModelWorker
            if self.config.reward_model.style == "generative":  # a chat model judges, on its own vLLM engine
                from hflow.reward.judge_worker import GenerativeRewardModelWorker as rm_worker
            rm_role = ClassWithInitArgs(rm_worker, config=self.config.reward_model)
        # on Ray the judge's engine runs in processes of its own, beside the actor's on the same devices (vLLM's
        # sleep mode serves one engine per process: preflight's check_sleep_mode_engines); else a colocated role
        judge_apart = judge_has_own_process(self.config)
        if rm_role is not None and not judge_apart:
            roles[Role.RewardModel.value] = rm_role
        self.worker_group = make_worker_group(trainer_cfg, create_colocated_worker_cls(roles), train_nodes,
                                              name="train_pool", processes_per_device=2 if judge_apart else 1)
        groups = self.worker_group.spawn(roles.keys())
        if judge_apart:
            self.judge_group = groups[Role.RewardModel.value] = self.worker_group.beside(rm_role, "judge_")
        self.critic_wg = groups.get(Role.Critic.value)
        self.ref_policy_wg = groups.get(Role.RefPolicy.value)
        self.teacher_wg = groups.get(Role.Teacher.value)
        self.rm_wg = self.scorer.rm_wg = groups.get(Role.RewardModel.value)
        self.actor_rollout_wg = groups[Role.ActorRollout.value]
        for group in (self.worker_group, self.judge_group):
            if group is not None:
                group.execute_all_sync("seed_everything", int(trainer_cfg.seed))
        if rollout_nodes:  # split: a pool of its own generates, on its own devices
            pool = make_worker_group(trainer_cfg, ClassWithInitArgs(RolloutWorker, config=arr), rollout_nodes,
                                     name="rollout_pool")
            self.rollouts = SplitRolloutSource(self.config, pool, self.train_dataloader, self.actor_rollout_wg,
                                               self._score_rollout)
        else:  # colocated: the actor's own engine generates
            self.rollouts = RolloutSource(self.config, self.actor_rollout_wg, self.train_dataloader,
                                          self._score_rollout)
        self.rollouts.start(int(trainer_cfg.seed))  # split: the engines start while the models load
        for wg, worker in ((self.critic_wg, CriticWorker), (self.ref_policy_wg, ActorRolloutRefWorker),
                           (self.teacher_wg, TeacherWorker), (self.rm_wg, RewardModelWorker),
                           (self.actor_rollout_wg, ActorRolloutRefWorker)):
            if wg is not None:
                wg.call(worker.init_model)
        if ref_in_actor:
            self.ref_policy_wg = self.actor_rollout_wg
        if self.use_teacher:  # a teacher.url is probed here again (preflight did first)
            self.teacher = TeacherScorer(self.config, self.tokenizer, self.teacher_wg)
        self.rollouts.connect()  # split: the weight stream from the actor to the rollout pool
        if arr.rollout.name == "vllm":  # colocated or split: what the engines hold, rank by rank
            print(self.rollouts.describe())
        if trainer_cfg.health.enable:
            self.health = HealthRollback(trainer_cfg.health, trainer_cfg.log_dir, self.actor_rollout_wg,
                                         self.critic_wg if self.use_critic else None, self.kl_ctrl_in_reward,
                                         self.checkpoints, self.rollouts)
        if trainer_cfg.health.inject:  # faults on purpose, to see the health watch catch them
            faults.install(self)

    def shutdown(self) -> None:
        for name in ("rollouts", "judge_group", "worker_group"):  # the judge's processes before their pool
            owner = getattr(self, name, None)
            if owner is not None:
                owner.shutdown()
                setattr(self, name, None)

    # ------------------------------------------------------------------ the training loop

    def fit(self) -> dict[str, float]:
        """Train for `total_training_steps`; returns the last validation metrics."""
        trainer_cfg = self.config.trainer
        self.tracker = Tracking(trainer_cfg.project_name, trainer_cfg.experiment_name, trainer_cfg.logger,
                                trainer_cfg.log_dir, OmegaConf.to_container(self.config, resolve=True))
        self._check_checkpoint_dir()
        self._load_checkpoint()
        if self.scorer.reward_norm is not None and not self.scorer.reward_norm.fitted:  # a resumed run keeps its own
            self.scorer.fit_normalization(self.train_dataset, self.collate_fn, self.rollouts.generate)
        val_metrics = {}
        validating = self.scorer.val_reward_fn is not None
        if validating and trainer_cfg.val_before_train and self.global_steps == 0:
            val_metrics = self._validate()
            self.tracker.log(val_metrics, step=0)
        progress = tqdm(total=self.total_training_steps, initial=self.global_steps, desc="training")
        while self.global_steps < self.total_training_steps:
            self.global_steps += 1
            is_last_step = self.global_steps >= self.total_training_steps
            timing: dict[str, float] = {}
            if self.health is not None:
                self.health.keep_step_start()
            with timer("step", timing):
                # 1. this step's prompts and their sampled responses (generated now, or ahead with async_steps)
                rollout, rollout_metrics = self.rollouts.next(timing, self.total_training_steps - self.global_steps)
                metrics = self.train_step(rollout, timing)
            metrics.update(rollout_metrics)
            metrics.update(self._step_summary(rollout.batch, timing))
            rolled_back = self.health is not None and self.health.check_step(self.global_steps, metrics, self.tracker)
            if validating and (is_last_step or (trainer_cfg.test_freq > 0
                                                and self.global_steps % trainer_cfg.test_freq == 0)):
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

    # ------------------------------------------------------------------ the algorithm

    def train_step(self, rollout: PendingRollout, timing: dict[str, float]) -> dict[str, float]:
        """One PPO/GRPO iteration on a batch of prompts and their sampled responses: the steps below, in
        the order of the algorithm (step 1, generation, is the rollout source's `next`)."""
        algo = self.config.algorithm
        metrics: dict[str, float] = {}
        # 2-3. group ids, samples aligned with their prompts, rewards (`_score_rollout`)
        batch, reward = self.rollouts.scored(rollout, metrics, timing)
        if algo.filter_groups.enable:  # DAPO dynamic sampling: train only on groups whose samples differ
            batch = self._fill_batch_with_informative_groups(batch, reward, metrics, timing)
        metrics.update(self.rollouts.bound_staleness(batch, rollout.version))
        batch.meta_info["global_token_num"] = batch.batch["attention_mask"].sum(-1).tolist()

        # 4. old log-probs: the sampled responses under the policy before this update (with
        #    trainer.async_steps=1 that is the actor now, one update newer than the sampler)
        if algo.use_rollout_log_probs:  # the sampler already computed them
            batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]
        elif self.reuse_update_log_probs and not self._rollout_check_step():
            pass  # on-policy update: its forward pass runs the sampling weights and detaches them
        else:
            with timer("old_log_prob", timing):
                old_log_prob = self.actor_rollout_wg.call(ActorRolloutRefWorker.compute_log_prob, batch)
            entropys = old_log_prob.batch.pop("entropys")
            metrics["actor/entropy"] = core_algos.agg_loss(
                entropys, batch.batch["response_mask"], self.config.actor_rollout_ref.actor.loss_agg_mode).item()
            batch = batch.union(old_log_prob)
            if "rollout_log_probs" in batch.batch:
                metrics.update(_rollout_vs_training_metrics(batch))
            if algo.get("rollout_is") is not None or rollout_mask_on(algo):
                # correct for the sampler's probabilities (preflight: present here): truncated weights x mask
                token_band, sequence_band = rollout_mask_bands(algo)
                batch.batch["rollout_is_weights"], is_metrics = core_algos.compute_rollout_correction(
                    batch.batch["old_log_probs"], batch.batch["rollout_log_probs"], batch.batch["response_mask"],
                    is_level=algo.rollout_is, is_threshold=float(algo.rollout_is_threshold),
                    token_band=token_band, sequence_band=sequence_band)
                metrics.update(is_metrics)

        # 5. reference and teacher log-probs, values (the teacher scores the tokens as sampled, whatever
        #    policy version sampled them)
        if self.use_reference_policy:
            with timer("ref", timing):
                batch = batch.union(self.ref_policy_wg.call(ActorRolloutRefWorker.compute_ref_log_prob, batch))
        if self.use_teacher:  # with the JSD term, also the teacher's top-k at each position (teacher.topk)
            jsd_coef = float(algo.distill.jsd_coef)
            topk = int(self.config.teacher.topk) if jsd_coef > 0 else 0
            with timer("teacher", timing):
                batch = batch.union(self.teacher.score(batch, topk))
            if jsd_coef > 0:  # the actor's loss adds jsd_coef x GKD's JSD to those (hflow.algorithms.distill)
                batch.meta_info["distill_jsd"] = {"coef": jsd_coef, "beta": float(algo.distill.jsd_beta)}
        if self.use_critic:
            with timer("values", timing):
                batch = batch.union(self.critic_wg.call(CriticWorker.compute_values, batch))

        # 6. rewards (optionally KL-penalised) and advantages, on the driver
        with timer("adv", timing):
            scores = batch.batch["token_level_scores"]
            if algo.reward_clip is not None:  # DeepSpeed-Chat: clip the score, not the KL-penalised reward
                scores, clip_metrics = reward_shaping.clip_sequence_scores(
                    scores, batch.batch["response_mask"], float(algo.reward_clip))
                metrics.update(clip_metrics)
            # the tools', environments' and simulated users' rewards, on their turns (algorithm.turn_rewards)
            scores = core_algos.credit_turn_rewards(scores, batch.batch.get("turn_rewards"), algo.turn_rewards)
            if self.use_teacher:  # on-policy distillation: + coef x (teacher - student log-prob) per sampled token
                mask = batch.batch["response_mask"]
                if "teacher_row_mask" in batch.batch.keys():  # teacher.by_data_source: rows without a teacher
                    mask = mask * batch.batch["teacher_row_mask"][:, None].to(mask.dtype)
                scores, distill_metrics = mix_distillation_reward(
                    scores, batch.batch["teacher_log_prob"], batch.batch["old_log_probs"], mask,
                    float(algo.distill.coef), float(algo.distill.task_reward_coef))
                metrics.update(distill_metrics)
            if algo.use_kl_in_reward:
                metrics.update(apply_kl_penalty(batch, self.kl_ctrl_in_reward, algo.kl_penalty, scores))
            else:
                batch.batch["token_level_rewards"] = scores
            metrics.update(compute_advantage(batch, algo))
        metrics["training/zero_adv_group_frac"] = zero_advantage_group_frac(
            batch.batch["advantages"], batch.batch["response_mask"], batch.non_tensor_batch["uid"])

        # 7. update the critic, then (after the warm-up) the actor
        if self.use_critic:
            with timer("update_critic", timing):
                critic_output = self.critic_wg.call(CriticWorker.update_critic, batch)
            metrics.update(reduce_metrics(critic_output.meta_info["metrics"]))
        if self.config.trainer.critic_warmup <= self.global_steps - 1:
            with timer("update_actor", timing):
                actor_output = self.actor_rollout_wg.call(ActorRolloutRefWorker.update_actor, batch)
            self.rollouts.weights_updated()
            metrics.update(reduce_metrics(actor_output.meta_info["metrics"]))

        metrics.update(self.scorer.norm_metrics())
        if self.config.trainer.rollout_data_dir:
            path = Path(self.config.trainer.rollout_data_dir) / f"{self.global_steps}.jsonl"
            dump_generations(self.tokenizer, batch, path, self.global_steps)
        rollout.batch = batch  # with every column the step added, for the step's summary metrics
        return metrics

    def _rollout_check_step(self) -> bool:
        """With reused log-probs, whether this step still runs the separate pass: step 1 and every
        `algorithm.rollout_check_freq` steps after, so that the sampler-vs-trainer check keeps running."""
        freq = int(self.config.algorithm.rollout_check_freq)
        return freq > 0 and (self.global_steps - 1) % freq == 0

    def _score_rollout(self, rollout: PendingRollout, metrics: dict[str, float],
                       timing: dict[str, float]) -> tuple[DataProto, dict]:
        """Steps 2 and 3: one group id per prompt, prompts aligned with their n samples, and the samples'
        `token_level_scores` (of each response cut after algorithm.stop_token, when set). Returns the
        batch and the reward function's full result; adds the reward metrics to `metrics`. Asynchronous
        runs call it on the rollout source's scoring thread, as soon as the batch's generation ends."""
        batch = rollout.batch
        if self.config.algorithm.adv_estimator == core_algos.AdvantageEstimator.REMAX:
            with timer("gen_max", timing):  # the reward of the greedy response is each prompt's baseline
                greedy = self.rollouts.generate_greedy(rollout.gen_batch)
                batch.batch["reward_baselines"] = self.scorer.greedy_baseline(batch, greedy)
        batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch))], dtype=object)
        batch = batch.repeat(self.config.actor_rollout_ref.rollout.n, interleave=True).union(rollout.output)
        if "response_mask" not in batch.batch.keys():  # multi-turn rollouts bring theirs (0 on tool tokens)
            batch.batch["response_mask"] = compute_response_mask(batch)
        with timer("reward", timing):
            batch.batch["token_level_scores"], reward, score_metrics = self.scorer.score_training(batch)
            if self.config.algorithm.get("reward_weights"):  # GDPO: each named reward as a column of the batch
                multi_reward.attach_reward_columns(batch, reward.get("reward_extra_info", {}),
                                                   self.config.algorithm.reward_weights)
        metrics.update(score_metrics)
        return batch, reward

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
            # async: the next batch in flight, generated within the bound
            more = self.rollouts.take(timing, self.total_training_steps - self.global_steps)
            more.output.meta_info.pop("metrics", None)
            batch, reward = self.rollouts.scored(more, {}, timing)
            num_gen += 1
        metrics["train/num_gen_batches"] = num_gen
        metrics["train/filtered_groups_frac"] = 1.0 - num_kept / num_groups  # of all groups generated this step
        return dapo.take_groups(DataProto.concat(kept), wanted)

    def _step_summary(self, batch: DataProto, timing: dict[str, float]) -> dict[str, float]:
        metrics = compute_data_metrics(batch, use_critic=self.use_critic,
                                       max_prompt_length=self.config.data.max_prompt_length)
        metrics.update(compute_timing_metrics(batch, timing))
        metrics.update(compute_throughout_metrics(batch, timing, n_gpus=self.n_workers))
        metrics.update(compute_mixture_metrics(batch, getattr(self.train_dataset, "files", [])))
        return metrics

    def _validate(self) -> dict[str, float]:
        return validate(self.config, self.tokenizer, self.val_dataset, self.collate_fn, self.rollouts, self.scorer,
                        self.global_steps)

    # ------------------------------------------------------------------ checkpoints

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
        self.actor_rollout_wg.call(ActorRolloutRefWorker.save_checkpoint, str(step_dir / "actor"),
                                    global_step=self.global_steps)
        if self.use_critic:
            self.critic_wg.call(CriticWorker.save_checkpoint, str(step_dir / "critic"), global_step=self.global_steps)
        # Batches in flight are not saved: a resumed run draws them again and generates them with its weights
        state = {"dataloader": self.rollouts.loader_state(), "kl_ctrl": getattr(self.kl_ctrl_in_reward, "value", None)}
        if self.health is not None:
            state["health"] = self.health.state_dict()
        if self.scorer.reward_norm is not None:
            state["reward_norm"] = self.scorer.reward_norm.state_dict()
        state.update(self.rollouts.state_dict())  # split: the rollout pool's generation state
        checkpoints.save_driver_state(self.global_steps, state)
        write_model_origin(step_dir, {"actor": self.config.actor_rollout_ref.model.path,
                                      "critic": self.config.critic.model.path if self.use_critic else None})
        checkpoints.commit(self.global_steps)
        if self.health is not None:
            self.health.saved(self.global_steps, healthy)

    def _load_checkpoint(self) -> None:
        step_dir = self.checkpoints.find()
        if step_dir is None:
            return
        self.global_steps = StepCheckpoints.step_of(step_dir)
        print(f"resuming from {step_dir} (step {self.global_steps})")
        self.actor_rollout_wg.call(ActorRolloutRefWorker.load_checkpoint, str(step_dir / "actor"))
        if self.use_critic:
            self.critic_wg.call(CriticWorker.load_checkpoint, str(step_dir / "critic"))
        state = self.checkpoints.load_driver_state(step_dir)
        self.train_dataloader.load_state_dict(state["dataloader"])
        if self.kl_ctrl_in_reward is not None and state.get("kl_ctrl") is not None:
            self.kl_ctrl_in_reward.value = state["kl_ctrl"]
        if self.scorer.reward_norm is not None and state.get("reward_norm") is not None:
            self.scorer.reward_norm.load_state_dict(state["reward_norm"])  # never refitted: same rewards as before
        self.rollouts.load_state_dict(state)
        self.rollouts.version = max(0, self.global_steps - int(self.config.trainer.critic_warmup))
        if self.health is not None:  # the remedies so far stay in force
            self.health.resumed(self.global_steps, state.get("health"))


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
