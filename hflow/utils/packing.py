"""Remove-padding forwards: a padded micro-batch packed into one row of its valid tokens, and back.

A micro-batch row is a left-padded prompt followed by a right-padded response, (B, T) with T = P + L.
`pack_micro_batch` keeps the tokens where `attention_mask` is 1, row after row, as ONE row
(1, N), N = attention_mask.sum(), with position ids that restart at 0 for every sequence (the
padded path's `compute_position_id_with_mask` values at those tokens):

    tokens     [p p a b c | d e p]   [a b | c p p]      ->   [a b c d e a b c]
    positions                                                [0 1 2 3 4 0 1 2]

Called with `attention_mask=None`, Hugging Face models (transformers 5, `masking_utils`) read
the packing off the position ids: each drop in position starts a new sequence.
`find_packed_sequence_indices` turns them into sequence ids and the SDPA / eager / flex masks become
causal AND same-sequence, i.e. block-diagonal; flash-attention 2 instead takes `cu_seqlens` from the
positions that are 0 and runs its varlen kernel. Either way no token attends across sequences, and
every token sees exactly the context it has in the padded row, so the outputs are the padded path's.

Response slot (b, j), the token at column P+j, is scored (log-prob of it; the critic: the value of the
state before it) by the output one packed position earlier. Only valid response tokens get a slot in
the packed output (`scoring_positions`); `unpack_response` scatters per-slot outputs back into the
(B, L) response window, 0 where the response is padding. Every row must hold at least one valid
prompt token (a response token must never be the first of its sequence).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PackedMicroBatch", "pack_micro_batch"]


@dataclass
class PackedMicroBatch:
    input_ids: torch.Tensor  # (1, N) the valid tokens, row after row
    position_ids: torch.Tensor  # (1, N) restarting at 0 for every row
    scoring_positions: torch.Tensor  # (K,) packed positions whose outputs score the K valid response tokens
    response_slots: torch.Tensor  # (K,) flat indices into (B, L) of those response tokens
    response_shape: tuple[int, int]  # (B, L)

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
    return PackedMicroBatch(
        input_ids=input_ids.reshape(-1)[token_index].unsqueeze(0),
        position_ids=positions[token_index].unsqueeze(0),
        scoring_positions=scoring_positions,
        response_slots=response_slots,
        response_shape=(batch, response_length),
    )
