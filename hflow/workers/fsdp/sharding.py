"""FSDP2: sharding a loaded model (`apply_fsdp2`), inference-only passes over it, gradient clipping and the
optimizer step, and moving shards and optimizer state between the device and the host between phases."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from hflow.utils import device
from hflow.workers.fsdp.models import shards_on_host, to_torch_dtype
from hflow.workers.fsdp.passes import compute_weights, resolve_gather_once_per_update, set_compute_dtype

logger = logging.getLogger(__name__)



def default_mixed_precision() -> MixedPrecisionPolicy:
    """Compute in `device.compute_dtype()` with fp32 gradient reduction: bf16 on GPUs that have it; plain
    fp32 on older GPUs and on CPU, where hflow runs tests and small examples that compare log-probabilities
    to 1e-5."""
    dtype = device.compute_dtype()
    if dtype == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def _mixed_precision_policy(mixed_precision: MixedPrecisionPolicy | Mapping[str, Any] | None) -> MixedPrecisionPolicy:
    """The policy from `fsdp_config.mixed_precision`: null, or `{param_dtype, reduce_dtype,
    output_dtype}` as dtype names (missing ones keep the parameter dtype)."""
    if mixed_precision is None:
        return default_mixed_precision()
    if isinstance(mixed_precision, MixedPrecisionPolicy):
        return mixed_precision
    known = {"param_dtype", "reduce_dtype", "output_dtype"}
    unknown = set(mixed_precision) - known
    if unknown:
        raise ValueError(f"fsdp_config.mixed_precision: unknown keys {sorted(unknown)}; known: {sorted(known)}")
    return MixedPrecisionPolicy(
        **{key: to_torch_dtype(value) for key, value in mixed_precision.items() if value is not None}
    )


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks: modules whose class is in `_no_split_modules` (HF's list of
    blocks that must stay whole), else the entries of `model.model.layers`."""
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in block_names]
    if not layers:
        backbone = getattr(model, "model", None)
        layers = list(getattr(backbone, "layers", []) or [])
    if not layers:
        raise ValueError(
            f"cannot find the decoder layers of {type(model).__name__}: it names no `_no_split_modules` "
            "and has no `model.layers`; FSDP2 needs them to shard layer by layer"
        )
    return layers


# The most of a GPU's memory that one model's full weights, in the compute dtype, may take to be kept
# gathered through a no-grad pass when `gather_once_per_pass` is null. The rest holds the pass's activations
# (one micro-batch's logits: 16 x 2k tokens x 152k vocabulary in fp32 is ~20 GB), the shards and optimizer
# state of the actor, reference and critic, and a sleeping vLLM's leftovers. The models' passes run one after
# another, so each model is judged alone: on 80 GB, 7B (15 GB in bf16) and below keep their weights
# gathered, 14B (30 GB) and above gather each layer per micro-batch.
GATHER_ONCE_MAX_FRACTION = 0.25


def gather_once_fits(numel: int, dtype_bytes: int, device_bytes: int | None, cuda: bool) -> bool:
    """What `gather_once_per_pass: null` means for a model of `numel` parameters computing in dtypes of
    `dtype_bytes` on a device of `device_bytes`: on a GPU, whether the full weights fit in
    `GATHER_ONCE_MAX_FRACTION` of it; on CPU always (host memory, and the pass's speed-up)."""
    if not cuda:
        return True
    if not device_bytes:
        return False
    return numel * dtype_bytes <= GATHER_ONCE_MAX_FRACTION * device_bytes


def resolve_gather_once(model: nn.Module, setting: bool | None, mp_policy: MixedPrecisionPolicy) -> bool:
    """`fsdp_config.gather_once_per_pass`: true/false as given; null by `gather_once_fits` for the unsharded
    `model` (its parameters counted in the dtype they are gathered in)."""
    if setting is not None:
        return bool(setting)
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    dtype_bytes = max(((mp_policy.param_dtype or p.dtype).itemsize for p in params), default=4)
    total = device.total_memory_bytes()
    fits = gather_once_fits(numel, dtype_bytes, total, device.is_cuda())
    if device.is_cuda():
        logger.info("gather_once_per_pass=null -> %s for %s: %.1f GB of weights gathered, device of %.1f GB",
                    fits, type(model).__name__, numel * dtype_bytes / 1e9, (total or 0) / 1e9)
    return fits


def nothing_for_fsdp_to_do(model: nn.Module, mesh: DeviceMesh, policy: MixedPrecisionPolicy,
                           fp32_modules: Iterable[nn.Module] = (), cpu_offload: bool = False) -> bool:
    """Whether FSDP2 would neither shard (a mesh of one rank), nor keep the weights on the host
    (`shards_on_host`), nor cast them: every weight computed in the dtype it is stored in (the
    `fp32_modules` in fp32) and the outputs returned as computed. `apply_fsdp2` then leaves `model` plain."""
    if mesh.size() != 1 or shards_on_host(cpu_offload):
        return False
    in_fp32 = {id(p) for module in fp32_modules for p in module.parameters()}
    for param in model.parameters():
        wanted = torch.float32 if id(param) in in_fp32 else (policy.param_dtype or param.dtype)
        if param.is_floating_point() and wanted != param.dtype:
            return False
    return policy.output_dtype is None or all(p.dtype == policy.output_dtype for p in model.parameters())


def fsdp_needed(model: nn.Module, mesh: DeviceMesh, policy: MixedPrecisionPolicy,
                fp32_modules: Iterable[nn.Module] = (), cpu_offload: bool = False) -> bool:
    """Whether `apply_fsdp2` wraps `model` in FSDP2: to shard it (several ranks), to keep its shards on the
    host, to cast its outputs, or to compute a head stored in another dtype in fp32. A one-rank model that
    only computes in a lower precision than it stores is left plain: `passes.compute_weights` casts it once
    per pass instead of FSDP2 once per micro-batch (and again for backward)."""
    if nothing_for_fsdp_to_do(model, mesh, policy, fp32_modules, cpu_offload):
        return False
    if mesh.size() != 1 or shards_on_host(cpu_offload) or policy.output_dtype is not None:
        return True
    return any(p.dtype != torch.float32 for module in fp32_modules for p in module.parameters())


def _output_not_a_view(module: nn.Module, inputs: Any, output: Any) -> Any:
    """A module's tensor output that is a view (of the (B x T, labels) result of a biased Linear's addmm)
    -> a copy of its own; anything else unchanged.

    FSDP2 hooks a unit's outputs to gather its weights again before their backward. An in-place op on a
    view output (`values += x`, `values.mul_(s)`) rebases the view on its base and drops that hook: the
    weights stay freed and backward fails or computes wrong gradients (torch warns "FSDP2-wrapped module
    ... returned a view tensor"). Used for the heads of `apply_fsdp2(fp32_modules=...)`, whose outputs
    (B, T, labels) are small, so the copy is too; the root then returns no view either.
    """
    if isinstance(output, torch.Tensor) and output._base is not None:
        return output.clone()
    return None


def apply_fsdp2(
    model: nn.Module,
    mesh: DeviceMesh,
    mixed_precision: MixedPrecisionPolicy | Mapping[str, Any] | None = None,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    fp32_modules: Iterable[nn.Module] = (),
    gather_once_per_pass: bool | None = None,
    fsdp_on_one_rank: bool = False,
    gather_once_per_update: bool | None = None,
) -> nn.Module:
    """Shard `model` in place with FSDP2: each decoder layer is its own all-gather unit, then the root
    takes what is left (embeddings, final norm, LM / value head). Returns the same object.

    On a mesh of one rank FSDP2 has nothing to shard: it would only copy each unit's weights into a
    gathered buffer before its forward and back after, through DTensor's dispatch, casting them on the way
    every micro-batch. Unless it has something else to do there (`fsdp_needed`: keep them on the host, cast
    the outputs), the model is left a plain module on the device (`fsdp_on_one_rank=True` wraps it anyway);
    with mixed precision it records its compute dtype, and `update_pass` / `no_grad_pass` cast its fp32
    weights once per pass (`hflow.workers.fsdp.passes`). Every helper here takes either.

    Each of `fp32_modules` (a critic's value head) becomes a unit of its own that computes in fp32
    whatever the mixed precision: its bf16 input is cast up and its output is not rounded to bf16,
    which would leave a value about 3 significant digits. Its output, when a view (a Linear with a bias
    on a 3-D input returns one), is copied to a tensor of its own first (`_output_not_a_view`).

    The root keeps its parameters gathered between forward and backward (FSDP2's default for a root:
    backward needs them first); run inference-only passes inside `no_grad_pass`, which frees them after.
    `gather_once_per_pass` lets such a pass gather each layer once for all its micro-batches; None decides
    by the model's size and the device's memory (`gather_once_fits`). `gather_once_per_update` does the same
    for an optimizer step's forwards and backwards (`passes.update_pass`; None: `update_gather_fits`).
    `cpu_offload` keeps the shards, gradients and optimizer step on the host for good (FSDP2's
    `CPUOffloadPolicy`; meaningless, and skipped, on CPU); do not combine it with the per-phase
    `offload_*` / `load_*` helpers below, which would move that state back to the device.
    """
    kwargs: dict[str, Any] = {"mesh": mesh, "mp_policy": _mixed_precision_policy(mixed_precision)}
    fp32_modules = list(fp32_modules)
    policy = kwargs["mp_policy"]
    if not fsdp_on_one_rank and not fsdp_needed(model, mesh, policy, fp32_modules, cpu_offload):
        # Where FSDP2 would have put it (a fake-tensor trace's mesh is on the host whatever the machine); moved
        # only when elsewhere, as `.to` cannot swap a fake tensor's storage.
        target = device.get_device() if mesh.device_type == device.get_device().type else torch.device(mesh.device_type)
        if any(t.device != target for t in (*model.parameters(), *model.buffers())):
            model.to(target)
        if not nothing_for_fsdp_to_do(model, mesh, policy, fp32_modules, cpu_offload):
            set_compute_dtype(model, policy.param_dtype, fp32_modules)
        return model
    gather_once_per_pass = resolve_gather_once(model, gather_once_per_pass, policy)
    kwargs["offload_policy"] = CPUOffloadPolicy() if shards_on_host(cpu_offload) else OffloadPolicy()
    units: list[tuple[nn.Module, bool]] = []
    for layer in decoder_layers(model):
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kwargs)
        units.append((layer, reshard_after_forward))
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for module in fp32_modules:
        # before FSDP's own post-forward hook, which hooks the output for backward
        module.register_forward_hook(_output_not_a_view, prepend=True)
        fully_shard(module, reshard_after_forward=reshard_after_forward, **{**kwargs, "mp_policy": fp32})
        units.append((module, reshard_after_forward))
    fully_shard(model, reshard_after_forward=False, **kwargs)
    units.append((model, False))
    # what `no_grad_pass` restores after keeping every unit gathered
    model._hflow_reshard_after_forward = units
    model._hflow_gather_once_per_pass = gather_once_per_pass
    model._hflow_gather_once_per_update = resolve_gather_once_per_update(
        model, gather_once_per_update, policy.param_dtype, policy.reduce_dtype)
    return model


@contextmanager
def no_grad_pass(model: nn.Module) -> Iterator[None]:
    """An inference-only pass over several micro-batches (log-probs, values, scores), without gradients.

    When `model` was sharded with `gather_once_per_pass` (by default on CPU, and on a GPU when the model
    fits; see `apply_fsdp2`), each unit's parameters are all-gathered by the first micro-batch and kept
    until the pass ends, instead of being gathered again for every micro-batch: one all-gather per layer
    per pass, at the cost of a full copy of the weights (in the compute dtype) on the device while the
    pass runs. Either way, everything is resharded on
    leaving, as no backward follows to do it. For a plain one-rank model with a compute dtype, its weights
    are cast once for the pass (`passes.compute_weights`); otherwise a plain `torch.no_grad()`.
    """
    units = getattr(model, "_hflow_reshard_after_forward", [])
    keep_gathered = bool(units) and getattr(model, "_hflow_gather_once_per_pass", False)
    if keep_gathered:
        for unit, _ in units:
            unit.set_reshard_after_forward(False, recurse=False)
    try:
        with torch.no_grad(), compute_weights(model, accumulate_grads=False):
            yield
    finally:
        if keep_gathered:
            for unit, reshard in units:
                unit.set_reshard_after_forward(reshard, recurse=False)
        reshard_fsdp_model(model)


def reshard_fsdp_model(model: nn.Module) -> None:
    """Free every gathered parameter of `model` after a forward that has no backward (log-probs, values).

    Without a backward, nothing reshards the root (see `apply_fsdp2`), nor the layers when
    `reshard_after_forward` is off: a full copy of them, in the compute dtype, would stay on the
    device and be what `named_parameters()` returns. A no-op for modules that are not FSDP-sharded.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def fsdp_clip_grad_norm(model: nn.Module, max_norm: float | None) -> float:
    """Clip the global gradient norm (over all ranks' shards) to `max_norm` and return it before
    clipping; `max_norm=None` only measures. May be inf or nan: the caller decides to skip the step."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if isinstance(norm, DTensor):
        # FSDP2: each rank holds the norm of its shards; reduce them on the compute device, since
        # host-offloaded gradients give a host tensor that NCCL cannot reduce.
        norm = norm.to(device.get_device()).full_tensor()
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(params, float(max_norm), norm)
    return float(norm)


def clip_grad_norm_and_step(model: nn.Module, optimizer: Optimizer, max_norm: float | None) -> float:
    """One optimizer step after clipping the global gradient norm; the step is skipped when that norm
    is inf or nan (a step would poison the weights). Gradients are freed either way. Returns the norm."""
    grad_norm = fsdp_clip_grad_norm(model, max_norm)
    if math.isfinite(grad_norm):
        optimizer.step()
    else:
        logger.warning("gradient norm is %s: skipping this optimizer step", grad_norm)
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


# --------------------------------------------------------------------------------------------------
# Offloading between phases (no-ops when the device is the host)
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def offload_fsdp_model_to_cpu(model: nn.Module, empty_cache: bool = True) -> None:
    """Move the parameter shards (and buffers) to host memory to free the device for another phase.

    `nn.Module.to` is the FSDP2-aware way: FSDPModule reshards first and re-registers the moved shards.
    """
    model.to("cpu")
    if empty_cache:
        device.empty_cache()


@torch.no_grad()
def load_fsdp_model_to_device(model: nn.Module) -> None:
    """Bring the parameter shards back to this process's device."""
    model.to(device.get_device())


def _move_optimizer_state(optimizer: Optimizer, target: torch.device | str) -> None:
    # 0-dim entries (Adam's `step`) stay where the optimizer keeps them (on the host unless
    # capturable); moving them would only force a sync per step.
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                state[key] = value.to(target)


@torch.no_grad()
def offload_optimizer(optimizer: Optimizer, empty_cache: bool = True) -> None:
    """Move the optimizer state (Adam moments: twice the parameter shards) to host memory."""
    _move_optimizer_state(optimizer, "cpu")
    if empty_cache:
        device.empty_cache()


@torch.no_grad()
def load_optimizer(optimizer: Optimizer) -> None:
    """Bring the optimizer state back to this process's device before a step."""
    _move_optimizer_state(optimizer, device.get_device())
