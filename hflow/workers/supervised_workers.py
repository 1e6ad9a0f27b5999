"""Workers of the supervised stages: `SFTWorker` (causal LM on demonstrations) and `RewardModelTrainWorker`
(a sequence classifier on preferences).

Both hold one FSDP2 model with AdamW and a scheduler, like the PPO actor, and scale their losses the way
the actor does (see `hflow.workers.actor.dp_actor`): a micro-batch's loss is its summed per-token (or
per-group) loss divided by the count over the whole global batch -- every rank, every micro-batch, sent
by the driver in ``meta_info`` -- times the number of ranks, because FSDP averages gradients over ranks.
The optimizer step then follows the gradient of the global batch's mean loss, whatever the micro-batch
size or the number of ranks.

Data methods use `DP_COMPUTE_PROTO`: each rank gets its contiguous chunk of the batch (the driver keeps a
preference group's K rows in one chunk), training returns metrics, evaluation returns per-row numbers
that the driver aggregates.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from hflow.protocol import DataProto
from hflow.single_controller.base import Dispatch, Worker, register
from hflow.utils import device
from hflow.workers.config import check_model_path, resolved_copy
from hflow.workers.common import load_tokenizer, memory_metrics
from hflow.workers.fsdp.checkpoint import FSDPCheckpointManager, save_hf_model
from hflow.workers.fsdp_workers import FSDPModelHolder, last_token_scores

__all__ = ["SFTWorker", "RewardModelTrainWorker", "last_token_scores"]

_SCORE_HEAD_SEED = 2024


class StageWorker(Worker, FSDPModelHolder):
    """One trainable FSDP2 model: set-up, the optimizer step, checkpoints and the HF export."""

    def __init__(self, config: DictConfig):
        super().__init__()
        self.raw_config = config

    def _load_module(self, model_cfg: DictConfig) -> torch.nn.Module:
        raise NotImplementedError

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from hflow.workers import fsdp

        self.config = resolved_copy(self.raw_config)
        model_cfg = self.config.model
        check_model_path(model_cfg.path, "model.path")
        self.init_distributed()
        self.device_mesh = fsdp.build_device_mesh(self.world_size)
        self.tokenizer = load_tokenizer(model_cfg.tokenizer_path or model_cfg.path, model_cfg.trust_remote_code)
        module = self._load_module(model_cfg)
        self.hf_config = module.config
        self.module, self.optimizer, self.lr_scheduler = self._build_trainable(
            module, model_cfg.fsdp_config, self.config.optim,
            gradient_checkpointing=model_cfg.enable_gradient_checkpointing, train=True,
            fp32_modules=self._fp32_modules(module))
        self.checkpoint_manager = FSDPCheckpointManager(
            self.module, self.optimizer, self.lr_scheduler, self.tokenizer, contents=self.config.checkpoint.contents)
        self._offload_param = model_cfg.fsdp_config.param_offload
        self._offload_optim = model_cfg.fsdp_config.optimizer_offload
        self._offload(self.module, self.optimizer, self._offload_param, self._offload_optim)

    def _fp32_modules(self, module: torch.nn.Module) -> list[torch.nn.Module]:
        return []

    def _optimizer_step(self, metrics: dict[str, list[float]]) -> None:
        from hflow.workers.fsdp import clip_grad_norm_and_step

        metrics["train/grad_norm"] = [clip_grad_norm_and_step(self.module, self.optimizer, self.config.optim.grad_clip)]
        metrics["train/lr"] = [self.lr_scheduler.get_last_lr()[0]]
        self.lr_scheduler.step()
        metrics.update({k: [v] for k, v in memory_metrics().items()})

    def _micro_batches(self, data: DataProto, rows_per_item: int = 1):
        """Consecutive slices of `micro_batch_size_per_gpu` items (an item is `rows_per_item` rows), on the device."""
        rows = int(self.config.data.micro_batch_size_per_gpu) * rows_per_item
        batch = data.batch.to(device.get_device())
        for start in range(0, len(data), rows):
            yield batch[start:start + rows]

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def train_step(self, data: DataProto) -> DataProto:
        """One optimizer step on this rank's share of the global batch; returns metrics."""
        self._onload(self.module, self.optimizer, self._offload_param, self._offload_optim)
        self.module.train()
        started = time.perf_counter()
        from hflow.workers.fsdp import update_pass

        # a one-rank mixed-precision model computes with bf16 copies cast once for the step (every backward
        # reduces, as before: the loops below do not say which is the last)
        with update_pass(self.module):
            metrics = self._accumulate_gradients(data)
        self._optimizer_step(metrics)
        device.synchronize()
        metrics["timing_s/train_step_worker"] = [time.perf_counter() - started]
        self._offload(self.module, self.optimizer, self._offload_param, self._offload_optim)
        return DataProto(meta_info={"metrics": metrics})

    def _accumulate_gradients(self, data: DataProto) -> dict[str, list[float]]:
        raise NotImplementedError

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path: str, global_step: int = 0) -> None:
        self._onload(self.module, self.optimizer, self._offload_param, self._offload_optim)
        self.checkpoint_manager.save_checkpoint(local_path, global_step=global_step)
        self._offload(self.module, self.optimizer, self._offload_param, self._offload_optim)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str) -> None:
        self._onload(self.module, self.optimizer, self._offload_param, self._offload_optim)
        self.checkpoint_manager.load_checkpoint(local_path)
        self._offload(self.module, self.optimizer, self._offload_param, self._offload_optim)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_hf_model(self, local_path: str) -> None:
        """The trained model as a plain Hugging Face folder (written by rank 0, complete or not at all)."""
        self._onload(self.module, None, self._offload_param, False)
        save_hf_model(self.module, local_path, tokenizer=self.tokenizer)
        self._offload(self.module, None, self._offload_param, False)


class SFTWorker(StageWorker):
    """Supervised fine-tuning: next-token loss on the tokens `loss_mask` marks (the assistant's)."""

    def _load_module(self, model_cfg: DictConfig) -> torch.nn.Module:
        from hflow.workers import fsdp

        return fsdp.load_causal_lm(
            model_cfg.path, dtype=model_cfg.fsdp_config.model_dtype, override_config=model_cfg.override_config,
            trust_remote_code=model_cfg.trust_remote_code, attn_implementation=model_cfg.attn_implementation,
            rank0_only=True)

    def _token_nll(self, micro: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(nll, mask), each (B, T-1): the loss of predicting token t+1 at position t, where it is trained."""
        mask = micro["loss_mask"][:, 1:]
        # The LM head runs only at positions where some row has a target (prompts cost no logits).
        positions = mask.any(0).nonzero().squeeze(-1)
        logits = self.module(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"],
                             position_ids=micro["position_ids"], use_cache=False, logits_to_keep=positions).logits
        from hflow.utils.torch_functional import logprobs_from_logits

        targets = micro["input_ids"][:, 1:][:, positions]
        nll = -logprobs_from_logits(logits, targets)
        return nll, mask[:, positions].to(nll.dtype)

    def _accumulate_gradients(self, data: DataProto) -> dict[str, list[float]]:
        global_tokens = float(data.meta_info["global_num_tokens"])
        scale = self.world_size / max(global_tokens, 1.0)
        loss_share = torch.zeros((), device=device.get_device())
        for micro in self._micro_batches(data):
            nll, mask = self._token_nll(micro)
            loss = (nll * mask).sum() * scale
            loss.backward()
            loss_share += loss.detach()
        # this rank's share x ranks: the driver's mean over ranks is the global batch's loss
        return {"train/loss": [loss_share.item()]}

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def evaluate(self, data: DataProto) -> DataProto:
        """Per row: the summed NLL of its trained tokens and their count (`nll_sum`, `num_tokens`)."""
        from hflow.workers.fsdp import no_grad_pass

        self._onload(self.module, None, self._offload_param, False)
        self.module.eval()
        sums, counts = [], []
        with no_grad_pass(self.module):
            for micro in self._micro_batches(data):
                nll, mask = self._token_nll(micro)
                sums.append((nll * mask).sum(-1).float().cpu())
                counts.append(mask.sum(-1).float().cpu())
        self._offload(self.module, None, self._offload_param, False)
        return DataProto.from_dict({"nll_sum": torch.cat(sums), "num_tokens": torch.cat(counts)})


class RewardModelTrainWorker(StageWorker):
    """Reward-model training: a score per sequence (the head's output at its last valid token, as
    `RewardModelWorker` reads it in PPO); softmax cross-entropy over each group's K scores with the
    preferred one as the target, which for K=2 is -log sigmoid(r_chosen - r_rejected)."""

    def _load_module(self, model_cfg: DictConfig) -> torch.nn.Module:
        from hflow.workers import fsdp

        module = fsdp.load_reward_model(model_cfg.path, dtype=model_cfg.fsdp_config.model_dtype,
                                              trust_remote_code=model_cfg.trust_remote_code,
                                              attn_implementation=model_cfg.attn_implementation, rank0_only=True)
        module.config.pad_token_id = self.tokenizer.pad_token_id
        head = module.score
        if not head.weight.is_meta and not _is_reward_model_folder(module.config):
            # A new head on a language model: N(0, 1/sqrt(hidden + 1)), zero bias (lm-human-preferences),
            # seeded so that every run starts from the same reward model.
            generator = torch.Generator().manual_seed(_SCORE_HEAD_SEED)
            with torch.no_grad():
                head.weight.copy_(torch.randn(head.weight.shape, generator=generator) / math.sqrt(head.in_features + 1))
                if head.bias is not None:
                    head.bias.zero_()
        module.config.architectures = [type(module).__name__]
        self._per_token_scores: torch.Tensor | None = None
        head.register_forward_hook(lambda _m, _i, output: setattr(self, "_per_token_scores", output))
        return module

    def _fp32_modules(self, module: torch.nn.Module) -> list[torch.nn.Module]:
        return [module.score]  # scores (and their differences) in fp32, not bf16

    def _scores(self, micro: dict) -> torch.Tensor:
        self.module(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"],
                    position_ids=micro["position_ids"], use_cache=False)
        return last_token_scores(self._per_token_scores, micro["attention_mask"])

    def _accumulate_gradients(self, data: DataProto) -> dict[str, list[float]]:
        k = int(data.meta_info["group_size"])
        scale = self.world_size / float(data.meta_info["global_num_groups"])
        sums = {"train/loss": 0.0, "train/accuracy": 0.0, "train/margin": 0.0}
        for micro in self._micro_batches(data, rows_per_item=k):
            scores = self._scores(micro).view(-1, k)
            preferred = micro["preferred_mask"].view(-1, k).argmax(-1)
            loss = F.cross_entropy(scores, preferred, reduction="sum") * scale
            loss.backward()
            sums["train/loss"] += loss.item()
            stats = preference_stats(scores.detach(), preferred)
            sums["train/accuracy"] += stats["correct"].sum().item() * scale
            sums["train/margin"] += stats["margin"].sum().item() * scale
        return {name: [value] for name, value in sums.items()}

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def evaluate(self, data: DataProto) -> DataProto:
        """Per row: its score (`scores`); the driver groups them."""
        from hflow.workers.fsdp import no_grad_pass

        self._onload(self.module, None, self._offload_param, False)
        self.module.eval()
        with no_grad_pass(self.module):
            scores = [self._scores(micro).cpu() for micro in self._micro_batches(data)]
        self._offload(self.module, None, self._offload_param, False)
        return DataProto.from_dict({"scores": torch.cat(scores)})


def preference_stats(scores: torch.Tensor, preferred: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per group of K scores (G, K) and the preferred index (G,): `correct` (the preferred scores highest,
    strictly), `margin` (its score minus the mean of the others; r_chosen - r_rejected for pairs) and
    `loss` (softmax cross-entropy)."""
    k = scores.shape[-1]
    best = scores.gather(-1, preferred[:, None]).squeeze(-1)
    others = (scores.sum(-1) - best) / (k - 1)
    is_other = torch.ones_like(scores, dtype=torch.bool).scatter_(-1, preferred[:, None], False)
    top_other = scores.masked_fill(~is_other, float("-inf")).max(-1).values
    return {"correct": (best > top_other).float(), "margin": best - others,
            "loss": F.cross_entropy(scores.float(), preferred, reduction="none")}


def _is_reward_model_folder(config) -> bool:
    """True when the folder already holds a trained score head (a sequence-classification model)."""
    return any(name.endswith("ForSequenceClassification") for name in (config.architectures or []))
