"""Generation with HF `generate` on the training module itself: no second copy of the weights and no
weight sync, at a fraction of vLLM's speed. For debugging, and for models vLLM cannot run.

The module may be a plain HF causal LM or one wrapped with FSDP2 `fully_shard`; FSDP2 gathers the
parameters in every forward, and `synced_gpus` keeps all ranks stepping together until the last one
is done (ranks that stop early would otherwise leave the others waiting in an all-gather). `generate`
itself is registered as a forward of the root unit: a vision-language model's `generate` encodes the
images before its first forward, through the vision tower's patch embedding and merger, which are the
root unit's parameters and would still be shards there.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from torch.distributed.fsdp import register_fsdp_forward_method

from hflow.agent.loop import TurnEngine, TurnResult
from hflow.protocol import DataProto
from hflow.utils import device
from hflow.utils.device import empty_cache
from hflow.utils.torch_functional import get_response_mask, pad_sequence_to_length
from hflow.utils.vision import MM_INPUTS, batch_vision_inputs, mm_token_type_ids
from hflow.workers.rollout.base import (
    LOG_PROB_PAD,
    BaseRollout,
    SamplingSettings,
    assemble_rollout_output,
    resolve_sampling,
)
from hflow.workers.fsdp.kernels import eager_generation
from hflow.workers.fsdp.passes import compute_weights
from hflow.workers.moe import NOT_ROUTED, RoutingRecorder
from hflow.workers.rollout.multi_turn import MultiTurnRollout

__all__ = ["HFRollout"]


class HFRollout(BaseRollout):
    """`generate_sequences` through `module.generate`, in micro-batches of `config.micro_batch_size`
    prompts (null: the whole batch at once).

    `rollout_log_probs` are `log_softmax` of the scores `generate` samples from, i.e. after the
    temperature and top-k/top-p warpers: the same quantity the vLLM rollout reports.

    Prompts with images (a vision-language model; the dataset's non-tensor `multi_modal_inputs`) go to
    `generate` with their `pixel_values` and `image_grid_thw` and the image-token types the model needs for
    its multimodal positions; `generate` encodes each image once and repeats its features for the `n`
    samples. Multi-turn episodes keep their prompt's images: every wave hands each turn's row its episode's
    `pixel_values` and `image_grid_thw` again (the image tokens stay in the trajectory's prompt), so each turn
    is sampled with the images and the multimodal positions the trainer's forward computes over the whole
    episode. (Tool results are text.)
    """

    def __init__(self, module: nn.Module, config: DictConfig, tokenizer: Any = None) -> None:
        self.module = module
        # the root unit's parameters gathered for all of `generate` (no-op for a plain module)
        register_fsdp_forward_method(module, "generate")
        self.config = config
        self.response_length = int(config.response_length)
        self.calculate_log_probs = bool(config.calculate_log_probs)
        self.multi_turn = MultiTurnRollout(config, tokenizer) if config.multi_turn.enable else None
        # router replay: record the experts every token was routed to (set by the worker from actor.router_replay)
        self.record_routing = bool(config.get("record_routing", False))

    @torch.no_grad()
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        settings = resolve_sampling(self.config, prompts.meta_info)
        micro_batch_size = self.config.micro_batch_size or len(prompts)
        was_training = self.module.training
        self.module.eval()
        # a one-rank mixed-precision actor generates with its compute copies, as its log-prob pass scores
        try:
            with compute_weights(self.module, accumulate_grads=False):
                if self.multi_turn is not None:
                    engine = _WaveEngine(self, settings, prompts.meta_info["eos_token_id"],
                                         prompts.meta_info["pad_token_id"], _episode_images(prompts, settings.n))
                    return self.multi_turn.generate(prompts, settings, engine, self.calculate_log_probs,
                                                    all_done=_all_ranks_done if _synced() else None)
                outputs = [self._generate(chunk, settings) for chunk in prompts.split(micro_batch_size)]
        finally:
            self.module.train(was_training)
            empty_cache()
        return DataProto.concat(outputs)

    def _sampling_kwargs(self, settings: SamplingSettings, n: int) -> dict[str, Any]:
        if settings.greedy:
            return {"do_sample": False}
        sampling = {
            "do_sample": True,
            "temperature": settings.temperature,
            "top_p": settings.top_p,
            "top_k": max(settings.top_k, 0),  # HF: 0 means no top-k filter
            "num_return_sequences": n,
        }
        if settings.ignore_eos:
            sampling["min_new_tokens"] = self.response_length
        return sampling

    def _generate(self, prompts: DataProto, settings: SamplingSettings) -> DataProto:
        input_ids = prompts.batch["input_ids"]
        attention_mask = prompts.batch["attention_mask"]
        eos_token_id = prompts.meta_info["eos_token_id"]
        pad_token_id = prompts.meta_info["pad_token_id"]
        rows = input_ids.shape[0] * (1 if settings.greedy else settings.n)
        recorder = RoutingRecorder(self.module, rows) if self.record_routing else nullcontext()
        with recorder:
            out = self._generate_ids(input_ids, attention_mask, settings, eos_token_id, pad_token_id,
                                     self._vision_kwargs(prompts))
        generated = out.sequences[:, input_ids.shape[1] :]
        responses = pad_sequence_to_length(generated, self.response_length, pad_token_id)

        log_probs = None
        if self.calculate_log_probs:
            # scores[t] is the (B·n, V) distribution step t was sampled from.
            scores = torch.stack(out.scores, dim=1).float()
            log_probs = torch.log_softmax(scores, dim=-1).gather(-1, generated.unsqueeze(-1)).squeeze(-1)
            valid = get_response_mask(generated, eos_token_id, dtype=torch.bool)
            log_probs = log_probs.masked_fill(~valid, LOG_PROB_PAD)
            log_probs = pad_sequence_to_length(log_probs, self.response_length, LOG_PROB_PAD)
        output = assemble_rollout_output(prompts, responses, settings.n, log_probs)
        if self.record_routing:  # (B·n, P+L, R, k) in input_ids' layout, -1 where no forward ran a valid token
            routed = recorder.routed_experts(rows, output.batch["input_ids"].shape[1])
            routed[output.batch["attention_mask"].cpu() == 0] = NOT_ROUTED
            output.batch["routed_experts"] = routed.to(input_ids.device)
        return output

    @eager_generation()  # compiled layers (use_torch_compile) are for the training passes, not the KV cache's steps
    def _generate_ids(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, settings: SamplingSettings,
                      eos_token_id: Any, pad_token_id: int, vision: dict[str, torch.Tensor]) -> Any:
        return self.module.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            **vision,
            max_new_tokens=self.response_length,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            use_cache=True,
            return_dict_in_generate=True,
            output_scores=self.calculate_log_probs,
            synced_gpus=_synced(),
            **self._sampling_kwargs(settings, settings.n),
        )

    def _vision_kwargs(self, prompts: DataProto) -> dict[str, torch.Tensor]:
        """The images of these prompts, as the model's processor would hand them to `generate`."""
        rows = prompts.non_tensor_batch.get(MM_INPUTS)
        vision = batch_vision_inputs(rows if rows is not None else [], prompts.batch["input_ids"].device)
        if vision:
            vision["mm_token_type_ids"] = mm_token_type_ids(self.module, prompts.batch["input_ids"])
        return vision


def _episode_images(prompts: DataProto, n: int) -> list | None:
    """Each episode's vision inputs, in the agent loop's episode order (prompt-major, n per prompt); None
    when no prompt has an image."""
    rows = prompts.non_tensor_batch.get(MM_INPUTS)
    if rows is None or not any(rows):
        return None
    return [row for row in rows for _ in range(n)]


def _synced() -> bool:
    """Several ranks generate with one FSDP module: every rank must step `generate` together."""
    return dist.is_initialized() and dist.get_world_size() > 1


def _all_ranks_done(done: bool) -> bool:
    flag = torch.tensor([0 if done else 1], dtype=torch.long, device=device.get_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() == 0


class _WaveEngine(TurnEngine):
    """Assistant turns through HF `generate`, which cannot take requests while it runs: each `poll` is
    one wave over every turn queued since the last (left-padded to one width). Across ranks the waves
    are collective: a rank with no turn of its own runs a one-token placeholder row."""

    streams = False

    def __init__(self, rollout: HFRollout, settings: SamplingSettings, eos_token_id, pad_token_id: int,
                 images: list | None = None) -> None:
        self.rollout = rollout
        self.settings = settings
        self.images = images  # per episode key, its prompt's vision inputs (`_episode_images`)
        self.eos_ids = [int(t) for t in np.atleast_1d(eos_token_id)]
        self.pad_token_id = int(pad_token_id)
        self.queue: list[tuple[int, list[int], int]] = []

    def add_turn(self, key: int, ids: list[int], max_tokens: int) -> None:
        self.queue.append((key, ids, max_tokens))

    def busy(self) -> bool:
        return bool(self.queue)

    @eager_generation()
    def poll(self) -> list[TurnResult]:
        turns, self.queue = self.queue, []
        if not turns and not _synced():
            return []
        rows = [(ids, max_tokens) for _, ids, max_tokens in turns] or [([self.eos_ids[0]], 1)]
        width = max(len(ids) for ids, _ in rows)
        module_device = device.get_device()
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for i, (ids, _) in enumerate(rows):
            input_ids[i, width - len(ids):] = torch.tensor(ids)
            attention_mask[i, width - len(ids):] = 1
        vision = {}
        if self.images is not None:  # the turns' episodes' images, in row order (a placeholder row has none)
            vision = batch_vision_inputs([self.images[key] for key, _, _ in turns], module_device)
            if vision:
                vision["mm_token_type_ids"] = mm_token_type_ids(self.rollout.module, input_ids).to(module_device)
        calculate_log_probs = self.rollout.calculate_log_probs
        out = self.rollout.module.generate(
            input_ids=input_ids.to(module_device),
            attention_mask=attention_mask.to(module_device),
            **vision,
            max_new_tokens=max(max_tokens for _, max_tokens in rows),
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_token_id,
            use_cache=True,
            return_dict_in_generate=True,
            output_scores=calculate_log_probs,
            synced_gpus=_synced(),
            **self.rollout._sampling_kwargs(self.settings, 1),
        )
        generated = out.sequences[:, width:].cpu()
        log_probs = None
        if calculate_log_probs:
            scores = torch.stack(out.scores, dim=1).float()
            log_probs = torch.log_softmax(scores, dim=-1).gather(-1, generated.to(scores.device).unsqueeze(-1))
            log_probs = log_probs.squeeze(-1).cpu()
        results = []
        for i, (key, _, max_tokens) in enumerate(turns):
            tokens = generated[i, :max_tokens].tolist()
            stops = [j for j, t in enumerate(tokens) if t in self.eos_ids]
            end = stops[0] + 1 if stops else len(tokens)
            results.append(TurnResult(key, tokens[:end], log_probs[i, :end].tolist() if log_probs is not None else None,
                                      stopped=bool(stops)))
        return results
