"""What every rollout engine shares: the generation contract and the pieces of it that do not
depend on the engine (which sampling settings apply to a batch, and how the output is laid out).

The output contract, for B prompts of width P, n samples each and `response_length` L:

    prompts            (B·n, P)    the left-padded prompts, each repeated n times (prompt-major)
    responses          (B·n, L)    generated ids, right-padded with pad_token_id
    input_ids          (B·n, P+L)  prompts ‖ responses
    attention_mask     (B·n, P+L)  the prompt mask ‖ 1 up to and including the first EOS, 0 after
    position_ids       (B·n, P+L)  response positions continue from the last prompt position
    rollout_log_probs  (B·n, L)    float32 sampler log-probs of the generated ids, 0.0 on padding
    rollout_versions   (B·n, L)    int64 policy version of the weights that sampled each id, -1 on padding
                                   (the standalone engines of `trainer.placement=split` add it)

Rows are prompt-major (p0s0, p0s1, ..., p1s0, ...), the order `DataProto.repeat(n, interleave=True)`
gives, so the trainer can union its own repeated batch with this one. Every per-row non-tensor field
of the input is repeated the same way, except `raw_prompt_ids`, which generation consumes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from hflow.protocol import DataProto
from hflow.utils.torch_functional import get_response_mask

__all__ = ["BaseRollout", "SamplingSettings", "WeightUpdates", "assemble_rollout_output", "engine_requests",
           "refuse_images", "resolve_sampling"]

# Non-tensor keys generation reads and does not pass on.
CONSUMED_NON_TENSOR_KEYS = ("raw_prompt_ids", "tools_kwargs", "agent_kwargs", "multi_modal_data")

# Value of `rollout_log_probs` past the end of a response. Those positions are masked out
# everywhere; 0.0 keeps any unmasked sum over a row equal to the response's log-likelihood.
LOG_PROB_PAD = 0.0


class WeightUpdates(ABC):
    """Weight updates that arrive while an engine generates (the standalone engines of
    `trainer.placement=split`, with `trainer.async_steps >= 2` or `rollout.partial_rollout`).

    The engine asks `arrived()` between two scheduler steps. With `partial`, it stops the requests in
    flight, `take()`s the update (loaded into the engine at once) and continues each request from the
    tokens it already produced, whose KV is recomputed with the new weights. Otherwise `take()` keeps
    the update for the next generation and the requests finish with the weights they started with.
    Either way the sender is released at once."""

    partial: bool

    @property
    @abstractmethod
    def version(self) -> int:
        """The policy version of the weights the engine holds now."""

    @abstractmethod
    def arrived(self) -> bool:
        """An update is waiting to be taken (a cheap check, asked at every step)."""

    @abstractmethod
    def take(self) -> None:
        """Receive the waiting update: into the engine with `partial`, else staged for the next generation."""


class BaseRollout(ABC):
    """An engine that turns a batch of prompts into a batch of sampled responses."""

    @abstractmethod
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Generate responses for left-padded `input_ids`; see the module docstring for the output."""

    def close(self) -> None:
        """Release the engine (and any process groups it made) before the process group goes."""


@dataclass(frozen=True)
class SamplingSettings:
    """The sampling parameters one `generate_sequences` call uses. temperature 0 means greedy."""

    n: int
    temperature: float
    top_p: float
    top_k: int  # -1: no top-k filter
    ignore_eos: bool = False  # always generate `response_length` tokens (fixed work for benchmarks)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def greedy_settings(cls) -> SamplingSettings:
        return cls(n=1, temperature=0.0, top_p=1.0, top_k=-1)


def resolve_sampling(config: DictConfig, meta_info: Mapping[str, Any]) -> SamplingSettings:
    """Sampling settings for one batch: the rollout config (`actor_rollout_ref.rollout`), overridden by
    the batch's meta_info.

    * `meta_info["validate"]`: `config.val_kwargs` (greedy unless `val_kwargs.do_sample` and a
      non-zero temperature). One sample per row: like verl, the trainer repeats the validation batch
      `val_kwargs.n` times itself, so every repeat is an independent row.
    * `meta_info["do_sample"] = False` (or `config.do_sample = False`): greedy, one sample per row.
    * otherwise `config.n` samples (or `meta_info["n"]`, e.g. one per prompt to fit the reward
      normalisation) at `config.temperature`, `top_p`, `top_k`.
    """
    if meta_info.get("validate", False):
        val = config.val_kwargs
        temperature = float(val.temperature)
        if not val.do_sample or temperature == 0:
            return SamplingSettings.greedy_settings()
        return SamplingSettings(n=1, temperature=temperature, top_p=float(val.top_p), top_k=int(val.top_k))
    if not meta_info.get("do_sample", config.do_sample):
        return SamplingSettings.greedy_settings()
    temperature = float(config.temperature)
    if temperature <= 0:
        raise ValueError(
            f"rollout.temperature={temperature} with do_sample=True; use a positive temperature, "
            "or do_sample=False for greedy decoding"
        )
    return SamplingSettings(
        n=int(meta_info.get("n", config.n)),
        temperature=temperature,
        top_p=float(config.top_p),
        top_k=int(config.top_k),
        ignore_eos=bool(config.ignore_eos),
    )


def prompt_token_ids(prompts: DataProto) -> list[list[int]]:
    """Each row's prompt without padding: `raw_prompt_ids` when the dataset supplied them, else the
    tokens the attention mask marks (which, unlike matching the pad id, is right even when the pad id
    is also a real token such as EOS)."""
    raw = prompts.non_tensor_batch.get("raw_prompt_ids")
    if raw is not None:
        if len(raw) != len(prompts):
            raise ValueError(
                f"raw_prompt_ids has {len(raw)} rows but input_ids has {len(prompts)}; the two must "
                "come from the same batch (check the sharding manager's preprocess_data)"
            )
        return [[int(t) for t in row] for row in raw]
    ids = prompts.batch["input_ids"]
    mask = prompts.batch["attention_mask"].bool()
    return [row[keep].tolist() for row, keep in zip(ids, mask)]


def engine_requests(prompts: DataProto, image_token_id: int | None = None) -> list[dict[str, Any]]:
    """vLLM's requests (`TokensPrompt` dicts) for these prompts: the ids, and for a prompt with images its
    `multi_modal_data` (`{"image": [PIL images]}`, the dataset's) with each image's run of pad tokens
    collapsed to one, as a processor leaves the text before expanding it: the engine expands it again from
    the images, and encodes each image once for all `n` samples of its request."""
    rows = prompt_token_ids(prompts)
    images = prompts.non_tensor_batch.get("multi_modal_data")
    if images is None or not any(images):
        return [{"prompt_token_ids": ids} for ids in rows]
    if image_token_id is None:
        raise ValueError("these prompts hold images but the model has no image token (config.image_token_id): "
                         "a text-only model cannot read them")
    requests = []
    for ids, data in zip(rows, images):
        if not data:
            requests.append({"prompt_token_ids": ids})
            continue
        collapsed = [t for i, t in enumerate(ids) if t != image_token_id or i == 0 or ids[i - 1] != image_token_id]
        requests.append({"prompt_token_ids": collapsed, "multi_modal_data": dict(data)})
    return requests


def refuse_images(prompts: DataProto, what: str) -> None:
    """Stop a generation path that would drop the prompts' images (and sample blind)."""
    images = prompts.non_tensor_batch.get("multi_modal_data")
    if images is not None and any(images):
        raise NotImplementedError(f"{what} do not take images yet; sample prompts with images with "
                                  "actor_rollout_ref.rollout.name=hf (single- or multi-turn) or single-turn vLLM")


def pad_log_probs(rows: Sequence[Sequence[float]], width: int) -> torch.Tensor:
    """Right-pad per-token log-prob lists into a (len(rows), width) float32 tensor."""
    out = torch.full((len(rows), width), LOG_PROB_PAD, dtype=torch.float32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
    return out


def assemble_rollout_output(
    prompts: DataProto,
    responses: torch.Tensor,
    n: int,
    log_probs: torch.Tensor | None = None,
    response_attention_mask: torch.Tensor | None = None,
) -> DataProto:
    """Build the rollout output (module docstring) from the input batch and the (B·n, L) responses.
    `response_attention_mask` replaces the default (1 up to and including the first EOS) for responses
    that hold several EOS, such as multi-turn episodes."""
    idx = prompts.batch["input_ids"]
    attention_mask = prompts.batch["attention_mask"]
    position_ids = prompts.batch["position_ids"]
    if responses.shape[0] != idx.shape[0] * n:
        raise ValueError(f"got {responses.shape[0]} responses for {idx.shape[0]} prompts x n={n}")
    if n > 1:
        idx = idx.repeat_interleave(n, dim=0)
        attention_mask = attention_mask.repeat_interleave(n, dim=0)
        position_ids = position_ids.repeat_interleave(n, dim=0)
    responses = responses.to(idx.device)

    # Response positions continue from the last prompt position (also for (B, 3, P) mrope ids).
    steps = torch.arange(1, responses.shape[1] + 1, device=position_ids.device, dtype=position_ids.dtype)
    response_position_ids = position_ids[..., -1:] + steps
    if response_attention_mask is None:
        response_mask = get_response_mask(responses, prompts.meta_info["eos_token_id"], dtype=attention_mask.dtype)
    else:
        response_mask = response_attention_mask.to(device=idx.device, dtype=attention_mask.dtype)

    tensors = {
        "prompts": idx,
        "responses": responses,
        "input_ids": torch.cat([idx, responses], dim=-1),
        "attention_mask": torch.cat([attention_mask, response_mask], dim=-1),
        "position_ids": torch.cat([position_ids, response_position_ids], dim=-1),
    }
    if log_probs is not None:
        tensors["rollout_log_probs"] = log_probs.to(idx.device)
    non_tensors = {
        key: np.repeat(value, n, axis=0)
        for key, value in prompts.non_tensor_batch.items()
        if key not in CONSUMED_NON_TENSOR_KEYS
    }
    return DataProto.from_dict(tensors, non_tensors, meta_info=dict(prompts.meta_info))
