"""The weights a pass computes with: cast or gathered once per pass, not once per micro-batch.

Two cases, one interface (`update_pass` around an optimizer step's backwards, `compute_weights` inside
`no_grad_pass`):

* **One rank, mixed precision** (`apply_fsdp2` left the model plain and recorded its compute dtype with
  `set_compute_dtype`). The model's parameters stay the fp32 master weights: checkpoints, the Hugging Face
  export, EMA, the health snapshot and the weight stream read them as before, and the optimizer steps them.
  For a pass, each is cast once to the compute dtype and the copy takes its place in the module; after the
  pass the masters are put back. In an update, each copy's gradient is added in fp32 to its master's `.grad`
  as soon as autograd has it (`register_post_accumulate_grad_hook`), which frees the bf16 gradient: the same
  arithmetic as FSDP2's mixed precision on one rank (bf16 gradients, fp32 reduction and accumulation),
  without its per-micro-batch cast, copy-in/copy-out and `chunk_cat` of every parameter.
* **FSDP2 on several ranks, `gather_once_per_update`.** Every unit is gathered by the first micro-batch and
  kept gathered through the forwards and backwards of the optimizer step; gradients accumulate unsharded (in
  the reduce dtype) and are reduce-scattered once, by the last backward. Costs a full copy of the weights (the
  compute dtype) and of the gradients (the reduce dtype) on each rank while the update runs
  (`update_gather_fits` decides by default).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from hflow.utils import device

logger = logging.getLogger(__name__)

# The most of a GPU's memory that a model's gathered weights (compute dtype) and unsharded gradients (reduce
# dtype) may take together to be kept for a whole update when `gather_once_per_update` is null: on 80 GB,
# models to ~3B (6 bytes a parameter: 18 GB) keep them; 7B (42 GB) gathers per micro-batch as before.
UPDATE_GATHER_MAX_FRACTION = 0.25


def update_gather_fits(numel: int, param_bytes: int, grad_bytes: int, device_bytes: int | None, cuda: bool) -> bool:
    """What `gather_once_per_update: null` means: on a GPU, whether the full weights and gradients fit in
    `UPDATE_GATHER_MAX_FRACTION` of it; on CPU always (host memory)."""
    if not cuda:
        return True
    if not device_bytes:
        return False
    return numel * (param_bytes + grad_bytes) <= UPDATE_GATHER_MAX_FRACTION * device_bytes


def resolve_gather_once_per_update(model: nn.Module, setting: bool | None, param_dtype: torch.dtype | None,
                                   reduce_dtype: torch.dtype | None) -> bool:
    """`fsdp_config.gather_once_per_update`: true/false as given; null by `update_gather_fits`."""
    if setting is not None:
        return bool(setting)
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    param_bytes = max(((param_dtype or p.dtype).itemsize for p in params), default=4)
    grad_bytes = max(((reduce_dtype or p.dtype).itemsize for p in params), default=4)
    fits = update_gather_fits(numel, param_bytes, grad_bytes, device.total_memory_bytes(), device.is_cuda())
    if device.is_cuda():
        logger.info("gather_once_per_update=null -> %s for %s", fits, type(model).__name__)
    return fits


# ---------------------------------------------------------------------------------------------------------
# One rank: compute copies of fp32 master weights
# ---------------------------------------------------------------------------------------------------------


def set_compute_dtype(model: nn.Module, dtype: torch.dtype, fp32_modules: Iterable[nn.Module] = ()) -> None:
    """Record that the plain `model` computes in `dtype`, except `fp32_modules` (a critic's value head), whose
    weights stay fp32 and whose inputs are cast up to fp32: what FSDP2's mixed precision would have done."""
    model._hflow_compute_dtype = dtype
    model._hflow_fp32_modules = list(fp32_modules)


def compute_dtype_of(model: nn.Module) -> torch.dtype | None:
    """The compute dtype `set_compute_dtype` recorded; None for a model computing in its weights' dtype."""
    return getattr(model, "_hflow_compute_dtype", None)


def _accumulate_into(master: nn.Parameter, copy: torch.Tensor) -> None:
    # fp32 accumulation across micro-batches; the compute-dtype gradient is freed at once
    grad, copy.grad = copy.grad, None
    if master.grad is None:
        master.grad = grad.to(master.dtype)
    else:
        master.grad.add_(grad)


def _inputs_to_fp32(module: nn.Module, args: tuple) -> tuple:
    return tuple(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


@contextmanager
def compute_weights(model: nn.Module, accumulate_grads: bool) -> Iterator[None]:
    """Within: `model` computes with copies of its weights in its compute dtype, cast once here (no-op for a
    model without one). `accumulate_grads`: each trainable copy's gradient is added to its master's `.grad`
    in the master's dtype. Tied weights share one copy."""
    dtype = compute_dtype_of(model)
    if dtype is None:
        yield
        return
    fp32_modules = getattr(model, "_hflow_fp32_modules", [])
    keep = {id(p) for module in fp32_modules for p in module.parameters()}
    copies: dict[int, nn.Parameter] = {}
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    hooks = []
    with torch.no_grad():
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is None or not param.is_floating_point() or param.dtype == dtype or id(param) in keep:
                    continue
                copy = copies.get(id(param))
                if copy is None:
                    copy = nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad)
                    if accumulate_grads and param.requires_grad:
                        hooks.append(copy.register_post_accumulate_grad_hook(partial(_accumulate_into, param)))
                    copies[id(param)] = copy
                module._parameters[name] = copy
                swapped.append((module, name, param))
    hooks += [module.register_forward_pre_hook(_inputs_to_fp32) for module in fp32_modules]
    try:
        yield
    finally:
        for module, name, param in swapped:
            module._parameters[name] = param
        for hook in hooks:
            hook.remove()


# ---------------------------------------------------------------------------------------------------------
# The update: either case
# ---------------------------------------------------------------------------------------------------------


class UpdatePass:
    """One optimizer step's forwards and backwards over `model`; call `before_backward(last)` before each
    backward, `last=True` before the step's final one."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.gather_once = isinstance(model, FSDPModule) and getattr(model, "_hflow_gather_once_per_update", False)

    def before_backward(self, last: bool) -> None:
        if self.gather_once:
            # the last backward reduce-scatters the accumulated gradients and frees the gathered weights
            self.model.set_requires_gradient_sync(last)
            self.model.set_reshard_after_backward(last)

    def __enter__(self) -> UpdatePass:
        if self.gather_once:
            for unit, _ in self.model._hflow_reshard_after_forward:
                unit.set_reshard_after_forward(False, recurse=False)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.gather_once:
            for unit, reshard in self.model._hflow_reshard_after_forward:
                unit.set_reshard_after_forward(reshard, recurse=False)
            self.model.set_requires_gradient_sync(True)
            self.model.set_reshard_after_backward(True)
            for module in self.model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()


@contextmanager
def update_pass(model: nn.Module) -> Iterator[UpdatePass]:
    """Around one optimizer step's micro-batches (forwards and backwards; not the step): the compute copies of
    a one-rank mixed-precision model, or an FSDP2 model's gathering once per update (see the module)."""
    with compute_weights(model, accumulate_grads=True), UpdatePass(model) as step:
        yield step
