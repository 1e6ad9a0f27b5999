"""The PPO critic on a data-parallel (FSDP2) value model: values of response states and the value update.

The value model (`fsdp.load_value_model`) outputs one scalar per position; V at position t is
the value of the state after reading token t, so the state before response token j is position
T-L-1+j, the same window the actor scores. Values are zero outside the response mask, which is also
what the loss counts, so advantages (GAE) and the value loss see the same tokens. With
`use_remove_padding` (copied from `critic.model` by the worker) the forward runs on the valid tokens
packed into one row (`hflow.utils.packing`), with the same values.

A critic on a vision-language backbone (`fsdp.register_vision_value_model`) sees the images its samples'
policy saw: each micro-batch gets its own rows' vision inputs and their per-sequence multimodal positions
exactly as the actor's forward does (`dp_actor.micro_batch_vision`), through micro-batching, dynamic batch
sizes and shuffled mini-batches.

Mini-batches, micro-batches and loss scaling follow the actor exactly (see `dp_actor`'s module
docstring): every loss is normalised by the mini-batch's token (or sequence) count over all ranks
and multiplied by the number of ranks, so the update does not depend on how the batch was cut.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from tensordict import TensorDict
from torch import nn
from torch.optim import Optimizer

from hflow.protocol import DataProto
from hflow.algorithms.core_algos import GlobalBatchInfo, compute_value_loss
from hflow.utils.packing import pack_micro_batch
from hflow.workers.seqlen_balancing import ppo_micro_batches, ppo_mini_batches, split_micro_batches
from hflow.utils.torch_functional import masked_mean
from hflow.workers.actor.dp_actor import StepMetrics, forward_batch, micro_batch_vision, response_mask_of
from hflow.workers.critic.base import BasePPOCritic
from hflow.workers.fsdp import clip_grad_norm_and_step, no_grad_pass, update_pass

__all__ = ["DataParallelPPOCritic"]

_FORWARD_KEYS = ("responses", "input_ids", "attention_mask", "position_ids")


class DataParallelPPOCritic(BasePPOCritic):
    """Value function on an FSDP2-sharded (or, in a single process, plain) HF token-classification model.

    `config` is the `critic` subtree as the worker normalised it (with `ppo_mini_batch_size_per_rank`).
    """

    def __init__(self, config: Any, critic_module: nn.Module, critic_optimizer: Optimizer) -> None:
        super().__init__(config)
        self.critic_module = critic_module
        self.critic_optimizer = critic_optimizer

    def _forward_micro_batch(self, micro_batch: TensorDict, mm_inputs: Any = None) -> torch.Tensor:
        """V of the state before each response token, (B, L), fp32. `mm_inputs`: the batch's vision inputs
        per sample (`forward_batch`), None without images."""
        response_length, seq_len = micro_batch["responses"].shape[-1], micro_batch["input_ids"].shape[-1]
        if getattr(self.config, "use_remove_padding", False):  # one row of the valid tokens (`hflow.utils.packing`)
            packed = pack_micro_batch(micro_batch["input_ids"], micro_batch["attention_mask"], response_length)
            vision = micro_batch_vision(self.critic_module, micro_batch, mm_inputs, packed)
            values = packed.forward(self.critic_module, use_cache=False, **vision).logits
            return packed.unpack_response(values[0, packed.scoring_positions, 0].float())  # 0 at padded responses
        inputs = {key: micro_batch[key] for key in ("input_ids", "attention_mask", "position_ids")}
        inputs.update(micro_batch_vision(self.critic_module, micro_batch, mm_inputs, None))  # mrope positions
        values = self.critic_module(**inputs, use_cache=False).logits
        return values[:, seq_len - response_length - 1 : seq_len - 1, 0].float()

    @torch.no_grad()
    def compute_values(self, data: DataProto) -> torch.Tensor:
        """Values (N, L) in input row order, 0 outside the response mask.

        meta_info: `micro_batch_size` or, with `use_dynamic_bsz`, the token budget `max_token_len`.
        """
        self.critic_module.eval()
        meta = data.meta_info
        keys = [*_FORWARD_KEYS, "response_mask"] if "response_mask" in data.batch.keys() else list(_FORWARD_KEYS)
        batch, mm_inputs = forward_batch(data, keys)
        micro_batches, reverse_idx = split_micro_batches(
            batch,
            micro_batch_size=meta.get("micro_batch_size"),
            max_token_len=meta.get("max_token_len"),
            use_dynamic_bsz=bool(meta.get("use_dynamic_bsz", False)),
        )
        with no_grad_pass(self.critic_module):
            values = torch.cat([self._forward_micro_batch(mb, mm_inputs) for mb in micro_batches])
        if reverse_idx is not None:
            values = values[reverse_idx.to(values.device)]
        return values * response_mask_of(batch).to(values.dtype)

    def update_critic(self, data: DataProto) -> dict[str, list[float]]:
        """`ppo_epochs` passes over `data` (`values` from rollout time, `returns`) in mini-batches of
        `ppo_mini_batch_size_per_rank` sequences, one optimizer step each, minimising the clipped value loss."""
        self.critic_module.train()
        cfg = self.config
        keys = [*_FORWARD_KEYS, "values", "returns"]
        if "response_mask" in data.batch.keys():
            keys.append("response_mask")
        batch, mm_inputs = forward_batch(data, keys)

        metrics: dict[str, list[float]] = defaultdict(list)
        for mini_batch in ppo_mini_batches(batch, cfg):
            self._update_step(mini_batch, metrics, mm_inputs)
        return dict(metrics)

    def _update_step(self, mini_batch: TensorDict, metrics: dict[str, list[float]], mm_inputs: Any = None) -> None:
        cfg = self.config
        info = GlobalBatchInfo.from_mask(response_mask_of(mini_batch))
        step = StepMetrics(info)
        # one cast (one rank) or one gather (several, when it fits) of the weights for all micro-batches
        with update_pass(self.critic_module) as update:
            micro_batches = ppo_micro_batches(mini_batch, cfg)
            for index, micro_batch in enumerate(micro_batches):
                mask = response_mask_of(micro_batch)
                vpreds = self._forward_micro_batch(micro_batch, mm_inputs)
                vf_loss, vf_clipfrac = compute_value_loss(
                    vpreds,
                    micro_batch["returns"],
                    micro_batch["values"],
                    mask,
                    cliprange_value=cfg.cliprange_value,
                    loss_agg_mode=cfg.loss_agg_mode,
                    global_batch_info=info,
                )
                update.before_backward(last=index == len(micro_batches) - 1)
                vf_loss.backward()
                step.add_loss("critic/vf_loss", vf_loss)
                step.add_token_mean("critic/vf_clipfrac", vf_clipfrac, mask)
                step.add_token_mean("critic/vpred_mean", masked_mean(vpreds, mask), mask)

        step.flush_to(metrics)
        grad_norm = clip_grad_norm_and_step(self.critic_module, self.critic_optimizer, cfg.grad_clip)
        metrics["critic/grad_norm"].append(grad_norm)
