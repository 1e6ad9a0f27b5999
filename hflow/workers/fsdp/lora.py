"""The actor's LoRA adapters: PEFT's wrapping (`models.apply_lora`) with a leaner forward.

PEFT's LoRA linear computes ``result = base(x) + lora_B(lora_A(x)) * scaling``: besides the base layer's
output it allocates three more tensors of the output's size per wrapped linear and call (B's output, its
scaled copy, the sum), each freed at once. On CPU these short-lived activation-sized blocks fragment the
allocator's heap: on SmolLM2-135M (`bench/results/lora_memory.md`) the allocator kept 1075 MiB at step 1
and the step-1 peak RSS was 3819 MiB against full fine-tuning's 3097, although LoRA's live tensors were
smaller (2744 against 2852 MiB); in place, 450 MiB and 3193 MiB. `add_lora` swaps each PEFT
linear for a subclass whose forward adds the adapter into the base output in place
(``out.addmm_(x A^T, B^T, alpha=scaling)``): the only new tensor is the rank-r product x A^T, and autograd
gives the same gradients (the base output is saved by nothing, so the in-place add is allowed).
Anything the fast path does not cover (adapters disabled or merged, several active adapters, dropout,
DoRA and other variants, mixed dtypes, extra arguments) runs PEFT's own forward.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from hflow.workers.fsdp.models import apply_lora

__all__ = ["add_lora", "fast_linear_class", "in_place_lora_linears"]

_FAST_CLASSES: dict[type, type] = {}


def fast_linear_class(peft_linear: type) -> type:
    """A subclass of PEFT's LoRA `Linear` with the in-place forward (one per PEFT class)."""
    if peft_linear not in _FAST_CLASSES:

        def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            adapter = _single_plain_adapter(self, x, args, kwargs)
            if adapter is None:
                return super(fast, self).forward(x, *args, **kwargs)
            lora_a, lora_b = self.lora_A[adapter].weight, self.lora_B[adapter].weight
            result = self.base_layer(x)  # a new contiguous tensor that no backward saves
            xa = nn.functional.linear(x, lora_a)  # (..., r): the only tensor the adapter adds
            result.view(-1, result.shape[-1]).addmm_(xa.view(-1, xa.shape[-1]), lora_b.t(),
                                                     alpha=self.scaling[adapter])
            return result

        fast = type(f"InPlace{peft_linear.__name__}", (peft_linear,), {
            "forward": forward, "__module__": __name__,
            "__doc__": "PEFT's LoRA linear whose forward adds the adapter's product into the base output in place."})
        _FAST_CLASSES[peft_linear] = fast
    return _FAST_CLASSES[peft_linear]


def _single_plain_adapter(layer: nn.Module, x: torch.Tensor, args: tuple, kwargs: dict) -> str | None:
    """The one active vanilla adapter of `layer` when the in-place path applies to this call, else None."""
    if args or kwargs or layer.disable_adapters or layer.merged:
        return None
    active = [name for name in layer.active_adapters if name in layer.lora_A]
    if len(active) != 1:
        return None
    name = active[0]
    if name in getattr(layer, "lora_variant", {}) or not isinstance(layer.lora_dropout[name], nn.Identity):
        return None
    dtype = layer.lora_A[name].weight.dtype
    if x.dtype != dtype or getattr(layer.base_layer, "weight", None) is None or layer.base_layer.weight.dtype != dtype:
        return None
    return name


def in_place_lora_linears(model: nn.Module) -> int:
    """Give every PEFT LoRA `Linear` of `model` the in-place forward; returns how many were changed."""
    from peft.tuners.lora import layer as lora_layer

    changed = 0
    for module in model.modules():
        if type(module) is lora_layer.Linear:
            module.__class__ = fast_linear_class(lora_layer.Linear)
            changed += 1
    return changed


def add_lora(model: nn.Module, rank: int, alpha: float, target_modules: str | Iterable[str] = "all-linear") -> nn.Module:
    """`model` wrapped by PEFT with LoRA adapters (`models.apply_lora`), each wrapped linear with the
    in-place forward. Call before FSDP2 sharding, as the actor does."""
    model = apply_lora(model, rank, alpha, target_modules)
    in_place_lora_linears(model)
    return model
