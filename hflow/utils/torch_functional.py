"""Tensor helpers shared by the algorithm code, the actor and the critic.

Everything here is pure torch. Masks are 0/1 tensors (bool, int or float) shaped like the values they
select; "masked" statistics only ever read positions where the mask is 1, so whatever sits elsewhere
(padding, NaN from an uninitialised buffer) cannot change the result.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from hflow.utils import device

__all__ = [
    "compute_position_id_with_mask",
    "entropy_from_logits",
    "get_constant_schedule_with_warmup",
    "get_cosine_schedule_with_warmup",
    "get_response_mask",
    "logprobs_at",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "pad_2d_list_to_length",
    "pad_sequence_to_length",
    "topk_logprobs",
]

# Denominators are clamped to this, so an empty mask gives 0 (its numerator is exactly 0) and a
# non-empty 0/1 mask gives the exact mean.
_TINY = 1e-8


# --------------------------------------------------------------------------------------------------
# Masked statistics
# --------------------------------------------------------------------------------------------------


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Sum of `values * mask`; positions outside the mask are replaced by 0 first, so a NaN or inf
    there does not turn the sum into NaN (plain `values * mask` would: NaN * 0 = NaN)."""
    kept = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    kept = kept * mask
    return kept.sum() if axis is None else kept.sum(dim=axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Mean of `values` over the positions where `mask` is 1 (over the whole tensor, or along `axis`).

    A row (or tensor) with an empty mask gives 0, not NaN.
    """
    count = mask.sum() if axis is None else mask.sum(dim=axis)
    return masked_sum(values, mask, axis) / count.clamp(min=_TINY)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `values` over the positions where `mask` is 1 (whole tensor).

    `unbiased=True` applies Bessel's correction n/(n-1), which needs at least two masked-in elements.
    """
    count = mask.sum()
    if count == 0:
        raise ValueError("masked_var: the mask selects no element")
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        if count == 1:
            raise ValueError("masked_var(unbiased=True) needs at least two masked-in elements; got one")
        var = var * count / (count - 1)
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise `values` to zero mean and unit variance using statistics of the masked-in positions.

    `(x - mean) / sqrt(var + 1e-8)` with the unbiased variance; with `shift_mean=False` the mean is
    added back (only the scale is normalised). Every position is transformed, masked-in or not; callers
    multiply by the mask when they need zeros outside it.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


# --------------------------------------------------------------------------------------------------
# Log-probabilities and entropy from logits
# --------------------------------------------------------------------------------------------------


# Rows are processed in blocks of about `block_elements` logits, which bounds the temporaries to one block
# instead of the whole (N, V) tensor; by default the device's size (`device.logit_block_elements`: 16 MiB of
# fp32 on CPU, 1 GiB on a GPU). A test or bench may pin it here (None: the device's).
_CHUNK_ELEMENTS: int | None = None


def block_elements_for(setting: int | None) -> int:
    """Elements per block: `setting`, else the module's pin, else this device's size."""
    return int(setting or _CHUNK_ELEMENTS or device.logit_block_elements())


def _row_blocks(*tensors: torch.Tensor, block: int) -> Iterator[tuple[torch.Tensor, ...]]:
    """Yield aligned 2-D views `(rows, last_dim)` of tensors that share their leading shape.

    Views, never copies: when the leading dims cannot be flattened into one (e.g. logits sliced as
    `logits[:, -L-1:-1]`), recurse over the first dim, whose entries can be.
    """
    try:
        flats = [t.view(-1, t.shape[-1]) for t in tensors]
    except RuntimeError:  # leading dims not mergeable without a copy
        for i in range(tensors[0].shape[0]):
            yield from _row_blocks(*(t[i] for t in tensors), block=block)
        return
    rows_per_block = max(1, block // max(1, tensors[0].shape[-1]))
    for start in range(0, flats[0].shape[0], rows_per_block):
        yield tuple(f[start : start + rows_per_block] for f in flats)


class _LogProbsFromLogits(torch.autograd.Function):
    """log softmax(z)[y] = z_y - logsumexp(z), with the gradient d/dz = (onehot(y) - softmax(z)) * g.

    Autograd of `log_softmax(z).gather(y)` keeps the (N, V) log-softmax for backward and builds two
    more (N, V) tensors in it (the scattered gather gradient and the log-softmax gradient). Here only
    the logits (which exist anyway) and one float per row are kept, and backward writes the gradient
    block by block into a single (N, V) tensor.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, block: int) -> torch.Tensor:  # type: ignore[override]
        compute_dtype = torch.promote_types(logits.dtype, torch.float32)
        labels = labels.contiguous().unsqueeze(-1)
        out = torch.empty(labels.shape, dtype=compute_dtype, device=logits.device)
        lse = torch.empty_like(out)
        ctx.block = block
        for z, y, o, s in _row_blocks(logits, labels, out, lse, block=block):
            z = z.to(compute_dtype)
            o.copy_(torch.log_softmax(z, dim=-1).gather(-1, y))  # fused kernel, one block-sized temporary
            s.copy_(z.gather(-1, y) - o)  # logsumexp(z) = z_y - log softmax(z)_y
        ctx.save_for_backward(logits, labels, lse)
        return out.squeeze(-1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        logits, labels, lse = ctx.saved_tensors
        grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        grad_out = grad_out.contiguous().unsqueeze(-1)
        for z, y, s, g, gz in _row_blocks(logits, labels, lse, grad_out, grad_logits, block=ctx.block):
            # computed in place in the output block (in an fp32 block for half-precision logits)
            block = gz if gz.dtype == s.dtype else torch.empty(gz.shape, dtype=s.dtype, device=gz.device)
            torch.sub(z, s, out=block).exp_().mul_(-g)  # -softmax(z) * g
            block.scatter_add_(-1, y, g)  # + onehot(y) * g
            if block is not gz:
                gz.copy_(block)
        return grad_logits, None, None


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, block_elements: int | None = None) -> torch.Tensor:
    """Log-probability of `labels` under softmax(`logits`): shape `labels.shape`, dtype at least fp32.

    Computed block of rows by block of rows (in fp32 for half-precision inputs) by a custom autograd
    function that keeps no (N, V) log-softmax for backward, only the logits and each row's
    logsumexp; backward builds the gradient block by block in place. Forward + backward need about
    one logits-sized buffer beyond the logits (the gradient), against about three for
    `log_softmax` + `gather`; see `bench/logprobs.py`. Blocks of about `block_elements` logits
    (`block_elements_for`).
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} do not match")
    return _LogProbsFromLogits.apply(logits, labels, block_elements_for(block_elements))


class _EntropyFromLogits(torch.autograd.Function):
    """H = -sum_v p_v log p_v with p = softmax(z), and dH/dz = p * (E_p[z] - z) * g.

    Autograd of the plain formula keeps softmax(z) and log_softmax(z) for backward and builds more
    (N, V) tensors in forward; here each block of rows is reduced at once, and only the logits (which
    exist anyway) and two floats per row (logsumexp and E_p[z]) are kept for backward.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, block: int) -> torch.Tensor:  # type: ignore[override]
        compute_dtype = torch.promote_types(logits.dtype, torch.float32)
        out = torch.empty((*logits.shape[:-1], 1), dtype=compute_dtype, device=logits.device)
        lse, mean_z = torch.empty_like(out), torch.empty_like(out)
        ctx.block = block
        for z, h, s, m in _row_blocks(logits, out, lse, mean_z, block=block):
            z = z.to(compute_dtype)
            s.copy_(torch.logsumexp(z, dim=-1, keepdim=True))
            log_p = z - s
            h.copy_(-log_p.exp().mul_(log_p).sum(dim=-1, keepdim=True))  # -sum p log p: no lse - E[z] cancellation
            m.copy_(s - h)  # E_p[z] = logsumexp(z) - H
        ctx.save_for_backward(logits, lse, mean_z)
        return out.squeeze(-1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        logits, lse, mean_z = ctx.saved_tensors
        grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        grad_out = grad_out.contiguous().unsqueeze(-1)
        for z, s, m, g, gz in _row_blocks(logits, lse, mean_z, grad_out, grad_logits, block=ctx.block):
            # s, m are fp32 (or fp64): the subtractions promote half-precision logits
            block = torch.sub(z, s).exp_()  # softmax(z)
            block.mul_(torch.sub(m, z)).mul_(g)  # * (E_p[z] - z) * g
            gz.copy_(block)
        return grad_logits, None


def entropy_from_logits(logits: torch.Tensor, block_elements: int | None = None) -> torch.Tensor:
    """Entropy of softmax(`logits`) along the last dim: shape `logits.shape[:-1]`, dtype at least fp32.

    Computed block of rows by block of rows (in fp32 for half-precision logits), like
    `logprobs_from_logits`: temporaries are bounded by one block instead of several (N, V) tensors
    (at 32 x 1024 positions and a 152k vocabulary each of those is ~10 GB in bf16), and backward keeps
    only the logits and two floats per row.
    """
    return _EntropyFromLogits.apply(logits, block_elements_for(block_elements))


def logprobs_at(logits: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor,
                label_log_probs: torch.Tensor) -> torch.Tensor:
    """log softmax(`logits`)[ids] for K ids per row, (..., K), given the log-probs of `labels` that
    `logprobs_from_logits` already computed (one per row). logsumexp(z) = z_label - log p_label, so no
    second pass over the vocabulary is made and nothing (N, V) is kept; its gradient is softmax(z), as
    logsumexp's own."""
    compute_dtype = label_log_probs.dtype
    lse = logits.gather(-1, labels.unsqueeze(-1)).to(compute_dtype) - label_log_probs.unsqueeze(-1)
    return logits.gather(-1, ids).to(compute_dtype) - lse


@torch.no_grad()
def topk_logprobs(logits: torch.Tensor, k: int, labels: torch.Tensor,
                  label_log_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, log-probs), each (..., k): the k most likely tokens of softmax(`logits`) per row, most likely
    first, with the logsumexp read off the labels' log-probs as in `logprobs_at`."""
    values, ids = logits.topk(k, dim=-1)
    lse = logits.gather(-1, labels.unsqueeze(-1)).to(label_log_probs.dtype) - label_log_probs.unsqueeze(-1)
    return ids, values.to(label_log_probs.dtype) - lse


# --------------------------------------------------------------------------------------------------
# Masks, positions and padding
# --------------------------------------------------------------------------------------------------


def get_response_mask(
    response_ids: torch.Tensor, eos_token: int | Sequence[int] = 2, dtype: torch.dtype = torch.int64
) -> torch.Tensor:
    """1 for every response token up to and including the first EOS, 0 after it.

    `eos_token` may be one id or several (any of them ends the response). A row without EOS is all 1.
    """
    eos_ids = torch.as_tensor(eos_token, device=response_ids.device).reshape(-1)
    is_eos = torch.isin(response_ids, eos_ids).long()
    eos_before = torch.cumsum(is_eos, dim=-1) - is_eos  # number of EOS strictly before each position
    return (eos_before == 0).to(dtype)


def response_attention_mask(attention_mask: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """The response positions of a (prompt + response) attention mask: 1 for every valid response token.

    The one place that cuts it: a batch whose rollout wrote `response_mask` (multi-turn: 0 on tool tokens)
    should use that instead where tool tokens must not count."""
    return attention_mask[:, -responses.shape[-1]:]


def last_valid_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last 1 in each row of a 0/1 mask (0 for an all-zero row: an empty response's score
    goes there too)."""
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return (positions * mask.long()).argmax(dim=-1)


def compute_position_id_with_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that count only attended tokens: 0, 1, 2, ... from the first 1 in `mask`
    (left padding gets 0)."""
    return torch.clamp(torch.cumsum(mask.long(), dim=-1) - 1, min=0)


def pad_sequence_to_length(
    tensors: torch.Tensor, max_seq_len: int, pad_token_id: int | float, left_pad: bool = False
) -> torch.Tensor:
    """Pad the last dim of `tensors` with `pad_token_id` up to `max_seq_len` (no-op if already as long)."""
    missing = max_seq_len - tensors.shape[-1]
    if missing <= 0:
        return tensors
    return F.pad(tensors, (missing, 0) if left_pad else (0, missing), value=pad_token_id)


def pad_2d_list_to_length(
    response: Sequence[Sequence[int]], pad_token_id: int, max_length: int | None = None
) -> torch.Tensor:
    """Right-pad a list of token-id lists into a (len(response), width) long tensor, where width is the
    longest row, or `max_length` if that is larger."""
    width = max((len(row) for row in response), default=0)
    if max_length is not None:
        width = max(width, max_length)
    return torch.tensor([list(row) + [pad_token_id] * (width - len(row)) for row in response], dtype=torch.long)


# --------------------------------------------------------------------------------------------------
# Learning-rate schedules
# --------------------------------------------------------------------------------------------------


def get_constant_schedule_with_warmup(optimizer: Optimizer, num_warmup_steps: int, last_epoch: int = -1) -> LambdaLR:
    """LR factor rises linearly from 0 to 1 over `num_warmup_steps`, then stays at 1."""

    def lr_lambda(step: int) -> float:
        return min(1.0, step / num_warmup_steps) if num_warmup_steps > 0 else 1.0

    return LambdaLR(optimizer, lr_lambda, last_epoch)


def get_cosine_schedule_with_warmup(
    optimizer: Optimizer,
    num_warmup_steps: int,
    num_training_steps: int,
    min_lr_ratio: float = 0.0,
    num_cycles: float = 0.5,
    last_epoch: int = -1,
) -> LambdaLR:
    """LR factor rises linearly from 0 to 1 over `num_warmup_steps`, then follows a cosine from 1 down to
    `min_lr_ratio` (`num_cycles=0.5`: one half-period over the remaining steps):

        factor = min_lr_ratio + (1 - min_lr_ratio) * (1 + cos(2 pi num_cycles progress)) / 2.
    """
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")

    def lr_lambda(step: int) -> float:
        if step < num_warmup_steps:
            return step / num_warmup_steps
        progress = (step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps)
        cosine = 0.5 * (1.0 + math.cos(2.0 * math.pi * num_cycles * progress))
        return min_lr_ratio + (1.0 - min_lr_ratio) * cosine

    return LambdaLR(optimizer, lr_lambda, last_epoch)
