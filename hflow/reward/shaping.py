"""Reward details of the seed RLHF systems (InstructGPT, DeepSpeed-Chat, OpenAI lm-human-preferences).

Each is off by default and is one plain function (or one small class) over tensors, which the trainer
calls in its reward step:

* `clip_sequence_scores` (`algorithm.reward_clip`, DeepSpeed-Chat): each sequence's score clipped to
  [-c, c] before the KL penalty.
* `stop_token_view` and `finish_stop_token_scores` (`algorithm.stop_token`, `.missing_stop_penalty`,
  lm-human-preferences): the reward sees each response cut after its first stop token; a response
  without one gets a fixed penalty instead of its score.
* `RewardNormalization` (`reward_model.normalize`, lm-human-preferences): a gain and bias, fitted once
  before training on fresh samples, that give the reward model's scores mean 0 and std 1.

Scores are sequence-level: `token_level_scores` holds each sequence's score on its last valid
response token (zeros elsewhere), as the reward manager and the reward model worker write them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hflow.config_schema import ConfigError
from hflow.protocol import DataProto
from hflow.utils.errors import UserError
from hflow.utils.torch_functional import last_valid_index, response_attention_mask

__all__ = [
    "RewardNormalization",
    "clip_sequence_scores",
    "finish_stop_token_scores",
    "resolve_stop_token_id",
    "stop_token_view",
]


# -------------------------------------------------------------------------------- reward clipping


def clip_sequence_scores(token_level_scores: torch.Tensor, response_mask: torch.Tensor,
                         clip: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Scores whose per-sequence sum is clamped to [-clip, clip] (`algorithm.reward_clip`).

    The correction goes onto each sequence's last valid response token, where the score sits, so a
    score stays where the advantage estimators read it. Returns the new scores (a copy) and
    ``reward/clipped_frac``, the fraction of sequences whose score was clipped.
    """
    scores = token_level_scores.sum(-1)
    clipped = scores.clamp(-clip, clip)
    out = token_level_scores.clone()
    rows = torch.arange(len(out), device=out.device)
    out[rows, last_valid_index(response_mask)] += (clipped - scores).to(out.dtype)
    frac = (clipped != scores).float().mean().item() if len(scores) else 0.0
    return out, {"reward/clipped_frac": frac}


# -------------------------------------------------------------------------------- stop token


def resolve_stop_token_id(tokenizer, text: str, key: str = "algorithm.stop_token") -> int:
    """The one token id that the policy tokenizer encodes `text` to; a `ConfigError` naming `key` else."""
    ids = tokenizer.encode(str(text), add_special_tokens=False)
    if len(ids) != 1:
        raise ConfigError(
            f"{key}={text!r} is {len(ids)} tokens {ids} for the policy tokenizer; it must be exactly one token "
            "(a special token such as the end-of-turn token, or a single character the vocabulary holds whole)")
    return int(ids[0])


def stop_token_view(batch: DataProto, stop_token_id: int, pad_token_id: int) -> tuple[DataProto, torch.Tensor]:
    """The batch as the reward sees it, and which responses hold the stop token (bool, (N,)).

    Each response is cut after its first `stop_token_id` (the stop token is kept): in the view, the
    attention mask (and `response_mask`, when present) is 0 after it and those response tokens are
    padding, so a reward model scores the last kept token and a reward manager decodes the text up to
    the stop token. The view shares every other tensor with `batch`, which is left as generated.
    """
    responses = batch.batch["responses"]
    length = responses.shape[-1]
    attention_mask = batch.batch["attention_mask"]
    response_mask = response_attention_mask(attention_mask, responses).bool()
    is_stop = (responses == stop_token_id) & response_mask
    has_stop = is_stop.any(-1)
    stops_before = is_stop.long().cumsum(-1) - is_stop.long()  # stop tokens strictly before each position
    keep = response_mask & (stops_before == 0)
    cut_responses = torch.where(keep, responses, torch.full_like(responses, pad_token_id))
    cut_mask = keep.to(attention_mask.dtype)

    view = DataProto(batch=batch.batch.copy(), non_tensor_batch=dict(batch.non_tensor_batch),
                     meta_info=dict(batch.meta_info))
    view.batch["responses"] = cut_responses
    view.batch["input_ids"] = torch.cat([batch.batch["input_ids"][:, :-length], cut_responses], dim=-1)
    view.batch["attention_mask"] = torch.cat([attention_mask[:, :-length], cut_mask], dim=-1)
    if "response_mask" in batch.batch.keys():
        view.batch["response_mask"] = cut_mask.to(batch.batch["response_mask"].dtype)
    return view, has_stop


def finish_stop_token_scores(view_scores: torch.Tensor, response_mask: torch.Tensor, has_stop: torch.Tensor,
                             penalty: float | None) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level scores for the responses as generated, from the scores of their cut view.

    Each sequence's score (the sum of its view's scores) goes onto the last generated token (the
    episode ends there; `response_mask` is the generated responses' mask). A response without the stop
    token scores `penalty` instead, unless `penalty` is None. Returns the scores and
    ``response/missing_stop_frac``.
    """
    scores = view_scores.sum(-1)
    if penalty is not None:
        scores = torch.where(has_stop, scores, torch.full_like(scores, float(penalty)))
    out = torch.zeros_like(view_scores)
    out[torch.arange(len(out), device=out.device), last_valid_index(response_mask)] = scores.to(out.dtype)
    frac = (~has_stop).float().mean().item() if len(has_stop) else 0.0
    return out, {"response/missing_stop_frac": frac}


# -------------------------------------------------------------------------------- reward normalisation


@dataclass
class RewardNormalization:
    """``gain * score + bias`` for every reward-model score (`reward_model.normalize`).

    `fit` chooses gain and bias so that the scores it is given get mean 0 and (population) std 1, as
    lm-human-preferences does once before training; they then stay fixed, travel in the checkpoint
    (`state_dict` / `load_state_dict`) and are never refitted on resume.
    """

    gain: float = 1.0
    bias: float = 0.0
    fitted: bool = False

    def fit(self, scores: torch.Tensor) -> None:
        scores = scores.double().flatten()
        if scores.numel() < 2:
            raise UserError(f"reward_model.normalize: {scores.numel()} scored samples; at least 2 are needed")
        mean, std = scores.mean().item(), scores.std(unbiased=False).item()
        if not std > 1e-8:
            raise UserError(
                f"reward_model.normalize: the reward model gave all {scores.numel()} samples the same score "
                f"({mean:.6g}), so it cannot be scaled to std 1; check reward_model.model.path, raise "
                "reward_model.normalize.num_prompts, or set reward_model.normalize.enable=false")
        self.gain, self.bias, self.fitted = 1.0 / std, -mean / std, True

    def apply(self, rm_scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
        """`rm_scores` (N, L) with each sequence's score, on its last valid token, mapped to gain*s+bias.
        Rows without a response hold no score and stay 0."""
        out = rm_scores * self.gain
        has_response = response_mask.sum(-1) > 0
        rows = torch.arange(len(out), device=out.device)[has_response]
        out[rows, last_valid_index(response_mask)[has_response]] += self.bias
        return out

    def metrics(self) -> dict[str, float]:
        return {"reward/norm_gain": self.gain, "reward/norm_bias": self.bias}

    def state_dict(self) -> dict[str, float]:
        return {"gain": float(self.gain), "bias": float(self.bias)}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.gain, self.bias, self.fitted = float(state["gain"]), float(state["bias"]), True
