"""The PPO actor on a data-parallel (FSDP2) module: log-probabilities of responses and the policy update.

Shapes: a batch row is a left-padded prompt followed by a right-padded response, `input_ids`
(B, T) with T = P + L and `responses` (B, L). The logit at position t predicts token t+1, so the
response tokens are scored by the logits at positions T-L-1 ... T-2. Only those L positions go
through the LM head (`logits_to_keep`); the prompt positions' logits are never built. With
`use_remove_padding` (the worker copies `model.use_remove_padding` into the actor's and reference's
configs) each micro-batch's valid tokens run as one packed row (`hflow.utils.packing`), only the
valid response tokens' scoring positions go through the LM head, and the results are scattered back
to (B, L): the padded path's values, 0 at padded response tokens.

Images (a vision-language policy, `hflow.utils.vision`): a batch whose non-tensor `multi_modal_inputs` hold
each sample's `pixel_values` and `image_grid_thw` gets them into every forward, each micro-batch its own rows'
(tracked through splitting and shuffling by a `row_index` column), with the model's multimodal rotary
positions computed for each sequence from its valid tokens; the packed forward takes those positions at the
valid tokens (never positions computed over the packed row, which would run from one sequence into the next).

Loss scaling. A mini-batch (one optimizer step) is split across the data-parallel ranks and, on
each rank, into micro-batches (one backward each). Every loss term is aggregated with the
mini-batch-wide denominators of `core_algos.GlobalBatchInfo` (token or sequence count summed over all
ranks) and multiplied by the number of ranks D, because FSDP averages gradients over ranks:

    loss_micro = sum_{tokens in micro} l * m / N_global * D              (token-mean)
    grad = (1/D) sum_ranks sum_micros grad(loss_micro) = grad(sum_{mini-batch} l * m / N_global)

which is the gradient of the loss over the whole mini-batch, whatever the micro-batch size, token
budget or number of ranks. Metrics follow the same rule: each rank reports its summed share times
D, and the mean over ranks that the driver takes is the mini-batch value.

PPO-ptx (`ptx.coef > 0`, InstructGPT): every optimizer step also draws a batch of pre-training text
on each rank (`PtxSampler`) and adds coef x its token-mean next-token NLL, normalised the same way
over the ptx tokens of all ranks, so the term is the NLL of the step's whole ptx batch. With an
`ema` (`ParamEMA`), the moving average is updated after every optimizer step that was taken.

On-policy distillation's GKD term (`meta_info["distill_jsd"]`, from `algorithm.distill.jsd_coef`): the batch
carries the teacher's top-k ids and log-probs per response position; each micro-batch's forward also takes the
student's log-probs of those ids from the same logits, and coef x `distill.topk_generalized_jsd` joins the
loss, aggregated like the policy loss over the same mask (`actor/distill_jsd`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from contextlib import ExitStack
from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDict
from torch import nn
from torch.optim import Optimizer

from hflow.protocol import DataProto
from hflow.algorithms.core_algos import GlobalBatchInfo, agg_loss, get_policy_loss_fn, kl_penalty
from hflow.algorithms.distill import topk_generalized_jsd
from hflow.utils.dataset.ptx_dataset import PtxSampler, ptx_loss_mask
from hflow.utils.packing import PackedMicroBatch, pack_micro_batch
from hflow.workers.seqlen_balancing import ppo_micro_batches, ppo_mini_batches, split_micro_batches
from hflow.utils.lm_head import fused_lm_head
from hflow.utils.torch_functional import (block_elements_for, entropy_from_logits, logprobs_at, logprobs_from_logits,
                                          topk_logprobs)
from hflow.utils.vision import MM_INPUTS, batch_vision_inputs, packed_rope_positions, rope_positions
from hflow.workers.actor.base import BasePPOActor
from hflow.workers.fsdp import clip_grad_norm_and_step, no_grad_pass, update_pass
from hflow.workers.fsdp.ema import ParamEMA
from hflow.workers.moe import RouterTrace, moe_routers, route_and_trace

__all__ = ["DataParallelPPOActor", "StepMetrics", "forward_batch", "micro_batch_vision", "require_temperature",
           "response_mask_of"]

_FORWARD_KEYS = ("responses", "input_ids", "attention_mask", "position_ids")
_ROW_INDEX = "row_index"  # a micro-batch's rows in the batch, to find their vision inputs


def forward_batch(data: DataProto, keys: list[str] | tuple[str, ...]) -> tuple[TensorDict, Any]:
    """The tensors a pass reads, and the samples' vision inputs (None without images); with them, a
    `row_index` column follows each row through micro-batching to its inputs."""
    batch = data.batch.select(*keys)
    mm_inputs = data.non_tensor_batch.get(MM_INPUTS)
    if mm_inputs is None or not any(mm_inputs):
        return batch, None
    batch[_ROW_INDEX] = torch.arange(len(data), device=batch.device)
    return batch, mm_inputs


def micro_batch_vision(module: nn.Module, micro_batch: TensorDict, mm_inputs: Any,
                       packed: PackedMicroBatch | None) -> dict[str, torch.Tensor]:
    """The model's keyword inputs for the images of a micro-batch's rows (`forward_batch`'s `mm_inputs`):
    `pixel_values`, `image_grid_thw`, and `position_ids`, every row's multimodal rotary positions computed
    from its own valid tokens: (3, B, T) for the padded forward, their values at the valid tokens under the
    text positions, (4, 1, N), for the `packed` one. {} when none of the rows has an image."""
    if mm_inputs is None:
        return {}
    input_ids, attention_mask = micro_batch["input_ids"], micro_batch["attention_mask"]
    vision = batch_vision_inputs(mm_inputs[micro_batch[_ROW_INDEX].tolist()], input_ids.device)
    if not vision:
        return {}
    positions = rope_positions(module, input_ids, attention_mask, vision["image_grid_thw"])
    if packed is not None:
        positions = packed_rope_positions(positions, attention_mask, packed.position_ids)
    return {**vision, "position_ids": positions}


def require_temperature(meta_info: Mapping[str, Any]) -> float:
    """The sampling temperature the responses were drawn at; there is no default on purpose: scoring
    at another temperature than sampling silently biases every importance ratio."""
    if "temperature" not in meta_info:
        raise KeyError(
            "meta_info['temperature'] is required: the rollout's sampling temperature (rollout.temperature), "
            "by which the logits are divided before taking log-probabilities"
        )
    temperature = float(meta_info["temperature"])
    if temperature <= 0:
        raise ValueError(f"meta_info['temperature'] must be positive, got {temperature}")
    return temperature


def response_mask_of(batch: TensorDict) -> torch.Tensor:
    """The tokens the loss counts: `response_mask` when the batch has one (multi-turn rollouts mask
    observation tokens inside a response), else the response part of the attention mask."""
    if "response_mask" in batch.keys():
        return batch["response_mask"]
    return batch["attention_mask"][:, -batch["responses"].shape[-1] :]


class StepMetrics:
    """Metrics of one optimizer step, accumulated over micro-batches (see the module docstring).

    Values stay on the device until `flush_to`, so the micro-batch loop never waits for them.
    """

    def __init__(self, info: GlobalBatchInfo) -> None:
        self.info = info
        self.sums: dict[str, torch.Tensor] = {}

    def _add(self, name: str, value: torch.Tensor) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + value.detach().float()

    def add_loss(self, name: str, value: torch.Tensor) -> None:
        """A loss term already scaled by `GlobalBatchInfo`: its sum over micro-batches is this rank's share."""
        self._add(name, value)

    def add_token_mean(self, name: str, value: torch.Tensor, mask: torch.Tensor) -> None:
        """A micro-batch token mean, weighted by the micro-batch's share of the mini-batch's tokens."""
        self._add(name, value * (mask.sum() / max(self.info.num_tokens, 1.0) * self.info.dp_size))

    def flush_to(self, metrics: dict[str, list[float]]) -> None:
        for name, value in self.sums.items():
            metrics[name].append(float(value))


class DataParallelPPOActor(BasePPOActor):
    """PPO policy (or, without an optimizer, a frozen reference policy) on an FSDP2-sharded HF causal LM.

    `config` is `actor_rollout_ref.actor` (or `.ref`) as the worker normalised it (`hflow.workers.config`:
    the derived `ppo_mini_batch_size_per_rank`, in sequences, beside the user's keys) and loss settings. The
    module may also be an unwrapped HF model (single process), which tests use as the reference.
    """

    def __init__(self, config: Any, actor_module: nn.Module, actor_optimizer: Optimizer | None = None,
                 ptx_sampler: PtxSampler | None = None, ema: ParamEMA | None = None) -> None:
        super().__init__(config)
        self.actor_module = actor_module
        self.actor_optimizer = actor_optimizer
        self.policy_loss_fn = get_policy_loss_fn(config.policy_loss.loss_mode) if actor_optimizer else None
        self.ptx_sampler = ptx_sampler  # PPO-ptx batches, used when config.ptx.coef > 0
        self.ema = ema
        # MoE (`hflow.workers.moe`): replay the sampler's experts (config.router_replay), add the load-balancing
        # loss (config.router_aux_loss_coef, resolved by the worker from the model when null)
        self.is_moe = bool(moe_routers(actor_module))
        self.aux_loss_coef = float(getattr(config, "router_aux_loss_coef", None) or 0.0) if self.is_moe else 0.0
        # the reference's section has neither key: it routes freely and has no loss
        self.replays_routing = self.is_moe and bool(getattr(config, "router_replay", None))

    # ---- forward ----------------------------------------------------------------------------------

    def _forward_micro_batch(
        self, micro_batch: TensorDict, temperature: float, calculate_entropy: bool, entropy_grad: bool = True,
        trace: list | None = None, routing: ExitStack | None = None, mm_inputs: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log_probs, entropy or None) of the response tokens, each (B, L), at `temperature`
        (`entropy_grad=False`: the entropy is only reported, no gradient flows through it). `trace`,
        `routing` and `mm_inputs` as in `_forward_scores`."""
        log_probs, entropy, _ = self._forward_scores(micro_batch, temperature, calculate_entropy, entropy_grad,
                                                     trace=trace, routing=routing, mm_inputs=mm_inputs)
        return log_probs, entropy

    def _forward_scores(
        self, micro_batch: TensorDict, temperature: float, calculate_entropy: bool, entropy_grad: bool = True,
        topk: int = 0, support: torch.Tensor | None = None, trace: list | None = None,
        routing: ExitStack | None = None, mm_inputs: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
        """`_forward_micro_batch`'s (log_probs, entropy), and the distribution at each response position
        where a loss needs it: `topk` > 0 adds `topk_ids` and `topk_log_probs` (B, L, topk), the most likely
        tokens (the teacher's); `support` (B, L, K) ids adds `support_log_probs` (B, L, K), this model's
        log-probs of those ids (the student's, on the teacher's top-k). All at `temperature`, 0 at padding.

        An MoE model routes the tokens the sampler recorded (`routed_experts`, with `router_replay`) to the
        same experts; `trace` gets the routers' `RouterTrace`, the forward's valid-token mask and the replayed
        experts. With `routing` the routers stay hooked until it closes: after backward, where activation
        checkpointing runs the forward again and must route as it did. `mm_inputs`: the batch's vision
        inputs per sample (`forward_batch`), None without images."""
        if not self.is_moe:
            return self._forward_tokens(micro_batch, temperature, calculate_entropy, entropy_grad, topk, support,
                                        mm_inputs)
        valid = micro_batch["attention_mask"].reshape(-1).bool()
        packed = bool(getattr(self.config, "use_remove_padding", False))
        replay = None
        if "routed_experts" in micro_batch.keys():  # (B, T, R, k) -> the forward's token order
            replay = micro_batch["routed_experts"].flatten(0, 1)
            replay = replay[valid] if packed else replay
        with ExitStack() as own:
            router_trace = (routing or own).enter_context(route_and_trace(self.actor_module, replay))
            out = self._forward_tokens(micro_batch, temperature, calculate_entropy, entropy_grad, topk, support,
                                        mm_inputs)
        if trace is not None:
            trace.extend([router_trace, valid[valid] if packed else valid, replay])
        return out

    def _forward_tokens(
        self, micro_batch: TensorDict, temperature: float, calculate_entropy: bool, entropy_grad: bool,
        topk: int, support: torch.Tensor | None, mm_inputs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
        responses = micro_batch["responses"]
        response_length, seq_len = responses.shape[-1], micro_batch["input_ids"].shape[-1]
        block = block_elements_for(getattr(self.config, "logit_block_elements", None))
        packed = None
        if getattr(self.config, "use_remove_padding", False):  # one row of the valid tokens (`hflow.utils.packing`)
            packed = pack_micro_batch(micro_batch["input_ids"], micro_batch["attention_mask"], response_length)
        vision = micro_batch_vision(self.actor_module, micro_batch, mm_inputs, packed)
        if packed is not None:
            scoring_positions, labels = packed.scoring_positions, packed.input_ids[:, packed.scoring_positions + 1]
            if support is not None:  # (B, L, K) -> (1, slots, K), in the packed slots' order
                support = support.reshape(-1, support.shape[-1])[packed.response_slots].unsqueeze(0)

            def forward() -> torch.Tensor:
                return packed.forward(self.actor_module, use_cache=False, logits_to_keep=scoring_positions,
                                      **vision).logits
        else:
            inputs = {key: micro_batch[key] for key in ("input_ids", "attention_mask", "position_ids")}
            inputs.update(vision)  # its position_ids (mrope) replace the text positions
            scoring_positions = torch.arange(seq_len - response_length - 1, seq_len - 1, device=responses.device)
            labels = responses

            def forward() -> torch.Tensor:
                return self.actor_module(**inputs, use_cache=False, logits_to_keep=scoring_positions).logits
        distribution: dict[str, torch.Tensor] = {}
        if getattr(self.config, "fused_lm_head", None):  # copied from `model` by the worker; off when absent
            if topk or support is not None:  # preflight refuses fused_lm_head with the distillation JSD
                raise RuntimeError("fused_lm_head builds no logits: a top-k or support distribution needs them")
            # LM head, temperature, log-prob and entropy in one blocked pass (`hflow.utils.lm_head`): the
            # model returns (..., 2) in place of the logits, which are never held
            with fused_lm_head(self.actor_module, labels, temperature, block):
                fused = forward()
            log_probs, entropy = fused[..., 0], fused[..., 1]
            entropy = (entropy if entropy_grad else entropy.detach()) if calculate_entropy else None
        else:
            logits = forward()
            # In place when nothing will differentiate through it (saves a (B, L, V) buffer); under autograd
            # FSDP has hooked the output tensor, which an in-place op must not replace. At T = 1 nothing to
            # do: a pass over the (B, L, V) logits, forward and backward, saved.
            if temperature != 1.0:
                logits = logits.div_(temperature) if not torch.is_grad_enabled() else logits / temperature
            log_probs = logprobs_from_logits(logits, labels, block)
            entropy = None
            if calculate_entropy:  # fp32, block-wise like the log-probs
                with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
                    entropy = entropy_from_logits(logits, block)
            if topk:
                distribution["topk_ids"], distribution["topk_log_probs"] = topk_logprobs(logits, topk, labels, log_probs)
            if support is not None:
                distribution["support_log_probs"] = logprobs_at(logits, support.long(), labels, log_probs)
        if packed is not None:  # (1, K, ...) -> (B, L, ...), 0 at padded response tokens
            log_probs = packed.unpack_response(log_probs[0])
            entropy = packed.unpack_response(entropy[0]) if entropy is not None else None
            distribution = {name: packed.unpack_response(value[0]) for name, value in distribution.items()}
        return log_probs, entropy, distribution

    @torch.no_grad()
    def compute_log_prob(
        self, data: DataProto, calculate_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropies) of `responses` under the current weights, (N, L), rows in input order.

        meta_info: `temperature` (required), and `micro_batch_size` or, with `use_dynamic_bsz`, the
        token budget `max_token_len` per forward.
        """
        log_probs, entropys, _ = self._score_batch(data, calculate_entropy, topk=0)
        return log_probs, entropys

    @torch.no_grad()
    def compute_log_prob_and_topk(self, data: DataProto, topk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`compute_log_prob`'s log-probs (N, L) and, from the same forward, the `topk` most likely tokens at
        each response position: ids (N, L, topk) int32 and their log-probs (N, L, topk) (the teacher's)."""
        log_probs, _, distribution = self._score_batch(data, False, topk=topk)
        return log_probs, distribution["topk_ids"].to(torch.int32), distribution["topk_log_probs"]

    def _score_batch(self, data: DataProto, calculate_entropy: bool,
                     topk: int) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
        self.actor_module.eval()
        meta = data.meta_info
        temperature = require_temperature(meta)
        batch, mm_inputs = forward_batch(data, self._forward_keys(data))
        micro_batches, reverse_idx = split_micro_batches(
            batch,
            micro_batch_size=meta.get("micro_batch_size"),
            max_token_len=meta.get("max_token_len"),
            use_dynamic_bsz=bool(meta.get("use_dynamic_bsz", False)),
        )
        with no_grad_pass(self.actor_module):
            outputs = [self._forward_scores(mb, temperature, calculate_entropy, topk=topk, mm_inputs=mm_inputs)
                       for mb in micro_batches]
        log_probs = torch.cat([lp for lp, _, _ in outputs])
        entropys = torch.cat([ent for _, ent, _ in outputs]) if calculate_entropy else None
        distribution = {name: torch.cat([dist[name] for _, _, dist in outputs]) for name in outputs[0][2]}
        if reverse_idx is not None:
            reverse_idx = reverse_idx.to(log_probs.device)
            log_probs = log_probs[reverse_idx]
            entropys = entropys[reverse_idx] if entropys is not None else None
            distribution = {name: value[reverse_idx] for name, value in distribution.items()}
        return log_probs, entropys, distribution

    def _forward_keys(self, data: DataProto) -> list[str]:
        """The batch keys a forward reads: the sampler's experts too when this actor replays them."""
        replays = self.replays_routing
        if replays and "routed_experts" not in data.batch.keys():
            raise KeyError("actor.router_replay is on but the batch has no routed_experts: the rollout did not "
                           "record the experts it routed to")
        return [*_FORWARD_KEYS, "routed_experts"] if replays else list(_FORWARD_KEYS)

    # ---- update -----------------------------------------------------------------------------------

    def update_policy(self, data: DataProto) -> dict[str, list[float]]:
        """`ppo_epochs` passes over `data` in mini-batches of `ppo_mini_batch_size_per_rank` sequences,
        one optimizer step each. Returns metric lists with one entry per step."""
        if self.actor_optimizer is None:
            raise RuntimeError("this actor has no optimizer (a reference policy): it can only compute log-probs")
        self.actor_module.train()
        cfg = self.config
        temperature = require_temperature(data.meta_info)
        # Without old_log_probs the update is on-policy (one mini-batch, one epoch: the trainer checks):
        # each micro-batch's detached log-probs are the old ones, ratio 1 with the policy gradient.
        keys = [*self._forward_keys(data), "advantages"]
        if "old_log_probs" in data.batch.keys():
            keys.append("old_log_probs")
        if "rollout_is_weights" in data.batch.keys():  # algorithm.rollout_is: computed by the trainer
            keys.append("rollout_is_weights")
        if cfg.use_kl_loss:
            keys.append("ref_log_prob")
        if "response_mask" in data.batch.keys():
            keys.append("response_mask")
        # on-policy distillation's GKD term (algorithm.distill.jsd_coef, set by the trainer beside the teacher's
        # top-k): {"coef", "beta"}, or absent
        jsd = data.meta_info.get("distill_jsd")
        if jsd is not None:
            keys += ["teacher_topk_ids", "teacher_topk_log_probs"]
            if "teacher_row_mask" in data.batch.keys():  # teacher.by_data_source: rows without a teacher
                keys.append("teacher_row_mask")
        batch, mm_inputs = forward_batch(data, keys)

        metrics: dict[str, list[float]] = defaultdict(list)
        for mini_batch in ppo_mini_batches(batch, cfg):
            self._update_step(mini_batch, temperature, metrics, jsd, mm_inputs)
        return dict(metrics)

    def _update_step(self, mini_batch: TensorDict, temperature: float, metrics: dict[str, list[float]],
                     jsd: Mapping[str, float] | None = None, mm_inputs: Any = None) -> None:
        cfg = self.config
        info = GlobalBatchInfo.from_mask(response_mask_of(mini_batch))
        step = StepMetrics(info)
        # Without old log-probs no separate pass measured the policy's entropy: this forward reports it.
        report_entropy = "old_log_probs" not in mini_batch.keys()
        with_ptx = self.ptx_sampler is not None and float(cfg.ptx.coef) > 0
        # one cast (one rank) or one gather (several, when it fits) of the weights for all micro-batches
        with update_pass(self.actor_module) as update:
            micro_batches = ppo_micro_batches(mini_batch, cfg)
            for index, micro_batch in enumerate(micro_batches):
                with ExitStack() as routing:  # an MoE model's routing hooks, open until after backward
                    loss = self._micro_batch_loss(micro_batch, temperature, info, step, report_entropy, jsd,
                                                  routing, mm_inputs)
                    update.before_backward(last=index == len(micro_batches) - 1 and not with_ptx)
                    loss.backward()
            if with_ptx:
                self._ptx_backward(step, update, device=mini_batch["input_ids"].device)

        step.flush_to(metrics)
        if cfg.use_kl_loss:
            metrics["actor/kl_coef"].append(float(cfg.kl_loss_coef))
        grad_norm = clip_grad_norm_and_step(self.actor_module, self.actor_optimizer, cfg.grad_clip)
        metrics["actor/grad_norm"].append(grad_norm)
        if self.ema is not None and math.isfinite(grad_norm):  # a skipped step leaves the weights, and the EMA
            self.ema.update()

    def _micro_batch_loss(self, micro_batch: TensorDict, temperature: float, info: GlobalBatchInfo,
                          step: StepMetrics, report_entropy: bool, jsd: Mapping[str, float] | None = None,
                          routing: ExitStack | None = None, mm_inputs: Any = None) -> torch.Tensor:
        """The micro-batch's share of the step's loss (see the module docstring), its metrics added to `step`."""
        cfg = self.config
        mask = response_mask_of(micro_batch)
        trace: list = []
        log_prob, entropy, distribution = self._forward_scores(
            micro_batch, temperature, calculate_entropy=cfg.entropy_coeff != 0 or report_entropy,
            entropy_grad=cfg.entropy_coeff != 0,
            support=micro_batch["teacher_topk_ids"] if jsd is not None else None, trace=trace, routing=routing,
            mm_inputs=mm_inputs,
        )
        # Passed only when present, so that custom losses without the keyword keep working.
        is_weights = ({"rollout_is_weights": micro_batch["rollout_is_weights"]}
                      if "rollout_is_weights" in micro_batch.keys() else {})
        pg_loss, pg_metrics = self.policy_loss_fn(
            old_log_prob=micro_batch["old_log_probs"] if "old_log_probs" in micro_batch.keys() else log_prob.detach(),
            log_prob=log_prob,
            advantages=micro_batch["advantages"],
            response_mask=mask,
            loss_agg_mode=cfg.loss_agg_mode,
            config=cfg,
            global_batch_info=info,
            **is_weights,
        )
        loss = pg_loss
        step.add_loss("actor/pg_loss", pg_loss)
        for name, value in pg_metrics.items():
            step.add_token_mean(f"actor/{name}", value, mask)
        if entropy is not None:
            entropy_loss = agg_loss(entropy, mask, cfg.loss_agg_mode, info)
            if cfg.entropy_coeff != 0:
                loss = loss - cfg.entropy_coeff * entropy_loss
            step.add_loss("actor/entropy", entropy_loss)
        if cfg.use_kl_loss:
            kl = kl_penalty(log_prob, micro_batch["ref_log_prob"], cfg.kl_loss_type)
            kl_loss = agg_loss(kl, mask, cfg.loss_agg_mode, info)
            loss = loss + cfg.kl_loss_coef * kl_loss
            step.add_loss("actor/kl_loss", kl_loss)
        if jsd is not None:  # GKD: the student's distribution toward the teacher's on its top-k (+ the rest)
            divergence = topk_generalized_jsd(distribution["support_log_probs"], micro_batch["teacher_topk_log_probs"],
                                              float(jsd["beta"]))
            jsd_mask = mask * micro_batch["teacher_row_mask"][:, None] if "teacher_row_mask" in micro_batch else mask
            jsd_loss = agg_loss(divergence, jsd_mask, cfg.loss_agg_mode, info)
            loss = loss + float(jsd["coef"]) * jsd_loss
            step.add_loss("actor/distill_jsd", jsd_loss)
        if trace:
            loss = loss + self._moe_loss(*trace, mask, step)
        return loss

    def _moe_loss(self, trace: RouterTrace, valid: torch.Tensor, replay: torch.Tensor | None,
                  mask: torch.Tensor, step: StepMetrics) -> torch.Tensor:
        """coef x the micro-batch's load-balancing loss (`hflow.workers.moe`), weighted by its share of the
        step's response tokens like a token mean; the expert-load and replay metrics go to `step`."""
        aux = trace.aux_loss(valid)
        step.add_token_mean("actor/moe/aux_loss", aux, mask)
        for name, value in trace.expert_load(valid).items():
            step.add_token_mean(f"actor/moe/{name}", value, mask)
        if replay is not None:  # the share of recorded (token, layer) pairs whose own top-k is the sampler's
            matching, recorded = trace.routing_match(replay)
            step.add_token_mean("actor/moe/routing_match", matching / recorded.clamp(min=1.0), mask)
        if not self.aux_loss_coef:
            return aux.new_zeros(())
        return self.aux_loss_coef * aux * (mask.sum() / max(step.info.num_tokens, 1.0) * step.info.dp_size)

    def _ptx_backward(self, step: StepMetrics, update: Any, device: torch.device) -> None:
        """Accumulate coef x the ptx language-modelling loss of this step's pre-training batch (its backwards
        are the step's last: `update.before_backward`)."""
        cfg = self.config
        batch = self.ptx_sampler.next_batch().to(device)
        info = GlobalBatchInfo.from_mask(ptx_loss_mask(batch["attention_mask"]))  # ptx tokens of all ranks
        micro_batches = batch.split(int(cfg.ptx.micro_batch_size_per_gpu))
        for index, micro_batch in enumerate(micro_batches):
            nll = self._ptx_nll(micro_batch)
            ptx_loss = agg_loss(nll, ptx_loss_mask(micro_batch["attention_mask"]), "token-mean", info)
            update.before_backward(last=index == len(micro_batches) - 1)
            (float(cfg.ptx.coef) * ptx_loss).backward()
            step.add_loss("actor/ptx_loss", ptx_loss)

    def _ptx_nll(self, micro_batch: TensorDict) -> torch.Tensor:
        """Next-token NLL (B, T-1) of a right-padded text batch; the loss mask is `ptx_loss_mask`."""
        input_ids = micro_batch["input_ids"]
        predicting = torch.arange(input_ids.shape[-1] - 1, device=input_ids.device)  # the last one predicts nothing
        logits = self.actor_module(
            input_ids=input_ids,
            attention_mask=micro_batch["attention_mask"],
            position_ids=micro_batch["position_ids"],
            use_cache=False,
            logits_to_keep=predicting,
        ).logits
        return -logprobs_from_logits(logits, input_ids[:, 1:])
