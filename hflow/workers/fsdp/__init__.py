"""The FSDP2 training engine of the workers: building, sharding, moving and saving the models they own.

`from hflow.workers.fsdp import apply_fsdp2, load_causal_lm, ...`: the package re-exports the engine's
functions from the modules that hold them (workers call them through the package, so a test patches a
worker's call here, and a call inside the engine on the module that holds the function):

* ``models``: dtypes, the device mesh, the attention kernel, loading causal LMs, critics and reward
  models, rank 0's weights to every rank (`weights_from_rank0`), LoRA wrapping, gradient checkpointing;
* ``sharding``: FSDP2 (`apply_fsdp2`), inference-only passes, gradient clipping and the optimizer step,
  offloading between phases;
* ``params``: weights under their Hugging Face names, one full tensor at a time (`iter_full_params`), gathered
  by ``gather``: a bucket of shards per collective, in the receiver's dtype (`GatherStats` counts them);
* ``optim``: AdamW and the learning-rate schedule;
* ``passes``: the weights a pass computes with, cast (one rank) or gathered (FSDP2) once per pass
  (`update_pass`, `compute_weights`).

Beside them, imported by module: ``checkpoint`` (sharded checkpoints and the Hugging Face export),
``ema`` (an EMA of the sharded weights), ``snapshot`` (the health watch's host copy of a model's state),
``lora`` (the actor's LoRA adapters with an in-place forward).
"""

from hflow.workers.fsdp.models import (
    VALUE_HEAD_INITS,
    apply_lora,
    build_device_mesh,
    default_attn_implementation,
    enable_gradient_checkpointing,
    is_sequence_classifier,
    load_causal_lm,
    load_frozen_causal_lm,
    load_reward_model,
    load_value_model,
    register_vision_value_model,
    rank0_broadcast_device,
    shards_on_host,
    to_torch_dtype,
    weights_from_rank0,
)
from hflow.workers.fsdp.sharding import (
    GATHER_ONCE_MAX_FRACTION,
    apply_fsdp2,
    clip_grad_norm_and_step,
    fsdp_needed,
    default_mixed_precision,
    fsdp_clip_grad_norm,
    gather_once_fits,
    load_fsdp_model_to_device,
    load_optimizer,
    no_grad_pass,
    nothing_for_fsdp_to_do,
    offload_fsdp_model_to_cpu,
    offload_optimizer,
    reshard_fsdp_model,
    resolve_gather_once,
)
from hflow.workers.fsdp.passes import (
    UPDATE_GATHER_MAX_FRACTION,
    compute_weights,
    update_gather_fits,
    update_pass,
)
from hflow.workers.fsdp.gather import GatherStats
from hflow.workers.fsdp.params import (
    clean_param_name,
    full_param_shapes,
    is_lora_model,
    iter_full_params,
    local_tensor,
    lora_factors_of,
    named_weights,
)
from hflow.workers.fsdp.optim import (
    build_lr_scheduler,
    build_optimizer,
)

__all__ = [
    "GATHER_ONCE_MAX_FRACTION",
    "UPDATE_GATHER_MAX_FRACTION",
    "VALUE_HEAD_INITS",
    "apply_fsdp2",
    "apply_lora",
    "build_device_mesh",
    "build_lr_scheduler",
    "build_optimizer",
    "clean_param_name",
    "clip_grad_norm_and_step",
    "GatherStats",
    "compute_weights",
    "default_attn_implementation",
    "default_mixed_precision",
    "enable_gradient_checkpointing",
    "fsdp_clip_grad_norm",
    "fsdp_needed",
    "full_param_shapes",
    "gather_once_fits",
    "is_lora_model",
    "is_sequence_classifier",
    "iter_full_params",
    "load_causal_lm",
    "load_frozen_causal_lm",
    "load_fsdp_model_to_device",
    "load_optimizer",
    "load_reward_model",
    "load_value_model",
    "register_vision_value_model",
    "local_tensor",
    "lora_factors_of",
    "named_weights",
    "no_grad_pass",
    "nothing_for_fsdp_to_do",
    "offload_fsdp_model_to_cpu",
    "offload_optimizer",
    "rank0_broadcast_device",
    "reshard_fsdp_model",
    "resolve_gather_once",
    "shards_on_host",
    "to_torch_dtype",
    "update_gather_fits",
    "update_pass",
    "weights_from_rank0",
]
