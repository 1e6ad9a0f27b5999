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
  backend; its first compile takes minutes on a small CPU). What a loop compiles is bounded: one graph per
  code region (a layer's forward and the pieces between its graph breaks) for each role (actor, ref, critic:
  their weights differ in `requires_grad`, which Dynamo guards) and mode (with or without gradients), and
  generation never runs the compiled layers (`eager_generation`: an HF rollout's KV cache and one-token
  steps would each compile graphs of their own, and reached Dynamo's recompile limit of 8 in a GRPO run on an
  H100, bench/results/gpu_h100_logs/grpo_use_torch_compile.log). `compile_metrics` counts both per process.

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
                         compile_backend: str = "inductor", role: str = "model") -> nn.Module:
    """Patch `model` in place with the chosen options (before sharding) and return it; `role` names its
    compiled graphs in `compile_metrics`."""
    if use_liger:
        _apply_liger(model)
    if use_torch_compile:
        compile_decoder_layers(model, backend=compile_backend, role=role)
    return model


# What this process compiled: per (role, mode), the graphs and each Dynamo frame's compiles (a recompile is a
# frame compiled again); and how often Dynamo gave up on a frame at its recompile limit (it then runs that code
# eagerly for the rest of the run).
_graphs: dict[tuple[str, str], int] = {}
_compiles: dict[tuple[str, str], dict[int, set[int]]] = {}
_limit_hits = [0]


class _RecompileLimitCounter(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if "recompile_limit" in record.getMessage():
            _limit_hits[0] += 1


def _counting(backend: str, role: str):
    """`backend`, counting each graph it is given under `role`, the grad mode and its Dynamo frame."""
    from torch._dynamo import lookup_backend
    from torch._guards import CompileContext

    compile_graph = lookup_backend(backend)

    def compile_counted(graph_module, example_inputs):
        key = (role, "train" if torch.is_grad_enabled() else "no_grad")
        _graphs[key] = _graphs.get(key, 0) + 1
        compile_id = CompileContext.current_compile_id()
        if compile_id is not None:
            _compiles.setdefault(key, {}).setdefault(compile_id.frame_id, set()).add(compile_id.frame_compile_id)
        return compile_graph(graph_module, example_inputs)

    return compile_counted


def compile_metrics() -> dict[str, float]:
    """`compile/graphs/<role>/<mode>`: graphs compiled in this process for that role and mode;
    `compile/max_compiles_per_region/<role>/<mode>`: the most compiles of one code region (Dynamo frame) for it
    (1: never recompiled); `compile/recompile_limit_hits`: regions Dynamo stopped compiling. Empty without
    compiling."""
    if not _graphs:
        return {}
    metrics: dict[str, float] = {"compile/recompile_limit_hits": float(_limit_hits[0])}
    for (role, mode), count in _graphs.items():
        metrics[f"compile/graphs/{role}/{mode}"] = float(count)
        frames = _compiles.get((role, mode), {})
        metrics[f"compile/max_compiles_per_region/{role}/{mode}"] = float(max(map(len, frames.values()), default=0))
    return metrics


@contextlib.contextmanager
def eager_generation():
    """Run compiled layers eagerly inside (HF generation: see the module docstring)."""
    with torch.compiler.set_stance("force_eager"):
        yield


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


def compile_decoder_layers(model: nn.Module, backend: str = "inductor", role: str = "model") -> int:
    """`torch.compile(dynamic=True)` each decoder layer in place (`nn.Module.compile`), its graphs counted
    under `role` (`compile_metrics`); returns how many layers."""
    from hflow.utils import packing  # the packed attention, which stays eager
    from hflow.workers.fsdp.sharding import decoder_layers

    if torch._dynamo.config.disable:
        logger.warning("use_torch_compile: TorchDynamo is disabled in this process (TORCHDYNAMO_DISABLE): the "
                       "layers run eagerly")
    packing.exclude_attention_from_compile()
    dynamo_log = logging.getLogger("torch._dynamo")
    if not any(isinstance(h, _RecompileLimitCounter) for h in dynamo_log.handlers):
        dynamo_log.addHandler(_RecompileLimitCounter())
    layers = decoder_layers(model)
    counted = _counting(backend, role)
    for layer in layers:
        layer.compile(backend=counted, dynamic=True)
    logger.info("use_torch_compile: %d decoder layers of %s compiled (%s, dynamic shapes)", len(layers),
                type(model).__name__, backend)
    return len(layers)
