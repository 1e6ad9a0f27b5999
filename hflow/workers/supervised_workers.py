"""Workers of the supervised stages: `SFTWorker` (causal LM on demonstrations), `RewardModelTrainWorker`
(a sequence classifier on preferences) and `DPOWorker` (a causal LM on preference pairs, against a frozen
copy of itself).

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

__all__ = ["DPOWorker", "SFTWorker", "RewardModelTrainWorker", "dpo_loss", "last_token_scores"]

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
        save_hf_model(self.module, local_path, tokenizer=self.tokenizer, arg="trainer.hf_output_dir")
        self._offload(self.module, None, self._offload_param, False)


class SFTWorker(StageWorker):
    """Supervised fine-tuning: next-token loss on the tokens `loss_mask` marks (the assistant's)."""

    def _load_module(self, model_cfg: DictConfig) -> torch.nn.Module:
        from hflow.workers import fsdp

        return fsdp.load_causal_lm(
            model_cfg.path, dtype=model_cfg.fsdp_config.model_dtype, override_config=model_cfg.override_config,
            trust_remote_code=model_cfg.trust_remote_code, attn_implementation=model_cfg.attn_implementation,
            rank0_only=True)

    def _token_nll(self, micro: dict, module: torch.nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(nll, mask), each (B, T-1): the loss of predicting token t+1 at position t, where it is trained,
        under `module` (default: the trained model)."""
        mask = micro["loss_mask"][:, 1:]
        # The LM head runs only at positions where some row has a target (prompts cost no logits).
        positions = mask.any(0).nonzero().squeeze(-1)
        logits = (module or self.module)(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"],
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


class DPOWorker(SFTWorker):
    """Direct preference optimisation (Rafailov et al. 2023): the policy, trained, and the reference, the
    same starting weights frozen. A batch is pairs, chosen at row 2g and rejected at 2g+1; each reply's
    log-probability is summed over its tokens (`loss_mask`), under both models. The reference's come from
    one no-grad pass over this rank's whole batch before the policy's micro-batches (it never changes, so
    no pass is repeated), then `dpo_loss` per pair, normalised over the global batch's pairs."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from hflow.workers import fsdp

        super().init_model()
        model_cfg = self.config.model
        ref = fsdp.load_frozen_causal_lm(model_cfg)
        self.ref_module, _, _ = self._build_trainable(ref, model_cfg.fsdp_config, None, gradient_checkpointing=False,
                                                      train=False)
        self.ref_module.eval()
        self._offload(self.ref_module, None, self._offload_param, False)

    def _reply_logps(self, micro: dict, module: torch.nn.Module) -> torch.Tensor:
        """(B,) each row's reply log-probability: the sum over its `loss_mask` tokens."""
        nll, mask = self._token_nll(micro, module)
        return -(nll * mask).sum(-1)

    def _ref_logps(self, data: DataProto) -> list[torch.Tensor]:
        from hflow.workers.fsdp import no_grad_pass

        self._onload(self.ref_module, None, self._offload_param, False)
        with no_grad_pass(self.ref_module):
            logps = [self._reply_logps(micro, self.ref_module).float()
                     for micro in self._micro_batches(data, rows_per_item=2)]
        self._offload(self.ref_module, None, self._offload_param, False)
        return logps

    def _accumulate_gradients(self, data: DataProto) -> dict[str, list[float]]:
        dpo = self.config.dpo
        scale = self.world_size / float(data.meta_info["global_num_pairs"])
        ref_logps = self._ref_logps(data)
        sums: dict[str, float] = {}
        for micro, ref in zip(self._micro_batches(data, rows_per_item=2), ref_logps, strict=True):
            policy = self._reply_logps(micro, self.module).float()
            losses, stats = dpo_loss(policy.view(-1, 2), ref.view(-1, 2), dpo.beta, dpo.loss_type, dpo.label_smoothing)
            loss = losses.sum() * scale
            loss.backward()
            for name, values in {"loss": losses, **stats}.items():
                sums[f"train/{name}"] = sums.get(f"train/{name}", 0.0) + values.detach().sum().item() * scale
        # this rank's sums x ranks / global pairs: the driver's mean over ranks is the global batch's mean
        return {name: [value] for name, value in sums.items()}

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def evaluate(self, data: DataProto) -> DataProto:
        """Per row: its reply's log-probability under the policy and the reference (`logps`, `ref_logps`);
        the driver pairs the rows up, so padding rows for an uneven split cannot break a pair."""
        from hflow.workers.fsdp import no_grad_pass

        self._onload(self.module, None, self._offload_param, False)
        self.module.eval()
        with no_grad_pass(self.module):
            logps = [self._reply_logps(micro, self.module).float().cpu() for micro in self._micro_batches(data)]
        self._offload(self.module, None, self._offload_param, False)
        self._onload(self.ref_module, None, self._offload_param, False)
        with no_grad_pass(self.ref_module):
            ref_logps = [self._reply_logps(micro, self.ref_module).float().cpu() for micro in self._micro_batches(data)]
        self._offload(self.ref_module, None, self._offload_param, False)
        return DataProto.from_dict({"logps": torch.cat(logps), "ref_logps": torch.cat(ref_logps)})


def dpo_loss(policy_logps: torch.Tensor, ref_logps: torch.Tensor, beta: float, loss_type: str = "sigmoid",
             label_smoothing: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO's loss per pair and the metrics users read, from (P, 2) reply log-probabilities, chosen in
    column 0 and rejected in column 1, under the policy and the reference.

    The implicit reward of a reply is beta x (log pi(y|x) - log pi_ref(y|x)); with
    h = its log-ratio for the chosen minus that for the rejected reply:

        sigmoid  -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)   (DPO; eps > 0: cDPO, labels
                                                                              flipped with probability eps)
        ipo      (h - 1 / (2 beta))^2                                        (IPO, Azar et al. 2023)
    """
    log_ratios = policy_logps - ref_logps
    h = log_ratios[:, 0] - log_ratios[:, 1]
    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss {loss_type!r}")
    rewards = beta * log_ratios.detach()
    return losses, {
        "rewards/chosen": rewards[:, 0], "rewards/rejected": rewards[:, 1],
        "rewards/margins": rewards[:, 0] - rewards[:, 1],
        "rewards/accuracies": (rewards[:, 0] > rewards[:, 1]).float(),  # strictly: a tie (step 0) is not right
        "logps/chosen": policy_logps[:, 0].detach(), "logps/rejected": policy_logps[:, 1].detach()}


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
