"""`SupervisedTrainer`: the single controller of the supervised stages, SFT (`main_sft`), reward-model
training (`main_rm`) and DPO (`main_dpo`), on the same machinery as PPO: a worker group on Ray (or the
local backend), FSDP2 workers, resumable data order, step checkpoints, the loggers, and a Hugging Face
folder at the end.

    for each step:
        batch   = next global batch of demonstrations / preference groups / preference pairs
        metrics = workers.train_step(batch)              # one optimizer step, loss normalised globally
        every trainer.test_freq steps and at the end: workers.evaluate(validation set)
        every trainer.save_freq steps: checkpoint (model, optimizer, scheduler, RNG, data position)
    workers.save_hf_model(trainer.hf_output_dir)
"""

from __future__ import annotations

import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict
from tqdm import tqdm

from hflow.config_schema import ConfigError, ConfigErrors, check_choice, check_positive
from hflow.workers.config import check_offload, check_optim
from hflow.protocol import DataProto
from hflow.single_controller.base import ClassWithInitArgs
from hflow.trainer.checkpoints import StepCheckpoints
from hflow.trainer.resume import check_resume_origin, write_model_origin
from hflow.trainer.ppo.metric_utils import reduce_metrics
from hflow.utils.safe_output import check_replaceable
from hflow.utils.tracking import Tracking, check_backends
from hflow.workers.supervised_workers import StageWorker

__all__ = ["DPOTrainer", "SFTTrainer", "RewardModelTrainer", "check_stage_config"]


def check_stage_config(config: DictConfig, stage: str) -> None:
    """Impossible settings of a supervised stage, before Ray starts or any model loads; the errors of the
    independent checks together (`ConfigErrors`), a check that reads what an earlier one vouches for
    (the resumed checkpoint's model, the tokenizer of the model folder, the ranks) only when that passed."""
    from hflow.trainer.config import check_output_dirs, check_resume
    from hflow.trainer.preflight import check_node_resources
    from hflow.utils.dataset.config import check_data_files
    from hflow.workers.config import check_model_path, check_tokenizer_path

    data, trainer = config.data, config.trainer
    errors = ConfigErrors()
    world = int(trainer.n_gpus_per_node) * int(trainer.nnodes)
    errors.run(check_choice, trainer.backend, ("ray", "local"), "trainer.backend")
    with errors.catch() as world_errors:
        if world < 1:
            raise ConfigError(f"trainer.n_gpus_per_node x trainer.nnodes must be >= 1, got {world}")
        if trainer.backend == "local" and world != 1:
            raise ConfigError(f"trainer.backend=local runs one rank, but trainer.n_gpus_per_node x trainer.nnodes = "
                              f"{world}; set trainer.n_gpus_per_node=1 trainer.nnodes=1")
    errors.run(check_choice, data.truncation, ("error", "right" if stage == "sft" else "left"), "data.truncation")
    if stage == "dpo":
        from hflow.workers.config import check_dpo

        errors.run(check_dpo, config.dpo)
    sizes_ok = True
    for key in ("data.train_batch_size", "data.micro_batch_size_per_gpu", "data.max_length", "trainer.total_epochs"):
        sizes_ok &= errors.run(check_positive, OmegaConf.select(config, key), key)
    if not world_errors:
        errors.run(check_node_resources, config)
    unit = {"sft": "conversations", "rm": "preference rows", "dpo": "preference pairs"}[stage]
    with errors.catch():
        if not world_errors and sizes_ok and int(data.train_batch_size) % world:
            raise ConfigError(f"data.train_batch_size={data.train_batch_size} {unit} do not split evenly over {world} "
                              "workers (trainer.n_gpus_per_node x trainer.nnodes); make it a multiple")
    errors.run(check_optim, config.optim, "optim")
    with errors.catch():
        if config.optim.grad_clip is not None and config.optim.grad_clip <= 0:
            raise ConfigError(f"optim.grad_clip must be positive, got {config.optim.grad_clip}")
    errors.run(check_offload, config.model.fsdp_config, "model.fsdp_config")
    with errors.catch():
        try:
            check_backends(trainer.logger)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    errors.run(check_output_dirs, trainer)
    errors.run(check_data_files, data.train_files, "data.train_files")
    errors.run(check_data_files, data.val_files, "data.val_files")
    # the export at the end replaces a folder there only when hflow wrote all of it: said now, not after training
    errors.run(check_replaceable, Path(trainer.hf_output_dir).expanduser(), arg="trainer.hf_output_dir")
    model_ok = errors.run(check_model_path, config.model.path, "model.path")
    if model_ok:
        errors.run(check_tokenizer_path, config.model, "model")
    if errors.run(check_resume, trainer) and model_ok:
        with errors.catch():
            step_dir = StepCheckpoints(trainer.default_local_dir, trainer.resume_mode, trainer.resume_from_path).find()
            line = check_resume_origin(step_dir, "model", "model.path", config.model.path)
            if line:
                print(line, flush=True)
    errors.raise_any()


class SupervisedTrainer:
    """The loop shared by the supervised stages; subclasses say which worker, what a batch's global counts
    are, and how per-row evaluation results become metrics."""

    stage = ""
    worker_cls: type = object

    def __init__(self, config: DictConfig, tokenizer, train_dataset, val_dataset, collate_fn):
        from hflow.utils.dataset import create_train_dataloader

        self.config = config
        self.tokenizer = tokenizer
        self.val_dataset = val_dataset
        self.collate_fn = collate_fn
        self.train_dataloader = create_train_dataloader(train_dataset, config.data, collate_fn)
        trainer_cfg = config.trainer
        self.total_training_steps = int(trainer_cfg.total_training_steps or
                                        len(self.train_dataloader) * int(trainer_cfg.total_epochs))
        self.checkpoints = StepCheckpoints(trainer_cfg.default_local_dir, trainer_cfg.resume_mode,
                                           trainer_cfg.resume_from_path, trainer_cfg.max_ckpt_to_keep)
        self.global_steps = 0
        self.worker_group = None

    # ------------------------------------------------------------------ workers

    def init_workers(self) -> None:
        from hflow.trainer.ppo.ray_trainer import make_worker_group

        with open_dict(self.config):
            self.config.optim.total_training_steps = self.total_training_steps
        self.worker_group = make_worker_group(self.config.trainer, ClassWithInitArgs(self.worker_cls, config=self.config),
                                              name=f"{self.stage}_pool")
        self.worker_group.execute_all_sync("seed_everything", int(self.config.trainer.seed))
        self.worker_group.call(StageWorker.init_model)

    def shutdown(self) -> None:
        if self.worker_group is not None:
            self.worker_group.shutdown()
            self.worker_group = None

    # ------------------------------------------------------------------ the loop

    def fit(self) -> dict[str, float]:
        """Train for `total_training_steps`, export the model; returns the last validation metrics."""
        trainer_cfg = self.config.trainer
        tracker = Tracking(trainer_cfg.project_name, trainer_cfg.experiment_name, trainer_cfg.logger,
                           trainer_cfg.log_dir, OmegaConf.to_container(self.config, resolve=True))
        if trainer_cfg.save_freq > 0 or trainer_cfg.resume_mode != "disable":
            self.checkpoints.check_shared(self.worker_group)
        self._load_checkpoint()
        val_metrics: dict[str, float] = {}
        if trainer_cfg.val_before_train and self.global_steps == 0:
            val_metrics = self.validate()
            tracker.log(val_metrics, step=0)
        batches = self._batches()
        progress = tqdm(total=self.total_training_steps, initial=self.global_steps, desc=self.stage)
        while self.global_steps < self.total_training_steps:
            self.global_steps += 1
            is_last_step = self.global_steps >= self.total_training_steps
            batch = DataProto.from_single_dict(next(batches))
            batch.meta_info.update(self.batch_counts(batch))
            started = time.perf_counter()
            output = self.worker_group.call(StageWorker.train_step, batch)
            elapsed = time.perf_counter() - started
            metrics = reduce_metrics(output.meta_info["metrics"])
            metrics["timing_s/step"] = elapsed
            metrics["perf/tokens_per_s"] = float(batch.batch["attention_mask"].sum()) / elapsed
            if is_last_step or (trainer_cfg.test_freq > 0 and self.global_steps % trainer_cfg.test_freq == 0):
                val_metrics = self.validate()
                metrics.update(val_metrics)
            if trainer_cfg.save_freq > 0 and (is_last_step or self.global_steps % trainer_cfg.save_freq == 0):
                self._save_checkpoint()
            metrics["training/global_step"] = self.global_steps
            metrics["training/epoch"] = self.train_dataloader.epoch
            tracker.log(metrics, step=self.global_steps)
            progress.update(1)
        progress.close()
        tracker.close()
        self.worker_group.call(StageWorker.save_hf_model, str(Path(trainer_cfg.hf_output_dir).expanduser().resolve()))
        print(f"{self.stage}: Hugging Face model written to {trainer_cfg.hf_output_dir}")
        return val_metrics

    def _batches(self):
        while True:  # epoch after epoch; the loader is resumable and counts its own epochs
            yield from self.train_dataloader

    def validate(self) -> dict[str, float]:
        from torch.utils.data import DataLoader

        size = self.config.data.val_batch_size or len(self.val_dataset)
        outputs, batches = [], []
        for batch_dict in DataLoader(self.val_dataset, batch_size=size, shuffle=False, collate_fn=self.collate_fn):
            batch = DataProto.from_single_dict(batch_dict)
            outputs.append(self.worker_group.call(self.worker_cls.evaluate, batch))
            batches.append(batch)
        return self.val_metrics(DataProto.concat(batches), DataProto.concat(outputs))

    # ------------------------------------------------------------------ stage specifics

    def batch_counts(self, batch: DataProto) -> dict:
        raise NotImplementedError

    def val_metrics(self, batch: DataProto, output: DataProto) -> dict[str, float]:
        raise NotImplementedError

    # ------------------------------------------------------------------ checkpoints

    def _save_checkpoint(self) -> None:
        step_dir = self.checkpoints.step_dir(self.global_steps)
        self.worker_group.call(StageWorker.save_checkpoint, str(step_dir / "model"), global_step=self.global_steps)
        self.checkpoints.save_driver_state(self.global_steps, {"dataloader": self.train_dataloader.state_dict()})
        write_model_origin(step_dir, {"model": self.config.model.path})
        self.checkpoints.commit(self.global_steps)

    def _load_checkpoint(self) -> None:
        step_dir = self.checkpoints.find()
        if step_dir is None:
            return
        self.global_steps = self.checkpoints.step_of(step_dir)
        print(f"resuming from {step_dir} (step {self.global_steps})")
        self.worker_group.call(StageWorker.load_checkpoint, str(step_dir / "model"))
        self.train_dataloader.load_state_dict(self.checkpoints.load_driver_state(step_dir)["dataloader"])


class SFTTrainer(SupervisedTrainer):
    stage = "sft"

    @property
    def worker_cls(self):
        from hflow.workers.supervised_workers import SFTWorker

        return SFTWorker

    def batch_counts(self, batch: DataProto) -> dict:
        # targets are tokens 1..T-1 (position t predicts token t+1)
        return {"global_num_tokens": int(batch.batch["loss_mask"][:, 1:].sum())}

    def val_metrics(self, batch: DataProto, output: DataProto) -> dict[str, float]:
        tokens = float(output.batch["num_tokens"].sum())
        return {"val/loss": float(output.batch["nll_sum"].sum()) / max(tokens, 1.0), "val/num_tokens": tokens}


class RewardModelTrainer(SupervisedTrainer):
    stage = "rm"

    @property
    def worker_cls(self):
        from hflow.workers.supervised_workers import RewardModelTrainWorker

        return RewardModelTrainWorker

    @property
    def group_size(self) -> int:
        return self.val_dataset.group_size

    def batch_counts(self, batch: DataProto) -> dict:
        k = self.group_size
        return {"group_size": k, "global_num_groups": len(batch) // k}

    def val_metrics(self, batch: DataProto, output: DataProto) -> dict[str, float]:
        from hflow.workers.supervised_workers import preference_stats

        k = self.group_size
        scores = output.batch["scores"].view(-1, k)
        preferred = batch.batch["preferred_mask"].view(-1, k).argmax(-1)
        stats = preference_stats(scores, preferred)
        return {"val/loss": stats["loss"].mean().item(), "val/accuracy": stats["correct"].mean().item(),
                "val/margin": stats["margin"].mean().item(), "val/score_mean": scores.mean().item(),
                "val/score_std": scores.std().item()}


class DPOTrainer(SupervisedTrainer):
    stage = "dpo"

    @property
    def worker_cls(self):
        from hflow.workers.supervised_workers import DPOWorker

        return DPOWorker

    def batch_counts(self, batch: DataProto) -> dict:
        return {"global_num_pairs": len(batch) // 2}

    def val_metrics(self, batch: DataProto, output: DataProto) -> dict[str, float]:
        from hflow.workers.supervised_workers import dpo_loss

        dpo = self.config.dpo
        losses, stats = dpo_loss(output.batch["logps"].view(-1, 2), output.batch["ref_logps"].view(-1, 2), dpo.beta,
                                 dpo.loss_type, dpo.label_smoothing)
        return {"val/loss": losses.mean().item(), **{f"val/{name}": value.mean().item() for name, value in stats.items()}}


# ---------------------------------------------------------------------------------------- entry points

STAGES = {"sft": (SFTTrainer, "builtin_sft.yaml"), "rm": (RewardModelTrainer, "builtin_rm.yaml"),
          "dpo": (DPOTrainer, "builtin_dpo.yaml")}


def fill_builtin_stage_defaults(config: DictConfig, stage: str, user_keys: frozenset[str] = frozenset()) -> None:
    """Unset data and model paths point at the built-in RLHF task (`hflow.tasks.rlhf_task`) and the
    built-in model; with both, `config/builtin_<stage>.yaml` replaces the shipped defaults it names."""
    from hflow.tasks.defaults import fill_builtin_paths
    from hflow.trainer.config import SCHEMAS, default_config

    def files() -> tuple[str, str]:
        from hflow.tasks.rlhf_task import ensure_rlhf_task_data

        data = ensure_rlhf_task_data()
        return (data.sft_train, data.sft_val) if stage == "sft" else (data.rm_train, data.rm_val)  # RM and DPO: the pairs

    fill_builtin_paths(config, "model.path", files, STAGES[stage][1], default_config(SCHEMAS[f"{stage}_trainer"]),
                       user_keys)


def build_stage_trainer(config: DictConfig, stage: str) -> SupervisedTrainer:
    """Tokenizer and both datasets, tokenised on the driver: bad data stops here, before any worker."""
    from hflow.utils.dataset.supervised import (
        DPODataset,
        PreferenceDataset,
        SFTDataset,
        pair_collate_fn,
        preference_collate_fn,
        sft_collate_fn,
    )
    from hflow.trainer.main_ppo import load_tokenizer

    tokenizer = load_tokenizer(config.model, "model")
    if stage == "sft":
        dataset_cls, collate = SFTDataset, sft_collate_fn(tokenizer.pad_token_id)
    elif stage == "dpo":
        dataset_cls, collate = DPODataset, pair_collate_fn(tokenizer.pad_token_id)
    else:
        dataset_cls, collate = PreferenceDataset, preference_collate_fn(tokenizer.pad_token_id)
    train = dataset_cls(config.data.train_files, tokenizer, config.data, files_key="data.train_files")
    val = dataset_cls(config.data.val_files, tokenizer, config.data, files_key="data.val_files")
    if stage == "rm" and train.group_size != val.group_size:
        raise ConfigError(f"data.train_files has {train.group_size} responses per row but data.val_files has "
                          f"{val.group_size}; use the same K")
    return STAGES[stage][0](config, tokenizer, train, val, collate)


def run_stage(config: DictConfig, stage: str, user_keys: frozenset[str] = frozenset()) -> dict[str, float]:
    """Check, build and train one supervised stage (`sft`, `rm` or `dpo`); returns the last validation metrics."""
    from hflow.trainer.config import SCHEMAS, validate_config
    from hflow.trainer.main_ppo import train

    config = validate_config(config, SCHEMAS[f"{stage}_trainer"])
    fill_builtin_stage_defaults(config, stage, user_keys)
    check_stage_config(config, stage)
    OmegaConf.resolve(config)
    return train(build_stage_trainer(config, stage), config)
