"""Fewer kernels per decoder layer: the model options `use_liger` and `use_torch_compile`, applied the same way
to the actor, the reference and the critic (`apply_kernel_options`, called by the worker before sharding).

Eager Hugging Face layers launch ~130 small kernels per layer and micro-batch (RMSNorm's fp32 round trip,
rotary's cat/neg/mul/add, SiLU x mul): at a few thousand tokens per micro-batch the host cannot issue them
as fast as the GPU runs them. Two ways to fuse them:

- `use_liger`: Liger-Kernel's Triton RMSNorm and SwiGLU patched into the model instance (the optional
  extra `pip install -e '.[liger]'`; CUDA only). Its loss kernels stay off: hflow computes log-probs and
  entropy itself. Liger also rebinds names in the model family's `modeling_*` module (the RMSNorm and MLP
  classes, the rotary function), which would reach every model of that family built or run later in the
  process: the plain-loop arms of bench/actor_speed.py ran Liger's kernels after a Liger arm (H100, run of
  2026-11-27), and a critic, reward model or teacher with use_liger=false would too. So those names are put
  back after patching, and rotary stays eager (it is a module-level function: it cannot be patched per
  instance). Not with `use_torch_compile` (preflight): TorchDynamo cannot trace Liger's Triton autograd
  functions (torch 2.11, H100), and compiling fuses the same kernels.
- `use_torch_compile`: `torch.compile` of each decoder layer with dynamic shapes, so packed micro-batches of
  any length reuse one compiled graph. The attention call stays eager (a graph break around it): the packed
  attention loops over Python sequence bounds, which would make every new number of sequences a recompile;
  the kernels around it (norms, rotary, MLP) are what compiling fuses. Works on CPU too (inductor's C++
  backend; its first compile takes minutes on a small CPU).

Call before `apply_fsdp2` (FSDP2 then wraps the compiled layers, as torchtitan does).
"""

from __future__ import annotations

import contextlib
import logging
import sys

import torch
from torch import nn

from hflow.utils.errors import ConfigError

logger = logging.getLogger(__name__)

from hflow.workers.config import LIGER_PACKAGE


def apply_kernel_options(model: nn.Module, use_liger: bool = False, use_torch_compile: bool = False,
                         compile_backend: str = "inductor") -> nn.Module:
    """Patch `model` in place with the chosen options (before sharding) and return it."""
    if use_liger:
        _apply_liger(model)
    if use_torch_compile:
        compile_decoder_layers(model, backend=compile_backend)
    return model


def _apply_liger(model: nn.Module) -> None:
    try:
        import liger_kernel.transformers as liger
    except ImportError as err:
        raise ConfigError(f"use_liger=true but {LIGER_PACKAGE} cannot be imported ({err}); "
                          "pip install -e '.[liger]' or set use_liger=false") from None
    apply = getattr(liger, "apply_liger_kernel_to_instance", None) or getattr(
        liger, "_apply_liger_kernel_to_instance")
    with module_names_restored(model):
        # The backbone's kernels only: the LM head and the losses are hflow's (log-probs, entropy, values).
        apply(model=model, rope=False, rms_norm=True, swiglu=True, cross_entropy=False,
              fused_linear_cross_entropy=False)
    logger.info("use_liger: Liger RMSNorm and SwiGLU kernels patched into %s", type(model).__name__)


@contextlib.contextmanager
def module_names_restored(model: nn.Module):
    """Put back every name that the body rebinds in the modules defining `model`'s classes (a patcher's
    module-level changes), so only the instance keeps what was patched into it."""
    modules = {sys.modules[cls.__module__] for cls in type(model).__mro__
               if cls.__module__ in sys.modules and cls.__module__.startswith("transformers.models.")}
    for sub in model.modules():
        name = type(sub).__module__
        if name in sys.modules and name.startswith("transformers.models."):
            modules.add(sys.modules[name])
    saved = {module: dict(vars(module)) for module in modules}
    try:
        yield
    finally:
        for module, names in saved.items():
            namespace = vars(module)
            for key in [k for k in namespace if k not in names]:
                del namespace[key]
            for key, value in names.items():
                if namespace.get(key) is not value:
                    setattr(module, key, value)


def compile_decoder_layers(model: nn.Module, backend: str = "inductor") -> int:
    """`torch.compile(dynamic=True)` each decoder layer in place (`nn.Module.compile`); returns how many."""
    from hflow.utils import packing  # the packed attention, which stays eager
    from hflow.workers.fsdp.sharding import decoder_layers

    if torch._dynamo.config.disable:
        logger.warning("use_torch_compile: TorchDynamo is disabled in this process (TORCHDYNAMO_DISABLE): the "
                       "layers run eagerly")
    packing.exclude_attention_from_compile()
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(backend=backend, dynamic=True)
    logger.info("use_torch_compile: %d decoder layers of %s compiled (%s, dynamic shapes)", len(layers),
                type(model).__name__, backend)
    return len(layers)
