"""Generation with HF `generate` on the training module itself: no second copy of the weights and no
weight sync, at a fraction of vLLM's speed. For debugging, and for models vLLM cannot run.

The module may be a plain HF causal LM or one wrapped with FSDP2 `fully_shard`; FSDP2 gathers the
parameters in every forward, and `synced_gpus` keeps all ranks stepping together until the last one
is done (ranks that stop early would otherwise leave the others waiting in an all-gather).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn

from hflow.protocol import DataProto
from hflow.utils.device import empty_cache
from hflow.utils.torch_functional import get_response_mask, pad_sequence_to_length
from hflow.workers.rollout.base import (
    LOG_PROB_PAD,
    BaseRollout,
    SamplingSettings,
    assemble_rollout_output,
    resolve_sampling,
)

__all__ = ["HFRollout"]


class HFRollout(BaseRollout):
    """`generate_sequences` through `module.generate`, in micro-batches of `config.micro_batch_size`
    prompts (null: the whole batch at once).

    `rollout_log_probs` are `log_softmax` of the scores `generate` samples from, i.e. after the
    temperature and top-k/top-p warpers: the same quantity the vLLM rollout reports.
    """

    def __init__(self, module: nn.Module, config: DictConfig) -> None:
        self.module = module
        self.config = config
        self.response_length = int(config.response_length)
        self.calculate_log_probs = bool(config.calculate_log_probs)

    @torch.no_grad()
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        settings = resolve_sampling(self.config, prompts.meta_info)
        micro_batch_size = self.config.micro_batch_size or len(prompts)
        was_training = self.module.training
        self.module.eval()
        try:
            outputs = [self._generate(chunk, settings) for chunk in prompts.split(micro_batch_size)]
        finally:
            self.module.train(was_training)
        empty_cache()
        return DataProto.concat(outputs)

    def _generate(self, prompts: DataProto, settings: SamplingSettings) -> DataProto:
        input_ids = prompts.batch["input_ids"]
        attention_mask = prompts.batch["attention_mask"]
        eos_token_id = prompts.meta_info["eos_token_id"]
        pad_token_id = prompts.meta_info["pad_token_id"]
        if settings.greedy:
            sampling: dict[str, Any] = {"do_sample": False}
        else:
            sampling = {
                "do_sample": True,
                "temperature": settings.temperature,
                "top_p": settings.top_p,
                "top_k": max(settings.top_k, 0),  # HF: 0 means no top-k filter
                "num_return_sequences": settings.n,
            }
            if settings.ignore_eos:
                sampling["min_new_tokens"] = self.response_length
        out = self.module.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=self.response_length,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            use_cache=True,
            return_dict_in_generate=True,
            output_scores=self.calculate_log_probs,
            synced_gpus=dist.is_initialized() and dist.get_world_size() > 1,
            **sampling,
        )
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
        return assemble_rollout_output(prompts, responses, settings.n, log_probs)
