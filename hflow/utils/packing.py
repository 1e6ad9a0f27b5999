"""Remove-padding forwards: a padded micro-batch packed into one row of its valid tokens, and back.

A micro-batch row is a left-padded prompt followed by a right-padded response, (B, T) with T = P + L.
`pack_micro_batch` keeps the tokens where `attention_mask` is 1, row after row, as ONE row
(1, N), N = attention_mask.sum(), with position ids that restart at 0 for every sequence (the
padded path's `compute_position_id_with_mask` values at those tokens):

    tokens     [p p a b c | d e p]   [a b | c p p]      ->   [a b c d e a b c]
    positions                                                [0 1 2 3 4 0 1 2]

The model is called with `PackedMicroBatch.model_inputs()`: no attention mask, the restarting position
ids and the sequence boundaries `cu_seq_lens_q/k` (transformers' varlen keywords). Each attention kernel
then keeps every token inside its own sequence:

- flash-attention 2 (GPU) runs its varlen kernel on `cu_seq_lens`;
- `SDPA_VARLEN`, hflow's default where flash-attention is unavailable (CPU), runs PyTorch SDPA causally on
  each sequence's slice, so attention costs sum(len_i^2), not N^2, and no N x N mask is ever used;
- any other implementation (sdpa, eager, flex named explicitly) gets transformers' block-diagonal
  causal mask, built from the position ids (`find_packed_sequence_indices`): same values, N^2 work.

Every token sees exactly the context it has in the padded row, so the outputs are the padded path's.

Response slot (b, j), the token at column P+j, is scored (log-prob of it; the critic: the value of the
state before it) by the output one packed position earlier. Only valid response tokens get a slot in
the packed output (`scoring_positions`); `unpack_response` scatters per-slot outputs back into the
(B, L) response window, 0 where the response is padding. Every row must hold at least one valid
prompt token (a response token must never be the first of its sequence).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

__all__ = ["SDPA_VARLEN", "PackedMicroBatch", "pack_micro_batch"]

SDPA_VARLEN = "hflow_sdpa_varlen"


def _sdpa_varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           **kwargs: Any) -> tuple[torch.Tensor, None]:
    """PyTorch SDPA that, given packed sequences (`cu_seq_lens_q`), attends causally within each one.

    Without `cu_seq_lens_q` (every padded forward) it is transformers' own SDPA attention, unchanged.
    query (1, H, N, D), key / value (1, H_kv, N, D) -> (1, N, H, D), as every attention function returns.
    """
    boundaries = kwargs.get("cu_seq_lens_q")
    if boundaries is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    gqa = query.shape[1] != key.shape[1]
    bounds = boundaries.tolist()
    outputs = [
        F.scaled_dot_product_attention(query[:, :, start:end], key[:, :, start:end], value[:, :, start:end],
                                       dropout_p=dropout, scale=scaling, is_causal=True, enable_gqa=gqa)
        for start, end in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


# Registered under a name of its own (transformers' extension point), chosen by
# `fsdp_utils.default_attn_implementation` where flash-attention is unavailable; its padded masks are SDPA's.
AttentionInterface.register(SDPA_VARLEN, _sdpa_varlen_attention)
AttentionMaskInterface.register(SDPA_VARLEN, sdpa_mask)


@dataclass
class PackedMicroBatch:
    input_ids: torch.Tensor  # (1, N) the valid tokens, row after row
    position_ids: torch.Tensor  # (1, N) restarting at 0 for every row
    scoring_positions: torch.Tensor  # (K,) packed positions whose outputs score the K valid response tokens
    response_slots: torch.Tensor  # (K,) flat indices into (B, L) of those response tokens
    response_shape: tuple[int, int]  # (B, L)
    sequence_starts: torch.Tensor  # (B + 1,) int32 packed offsets of the sequences, then N (`cu_seqlens`)
    longest: int  # tokens in the longest sequence

    def model_inputs(self) -> dict[str, Any]:
        """Keyword arguments of the packed forward (besides `use_cache`, `logits_to_keep`)."""
        return {"input_ids": self.input_ids, "attention_mask": None, "position_ids": self.position_ids,
                "cu_seq_lens_q": self.sequence_starts, "cu_seq_lens_k": self.sequence_starts,
                "max_length_q": self.longest, "max_length_k": self.longest}

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
    return PackedMicroBatch(
        input_ids=input_ids.reshape(-1)[token_index].unsqueeze(0),
        position_ids=positions[token_index].unsqueeze(0),
        scoring_positions=scoring_positions,
        response_slots=response_slots,
        response_shape=(batch, response_length),
        sequence_starts=sequence_starts,
        longest=int(lengths.max()) if len(lengths) else 0,
    )
