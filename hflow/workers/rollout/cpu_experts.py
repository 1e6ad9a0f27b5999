"""Re-pack an MoE's experts after `reload_weights` on vLLM's CPU build (runs inside the engine).

vLLM 0.32's CPU MoE kernel (`cpu_fused_moe`) reads each fused-MoE layer's `w13_weight` / `w2_weight` in a
blocked layout: at load time `CPUUnquantizedExperts.process_weights_after_loading` re-packs them in place
of the checkpoint layout (same shape, other element order). `reload_weights` loads the new tensors into
fresh checkpoint-layout parameters and runs the layer's method post-processing, but
`UnquantizedFusedMoEMethod._setup_kernel` runs the experts' re-pack only on the first load (the
kernel then exists, so a reload is a "weight update" that skips it), and the reload then copies the
checkpoint-layout values into the packed parameters' storage. The kernel reads them as if packed: scrambled
experts, though every value arrived (a reload of a folder's own weights changes the engine's log-probs and
greedy responses; a fresh engine is exact). Dense layers are re-packed on every reload: only the experts
need this.

`repack_experts` runs the experts' own load-time step again on what the reload left, then puts the
result back into the parameters the kernel holds (same storage: nothing captured goes stale).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["repack_experts"]

_EXPERT_WEIGHTS = ("w13_weight", "w2_weight")


@torch.no_grad()
def repack_experts(worker: Any) -> int:
    """After a reload on one engine worker: re-pack every CPU fused-MoE layer's experts from the checkpoint
    layout the reload wrote into the kernel's layout, as the first load did. Returns the layers re-packed
    (0 on a dense model, or where the experts' kernel reads the checkpoint layout, e.g. on GPU)."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    repacked = 0
    for module in worker.model_runner.get_model().modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts):
            continue
        held = {name: getattr(module, name) for name in _EXPERT_WEIGHTS}
        experts.process_weights_after_loading(module)  # the load-time step: new, re-packed parameters
        for name, param in held.items():
            repacked_param = getattr(module, name)
            if repacked_param is not param:
                param.copy_(repacked_param)  # a shape change (padding the intermediate size) fails loudly here
                module.register_parameter(name, param)
        repacked += 1
    return repacked
