"""Remove-padding forwards: a padded micro-batch packed into one row of its valid tokens, and back.

A micro-batch row is a left-padded prompt followed by a right-padded response, (B, T) with T = P + L.
`pack_micro_batch` keeps the tokens where `attention_mask` is 1, row after row, as ONE row
(1, N), N = attention_mask.sum(), with position ids that restart at 0 for every sequence (the
padded path's `compute_position_id_with_mask` values at those tokens):

    tokens     [p p a b c | d e p]   [a b | c p p]      ->   [a b c d e a b c]
    positions                                                [0 1 2 3 4 0 1 2]

The model is called through `PackedMicroBatch.forward(model, ...)`: no attention mask, the restarting
position ids, the sequence boundaries `cu_seq_lens_q/k` (transformers' varlen keywords) and the same
boundaries as Python ints (`hflow_sequence_bounds`), read from the device once per micro-batch, in
`pack_micro_batch`. Each attention kernel then keeps every token inside its own sequence:

- flash-attention 2 (GPU) runs its varlen kernel on `cu_seq_lens` (with `max_length_q/k` given as ints,
  transformers reads nothing back from the device per layer) and builds no mask;
- `SDPA_VARLEN`, hflow's default where flash-attention is unavailable (CPU, or a GPU without flash-attn):
  on a GPU in bf16/fp16, PyTorch's own varlen kernel (`torch.nn.attention.varlen.varlen_attn`, FlashAttention
  inside torch, where the installed torch has it: one kernel per layer for all sequences); elsewhere (CPU,
  fp32, an older torch) PyTorch SDPA causally on each sequence's slice of the Python bounds. Either way
  attention costs sum(len_i^2), not N^2, and no layer waits for the device. Its mask builder returns no mask while
  `forward` runs (transformers would otherwise see the restarting position ids and build a (1, 1, N, N)
  block-diagonal mask, 1 GiB at N = 32k, that this attention never reads);
- any other implementation (sdpa, eager, flex named explicitly) gets transformers' block-diagonal
  causal mask, built from the position ids (`find_packed_sequence_indices`): same values, N x N mask,
  N^2 work.

Every token sees exactly the context it has in the padded row, so the outputs are the padded path's.

Response slot (b, j), the token at column P+j, is scored (log-prob of it; the critic: the value of the
state before it) by the output one packed position earlier. Only valid response tokens get a slot in
the packed output (`scoring_positions`); `unpack_response` scatters per-slot outputs back into the
(B, L) response window, 0 where the response is padding. Every row must hold at least one valid
prompt token (a response token must never be the first of its sequence).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import inspect
from functools import lru_cache

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

__all__ = ["SDPA_VARLEN", "SEQUENCE_BOUNDS", "PackedMicroBatch", "causal_window_mask", "pack_micro_batch",
           "packing_unsupported", "per_sequence_attention", "softcapped_attention",
           "uses_varlen_kernel", "varlen_attention", "varlen_kernel",
           "exclude_attention_from_compile"]

SDPA_VARLEN = "hflow_sdpa_varlen"
SEQUENCE_BOUNDS = "hflow_sequence_bounds"  # forward keyword: the packed offsets as a tuple of ints

# The packed forward's keywords that describe the text's sequences (`PackedMicroBatch.model_inputs`).
_PACKING_KEYWORDS = (SEQUENCE_BOUNDS, "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")

# True while `PackedMicroBatch.forward` runs a model: the mask builder below then builds no mask.
_PACKED_FORWARD: ContextVar[bool] = ContextVar("hflow_packed_forward", default=False)


@contextmanager
def _packed_forward() -> Iterator[None]:
    token = _PACKED_FORWARD.set(True)
    try:
        yield
    finally:
        _PACKED_FORWARD.reset(token)


def _sdpa_varlen_mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor | None:
    """transformers' SDPA mask, except in a packed forward (no 2D mask given): none, as the attention below
    attends per sequence from the bounds and reads no mask."""
    if attention_mask is None and _PACKED_FORWARD.get():
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def _sdpa_varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           **kwargs: Any) -> tuple[torch.Tensor, None]:
    """PyTorch SDPA that, given packed sequences, attends causally within each one.

    The bounds come as ints (`hflow_sequence_bounds`, what `PackedMicroBatch.forward` passes: nothing is
    read from the device here) or else as the tensor `cu_seq_lens_q` (a caller of its own: read once per
    layer). Without either (every padded forward) it is transformers' own SDPA attention, unchanged.
    query (1, H, N, D), key / value (1, H_kv, N, D) -> (1, N, H, D), as every attention function returns.
    """
    if kwargs.get("is_causal", getattr(module, "is_causal", True)) is False:
        # a bidirectional attention (a vision encoder's, on its own image's patches): the packed text's bounds,
        # which the model hands down to it with the other keywords, are not its sequences
        kwargs = {k: v for k, v in kwargs.items() if k not in _PACKING_KEYWORDS}
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    bounds = kwargs.get(SEQUENCE_BOUNDS)
    if bounds is None and kwargs.get("cu_seq_lens_q") is not None:
        bounds = kwargs["cu_seq_lens_q"].tolist()
    # Gemma 2's layers soft-cap their scores, which SDPA cannot; sliding-window layers (Gemma 2/3, Mistral)
    # attend to the last `sliding_window` keys only: transformers' padded masks carry the window, a packed
    # row has no mask, so the per-sequence paths apply it themselves.
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    if bounds is None:
        if attention_mask is None and _PACKED_FORWARD.get():
            raise RuntimeError(f"a packed forward reached {SDPA_VARLEN} without its sequence bounds "
                               f"({SEQUENCE_BOUNDS} or cu_seq_lens_q): it would attend across sequences")
        if softcap is not None:
            return softcapped_attention(query, key, value, attention_mask, scaling, softcap), None
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    starts = kwargs.get("cu_seq_lens_q")
    kernel = varlen_kernel()
    longest = kwargs.get("max_length_q") or max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    windowed = window is not None and int(longest) > int(window)
    if (kernel is not None and dropout == 0.0 and starts is not None and uses_varlen_kernel(query)
            and not windowed and softcap is None):
        return varlen_attention(kernel, query, key, value, starts, int(longest), scaling), None
    return per_sequence_attention(query, key, value, bounds, dropout, scaling, window, softcap), None


def per_sequence_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: tuple[int, ...],
                           dropout: float = 0.0, scaling: float | None = None, window: int | None = None,
                           softcap: float | None = None) -> torch.Tensor:
    """Causal attention on each sequence's slice of the packed row, one call per sequence: SDPA, with a
    banded mask where the sequence is longer than a sliding `window`; `softcapped_attention` with a `softcap`.
    query (1, H, N, D), key / value (1, H_kv, N, D) -> (1, N, H, D)."""
    gqa = query.shape[1] != key.shape[1]
    outputs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        q, k, v = query[:, :, start:end], key[:, :, start:end], value[:, :, start:end]
        windowed = window is not None and end - start > window
        if softcap is not None:
            mask = causal_window_mask(end - start, window, query.device)
            outputs.append(softcapped_attention(q, k, v, mask, scaling, softcap).transpose(1, 2))
        elif windowed:
            mask = causal_window_mask(end - start, window, query.device)
            outputs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                                          enable_gqa=gqa))
        else:
            outputs.append(F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling, is_causal=True,
                                                          enable_gqa=gqa))
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()


def causal_window_mask(length: int, window: int | None, device: torch.device) -> torch.Tensor:
    """(length, length) bool, True where query i may attend key j: j <= i, and i - j < window if given
    (transformers' sliding-window convention)."""
    i = torch.arange(length, device=device)
    allowed = i[None, :] <= i[:, None]
    if window is not None:
        allowed &= i[:, None] - i[None, :] < window
    return allowed


def softcapped_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                         scaling: float | None, softcap: float) -> torch.Tensor:
    """Attention with Gemma 2's score soft-capping, softcap * tanh(scores / softcap), written out (SDPA has
    no such step). `mask`: bool (True: attend) or additive, broadcastable to (B, H, Q, K); None: causal.
    query (B, H, Q, D), key / value (B, H_kv, K, D) -> (B, Q, H, D)."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = causal_window_mask(query.shape[-2], None, query.device)
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    else:
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous()


@lru_cache(maxsize=1)
def varlen_kernel() -> Any:
    """`torch.nn.attention.varlen.varlen_attn` with the keywords this torch spells causality and GQA with, as
    `(function, causal_kwargs, has_gqa)`; None where this torch has no such kernel (before 2.10) or spells
    causality some other way."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:  # torch >= 2.12: (-1, 0) is causal
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in params:  # the first releases
        causal = {"is_causal": True}
    else:
        return None
    return varlen_attn, causal, "enable_gqa" in params


def uses_varlen_kernel(query: torch.Tensor) -> bool:
    """Whether a packed attention on `query` runs `varlen_kernel()`: its FlashAttention kernels exist for
    CUDA tensors in half precision only (torch 2.13 on CPU: no kernel); elsewhere the per-sequence loop."""
    return query.is_cuda and query.dtype in (torch.bfloat16, torch.float16)


def varlen_attention(kernel: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     sequence_starts: torch.Tensor, longest: int, scaling: float | None = None) -> torch.Tensor:
    """Causal attention of every packed sequence in one call of `kernel` (`varlen_kernel()`'s triple).
    query (1, H, N, D), key / value (1, H_kv, N, D), `sequence_starts` (S + 1,) int32 -> (1, N, H, D)."""
    function, causal, has_gqa = kernel
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (N, heads, D), the kernel's layout
    extra = dict(causal)
    if q.shape[1] != k.shape[1]:
        if has_gqa:
            extra["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    starts = sequence_starts.to(device=q.device, dtype=torch.int32)
    out = function(q, k, v, starts, starts, longest, longest, scale=scaling, **extra)
    return out.unsqueeze(0)


# Registered under a name of its own (transformers' extension point), chosen by
# `hflow.workers.fsdp.default_attn_implementation` where flash-attention is unavailable; its padded masks are SDPA's.
AttentionInterface.register(SDPA_VARLEN, _sdpa_varlen_attention)
AttentionMaskInterface.register(SDPA_VARLEN, _sdpa_varlen_mask)


def exclude_attention_from_compile() -> None:
    """Register `SDPA_VARLEN` again as a function torch.compile does not trace (`use_torch_compile` compiles
    whole decoder layers): its loop over Python sequence bounds would make every new number of sequences in a
    micro-batch a recompile, and there is nothing to fuse in it. Eager runs are unchanged."""
    AttentionInterface.register(SDPA_VARLEN, torch.compiler.disable(_sdpa_varlen_attention, recursive=True))


# Layer types whose attention keeps to each packed sequence (their kernels read the bounds above).
PACKABLE_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})


def packing_unsupported(model: torch.nn.Module) -> str | None:
    """Why a packed forward of `model` would mix its sequences, or None. Linear-attention and state-space
    layers (Qwen3-Next's and Qwen3.5's gated delta net) carry a state along the row; transformers' torch
    kernels for them ignore the sequence bounds, so one sequence's state would flow into the next."""
    layer_types = getattr(getattr(model, "config", None), "layer_types", None) or ()
    others = sorted(set(layer_types) - PACKABLE_LAYER_TYPES)
    if others:
        return (f"its {', '.join(others)} layers carry state across the packed row (transformers' kernels "
                "ignore the sequence bounds), so packed sequences would leak into each other")
    return None


@dataclass
class PackedMicroBatch:
    input_ids: torch.Tensor  # (1, N) the valid tokens, row after row
    position_ids: torch.Tensor  # (1, N) restarting at 0 for every row
    scoring_positions: torch.Tensor  # (K,) packed positions whose outputs score the K valid response tokens
    response_slots: torch.Tensor  # (K,) flat indices into (B, L) of those response tokens
    response_shape: tuple[int, int]  # (B, L)
    sequence_starts: torch.Tensor  # (B + 1,) int32 packed offsets of the sequences, then N (`cu_seqlens`)
    bounds: tuple[int, ...]  # the same offsets, read once from the device
    longest: int  # tokens in the longest sequence

    def model_inputs(self) -> dict[str, Any]:
        """Keyword arguments of the packed forward (besides `use_cache`, `logits_to_keep`)."""
        return {"input_ids": self.input_ids, "attention_mask": None, "position_ids": self.position_ids,
                "cu_seq_lens_q": self.sequence_starts, "cu_seq_lens_k": self.sequence_starts,
                "max_length_q": self.longest, "max_length_k": self.longest, SEQUENCE_BOUNDS: self.bounds}

    def forward(self, model: torch.nn.Module, **kwargs: Any) -> Any:
        """`model(**self.model_inputs(), **kwargs)`, with `SDPA_VARLEN` building no attention mask; `kwargs`
        may replace an input (a vision-language model's multimodal `position_ids`)."""
        reason = packing_unsupported(model)
        if reason is not None:
            raise ValueError(f"use_remove_padding=true cannot pack {type(model).__name__}: {reason}; "
                             "set actor_rollout_ref.model.use_remove_padding=false (and critic.model's)")
        with _packed_forward():
            return model(**{**self.model_inputs(), **kwargs})

    def unpack_response(self, values: torch.Tensor) -> torch.Tensor:
        """Per-slot outputs (K, ...), in `scoring_positions` order -> (B, L, ...), zero at padded response
        tokens. Differentiable (an out-of-place index_put)."""
        batch, length = self.response_shape
        out = values.new_zeros((batch * length, *values.shape[1:]))
        out = out.index_put((self.response_slots,), values)
        return out.view(batch, length, *values.shape[1:])


def pack_micro_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int) -> PackedMicroBatch:
    """Pack a padded (B, T) micro-batch whose last `response_length` columns are the responses."""
    batch, seq_len = input_ids.shape
    valid = attention_mask.bool()
    flat_valid = valid.reshape(-1)
    token_index = flat_valid.nonzero().squeeze(-1)  # (N,) flat indices into (B, T)
    positions = (attention_mask.long().cumsum(-1) - 1).reshape(-1)
    packed_index = flat_valid.long().cumsum(0) - 1  # packed position of each valid token of (B, T)

    response_valid = valid[:, seq_len - response_length :]
    response_slots = response_valid.reshape(-1).nonzero().squeeze(-1)  # (K,) flat indices into (B, L)
    rows = torch.div(response_slots, response_length, rounding_mode="floor")
    columns = response_slots % response_length + (seq_len - response_length)
    scoring_positions = packed_index[rows * seq_len + columns] - 1
    if bool((positions[rows * seq_len + columns] == 0).any()):
        raise ValueError("a row's first valid token is a response token (empty prompt); it cannot be scored")
    lengths = valid.sum(-1)
    lengths = lengths[lengths > 0]  # an all-padding row is no sequence
    sequence_starts = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    bounds = tuple(sequence_starts.tolist())  # the one read of the boundaries for the whole forward
    return PackedMicroBatch(
        input_ids=input_ids.reshape(-1)[token_index].unsqueeze(0),
        position_ids=positions[token_index].unsqueeze(0),
        scoring_positions=scoring_positions,
        response_slots=response_slots,
        response_shape=(batch, response_length),
        sequence_starts=sequence_starts,
        bounds=bounds,
        longest=max(b - a for a, b in zip(bounds[:-1], bounds[1:])) if len(bounds) > 1 else 0,
    )
