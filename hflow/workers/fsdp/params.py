"""A model's weights under their Hugging Face names: the names without wrapper and PEFT segments, the LoRA
adapters merged into their base weights, and one full tensor at a time out of the FSDP2 shards
(`iter_full_params`, behind the vLLM sync, the split placement's weight stream and the Hugging Face export),
in the checkpoint's layout (`checkpoint_layout`)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hflow.utils import device
from hflow.workers.fsdp.gather import GatherStats, gather_full
from hflow.workers.fsdp.sharding import reshard_fsdp_model

# Name segments that wrappers (FSDP1, torch activation checkpointing, torch.compile) insert into
# parameter names; Hugging Face checkpoints and vLLM know the names without them.
_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
# PEFT's: the wrapped model sits under `base_model.model.`, a LoRA linear's own weight under `.base_layer`.
_PEFT_PREFIX = "base_model.model."
_PEFT_BASE_LAYER = ".base_layer."


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a plain tensor as it is)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def is_lora_model(model: nn.Module) -> bool:
    """Whether `model` carries LoRA adapters (`apply_lora`)."""
    return any(lora_factors_of(module) is not None for module in model.modules())


def clean_param_name(name: str) -> str:
    """The Hugging Face checkpoint name of a (possibly wrapped, possibly PEFT) module's parameter or buffer."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name.removeprefix(_PEFT_PREFIX).replace(_PEFT_BASE_LAYER, ".")


def lora_factors_of(module: nn.Module) -> tuple[nn.Parameter, nn.Parameter, float, bool] | None:
    """(A, B, scaling, fan_in_fan_out) of a PEFT LoRA linear's active adapter, else None (duck-typed, so
    models without adapters never import peft)."""
    lora_a = getattr(module, "lora_A", None)
    if getattr(module, "base_layer", None) is None or not isinstance(lora_a, nn.ModuleDict):
        return None
    if getattr(module, "lora_embedding_A", None):
        raise NotImplementedError("LoRA on embeddings is not supported; leave them out of target_modules")
    active = [name for name in module.active_adapters if name in lora_a]
    if len(active) != 1:
        raise NotImplementedError(f"one active LoRA adapter per layer is supported, found {active}")
    name = active[0]
    return lora_a[name].weight, module.lora_B[name].weight, float(module.scaling[name]), bool(module.fan_in_fan_out)


def _lora_weights(model: nn.Module) -> dict[str, tuple[nn.Parameter, nn.Parameter, float, bool]]:
    """HF name of each LoRA-wrapped linear's base weight -> its adapter's factors."""
    factors = {}
    for module_name, module in model.named_modules():
        found = lora_factors_of(module)
        if found is not None:
            factors[clean_param_name(f"{module_name}.base_layer.weight")] = found
    return factors


def _is_lora_param(name: str) -> bool:
    return ".lora_" in name


@torch.no_grad()
def iter_full_params(model: nn.Module, dtype: torch.dtype | None = None, bucket_bytes: int | None = None,
                     stats: GatherStats | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for every parameter and persistent buffer, one at a time.

    The names are those of the unwrapped model's `state_dict()`, except that a tied parameter is
    yielded once, under its first name (e.g. `model.embed_tokens.weight`, not also `lm_head.weight`):
    HF and vLLM loaders re-tie it. Each sharded parameter is all-gathered when the consumer asks for it
    (`gather_full`: with `bucket_bytes`, a bucket of shards per collective, so at most one bucket of full
    tensors exists beside the shards); every rank must consume the generator in the same order (each gather
    is a collective). `dtype`: floating-point tensors arrive in it, cast on each rank before the gather (the
    bytes a bf16 engine needs, not the fp32 master's); `stats` counts the bytes and collectives.

    A LoRA model (`apply_lora`) yields the base model's names and shapes with the adapters merged in:
    W + scaling * B @ A for each wrapped linear, and no `lora_*` tensor -- what vLLM, the weight stream
    and a Hugging Face export need, since none of them knows the adapters. (Its weights are gathered in
    their own dtype and cast after the merge, which is then as exact as without `dtype`.)
    """
    reshard_fsdp_model(model)  # after a forward without backward, some parameters are still gathered
    lora = _lora_weights(model)
    for name, full in gather_full(named_weights(model), None if lora else dtype, bucket_bytes, stats):
        if name in lora:
            lora_a, lora_b, scaling, fan_in_fan_out = lora[name]
            delta = _full(lora_b).to(full.dtype) @ _full(lora_a).to(full.dtype)
            full = full + scaling * (delta.T if fan_in_fan_out else delta)
        if dtype is not None and full.is_floating_point():
            full = full.to(dtype)
        yield from checkpoint_layout(model, name, full.detach())


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A LoRA factor whole (shards kept on the host, CPUOffloadPolicy, are gathered on the device)."""
    return tensor.to(device.get_device()).full_tensor() if isinstance(tensor, DTensor) else tensor


def full_param_shapes(model: nn.Module) -> list[tuple[str, torch.Size, torch.dtype]]:
    """(HF name, full shape, dtype) of what `iter_full_params` yields, in its order, without gathering."""
    shapes = []
    for name, tensor in named_weights(model):
        meta = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
        shapes.extend((part, piece.shape, piece.dtype) for part, piece in checkpoint_layout(model, name, meta))
    return shapes


def checkpoint_layout(model: nn.Module, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One full weight of `model` as the model's checkpoint stores it: usually itself. transformers >= 5 loads
    some checkpoints into other layouts -- an MoE layer's experts fused into one 3-D tensor per projection
    (`mlp.experts.gate_up_proj`, (E, 2I, H)), where the checkpoint, vLLM's loaders and every other tool have
    `mlp.experts.{e}.gate_proj.weight` ... per expert -- so weights leaving the trainer are put back with
    transformers' own reverse mapping (views of `tensor`, no copy)."""
    from transformers import PreTrainedModel
    from transformers.core_model_loading import revert_weight_conversion

    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT: the wrapped model
    if not isinstance(base, PreTrainedModel):
        return [(name, tensor)]
    return list(revert_weight_conversion(base, {name: tensor}).items())


def named_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters (sharded or not; tied ones once; no LoRA factors) and persistent buffers under their HF names."""
    for name, param in model.named_parameters():
        if not _is_lora_param(name):
            yield clean_param_name(name), param
    for module_name, module in model.named_modules():
        for buffer_name, buffer in module.named_buffers(recurse=False):
            if buffer_name in module._non_persistent_buffers_set:
                continue
            name = f"{module_name}.{buffer_name}" if module_name else buffer_name
            yield clean_param_name(name), buffer
