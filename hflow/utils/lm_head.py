"""Log-probabilities and entropies straight from the last hidden states: the LM head, the temperature, the
log-softmax and the entropy in one pass over blocks of rows, never holding the (N, V) logits.

Per block of rows, z = h W^T / T is built (in the weights' dtype, as the head would), reduced in fp32 to
log p(y) = z_y - logsumexp(z) and H = -sum_v p_v log p_v, and dropped. Backward builds each block's z again
and its gradient

    dL/dz = p * ((E_p[z] - z) * g_H - g_lp) + onehot(y) * g_lp,      then / T,

from which dL/dh = dL/dz W and dL/dW += dL/dz^T h (accumulated in fp32 for a low-precision W). Memory beyond
the inputs: one block of logits and its fp32 copy, and W's fp32 gradient; no logits for the whole
micro-batch, no fp32 logits at all in half precision.

`fused_lm_head(model, labels, ...)` puts this in place of a Hugging Face causal LM's output layer for one
forward: the model's forward (and FSDP2's hooks around it, which gather and free the head's weight) runs as
usual, and what it returns as `logits` is (..., 2): the log-probs and the entropies of the rows it scored.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


class _LinearLogProbsEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float,
                rows: int) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        compute = torch.promote_types(hidden.dtype, torch.float32)
        n = hidden.shape[0]
        log_probs = torch.empty(n, dtype=compute, device=hidden.device)
        entropy, lse, mean_z = torch.empty_like(log_probs), torch.empty_like(log_probs), torch.empty_like(log_probs)
        for start in range(0, n, rows):
            end = min(n, start + rows)
            z = (hidden[start:end] @ weight.T).to(compute)
            if temperature != 1.0:
                z.div_(temperature)
            s = torch.logsumexp(z, dim=-1, keepdim=True)
            log_p = z.sub_(s)  # z is not needed again in forward: log p in its place
            log_probs[start:end] = log_p.gather(-1, labels[start:end, None]).squeeze(-1)
            h = -(log_p.exp() * log_p).sum(-1)  # no lse - E[z] cancellation
            entropy[start:end] = h
            lse[start:end] = s.squeeze(-1)
            mean_z[start:end] = s.squeeze(-1) - h  # E_p[z] = logsumexp(z) - H
        ctx.save_for_backward(hidden, weight, labels, lse, mean_z)
        ctx.temperature, ctx.rows = temperature, rows
        ctx.set_materialize_grads(False)  # an output nobody differentiates gets None: no work for it
        return log_probs, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_lp: torch.Tensor | None, grad_h: torch.Tensor | None):  # type: ignore[override]
        if grad_lp is None and grad_h is None:
            return None, None, None, None, None
        hidden, weight, labels, lse, mean_z = ctx.saved_tensors
        compute, t, rows = lse.dtype, ctx.temperature, ctx.rows
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_h else None
        # fp32 accumulation over blocks for a half-precision weight
        grad_weight = torch.zeros(weight.shape, dtype=compute, device=weight.device) if need_w else None
        for start in range(0, hidden.shape[0], rows):
            end = min(hidden.shape[0], start + rows)
            h_rows = hidden[start:end]
            z = (h_rows @ weight.T).to(compute)
            if t != 1.0:
                z.div_(t)
            p = torch.sub(z, lse[start:end, None]).exp_()
            g_lp = grad_lp[start:end, None].to(compute) if grad_lp is not None else None
            if grad_h is not None:  # p * ((E_p[z] - z) g_H - g_lp), in z's buffer
                coef = torch.sub(mean_z[start:end, None], z, out=z).mul_(grad_h[start:end, None])
                grad_z = p.mul_(coef.sub_(g_lp) if g_lp is not None else coef)
            else:
                grad_z = p.mul_(-g_lp)
            if g_lp is not None:
                grad_z.scatter_add_(-1, labels[start:end, None], g_lp)
            if t != 1.0:
                grad_z.div_(t)
            grad_z = grad_z.to(weight.dtype)
            if need_h:
                grad_hidden[start:end] = grad_z @ weight
            if need_w:
                grad_weight.add_(grad_z.T @ h_rows)
        if need_w:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def linear_log_probs_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                             temperature: float = 1.0, block_elements: int = 1 << 22
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(labels), entropy) of softmax(hidden W^T / temperature), each shaped like `labels`, in fp32 (or
    wider), in blocks of about `block_elements` logits; see the module."""
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} do not match")
    rows = max(1, int(block_elements) // weight.shape[0])
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    log_probs, entropy = _LinearLogProbsEntropy.apply(flat_h, weight, labels.reshape(-1), float(temperature), rows)
    return log_probs.view(labels.shape), entropy.view(labels.shape)


def output_layer(model: nn.Module) -> nn.Linear:
    """The causal LM's output layer, if a fused pass can stand in for it: a Linear without a bias, whose
    logits the model uses as they are (no soft-capping)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    config = getattr(model, "config", None)
    if not isinstance(head, nn.Linear) or head.bias is not None:
        raise ValueError(f"fused_lm_head needs an output layer that is a Linear without bias; "
                         f"{type(model).__name__} has {type(head).__name__}: set fused_lm_head=false")
    if config is not None and getattr(config, "final_logit_softcapping", None):
        raise ValueError(f"fused_lm_head: {type(model).__name__} soft-caps its logits; set fused_lm_head=false")
    return head


@contextmanager
def fused_lm_head(model: nn.Module, labels: torch.Tensor, temperature: float,
                  block_elements: int) -> Iterator[None]:
    """Within: `model`'s output layer returns (..., 2), log-probs of `labels` and entropies, for the rows it
    is given (those `logits_to_keep` selects, which must match `labels`' shape), instead of the logits."""
    head = output_layer(model)

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        # `head.weight` read now: FSDP2's gathered weight, or the one-rank compute copy
        log_probs, entropy = linear_log_probs_entropy(hidden, head.weight, labels, temperature, block_elements)
        return torch.stack((log_probs, entropy), dim=-1)

    head.forward = forward
    try:
        yield
    finally:
        del head.forward
