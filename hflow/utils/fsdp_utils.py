"""Building, sharding and moving the models that the training workers own (FSDP2; on one rank, where
FSDP2 would have nothing to do, the plain module: see `apply_fsdp2`).

A worker builds its model in four steps, the same on an 8-GPU node and on a CPU machine:

    mesh  = build_device_mesh(world_size)
    model = load_causal_lm(path, dtype=torch.float32, rank0_only=True)  # or load_value_model(...)
    with weights_from_rank0(model):                            # only rank 0 read the weights
        enable_gradient_checkpointing(model)                   # optional, before sharding
        apply_fsdp2(model, mesh)                               # each decoder layer, then the root
    optimizer = build_optimizer(model.parameters(), optim_cfg)

Everything that depends on the hardware (mesh device, default mixed precision, attention kernel,
whether host offloading means anything) is asked of `hflow.utils.device`; nothing here inspects the
hardware itself.
"""

from __future__ import annotations

import importlib.util
import logging
import math
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    GenerationConfig,
    PretrainedConfig,
)

from hflow.utils import device
from hflow.utils.packing import SDPA_VARLEN  # importing it registers the attention with transformers
from hflow.utils.torch_functional import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

__all__ = [
    "apply_fsdp2",
    "no_grad_pass",
    "apply_lora",
    "build_device_mesh",
    "build_lr_scheduler",
    "build_optimizer",
    "clean_param_name",
    "clip_grad_norm_and_step",
    "default_attn_implementation",
    "default_mixed_precision",
    "enable_gradient_checkpointing",
    "fsdp_clip_grad_norm",
    "gather_once_fits",
    "is_lora_model",
    "is_sequence_classifier",
    "iter_full_params",
    "load_causal_lm",
    "load_fsdp_model_to_device",
    "load_optimizer",
    "load_reward_model",
    "load_value_model",
    "offload_fsdp_model_to_cpu",
    "offload_optimizer",
    "rank0_broadcast_device",
    "reshard_fsdp_model",
    "shards_on_host",
    "to_torch_dtype",
    "weights_from_rank0",
]

logger = logging.getLogger(__name__)

# Name segments that wrappers (FSDP1, torch activation checkpointing, torch.compile) insert into
# parameter names; Hugging Face checkpoints and vLLM know the names without them.
_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
# PEFT's: the wrapped model sits under `base_model.model.`, a LoRA linear's own weight under `.base_layer`.
_PEFT_PREFIX = "base_model.model."
_PEFT_BASE_LAYER = ".base_layer."

# Seed of the value head's initialisation (see `load_value_model`).
_VALUE_HEAD_SEED = 0
VALUE_HEAD_INITS = ("zero", "normal")

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def to_torch_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """`torch.bfloat16` from "bf16" / "bfloat16" / torch.bfloat16 (config values are strings);
    None (a `model_dtype: null` in the config) is fp32."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(_DTYPES)}") from None


# --------------------------------------------------------------------------------------------------
# Mesh and models
# --------------------------------------------------------------------------------------------------


def build_device_mesh(world_size: int) -> DeviceMesh:
    """1-D data-parallel mesh `("fsdp",)` over all ranks, on this process's device type.

    torch.distributed must already be initialised with `device.dist_backend()`.
    """
    return init_device_mesh(device.device_name(), (world_size,), mesh_dim_names=("fsdp",))


_ATTN_CHOICES_LOGGED: set[str] = set()  # default_attn_implementation logs each distinct reason once


def default_attn_implementation(cuda: bool | None = None) -> str:
    """flash_attention_2 on a CUDA device where flash-attn really works with the installed torch, else
    PyTorch SDPA (`packing.SDPA_VARLEN`: transformers' SDPA, which also attends per sequence on packed
    inputs), with one log line saying why. `cuda=None` asks the device helper (tests pass it).

    "Really works" means: the `flash-attn` distribution is installed at a version transformers
    accepts (>= 2.3.3), its compiled extension (`flash_attn_2_cuda`) imports -- a build for another
    torch fails here with an undefined symbol -- and one tiny causal attention call runs on this
    process's device (a build without kernels for this GPU fails here). Merely finding the package,
    as before, let a mismatched build crash model loading instead of falling back.
    """
    if cuda is None:
        cuda = device.is_cuda()
    reason = None
    if not cuda:
        reason = "no CUDA device (flash-attn is CUDA-only)"
    elif importlib.util.find_spec("flash_attn") is None:
        reason = "flash-attn is not installed (optional: pip install --no-build-isolation -e '.[flash-attn]')"
    else:
        from importlib import metadata

        from packaging.version import InvalidVersion, Version

        try:
            version = metadata.version("flash-attn")
            if Version(version) < Version("2.3.3"):
                reason = f"flash-attn {version} is older than 2.3.3, the oldest that transformers accepts"
        except (metadata.PackageNotFoundError, InvalidVersion) as exc:
            reason = f"the flash_attn module has no usable flash-attn distribution metadata ({exc!r})"
        if reason is None:
            try:
                importlib.import_module("flash_attn_2_cuda")  # the compiled part: fails on a torch ABI mismatch
                from flash_attn import flash_attn_func

                q = torch.randn(1, 8, 2, 64, device=device.get_device(), dtype=torch.bfloat16)
                out = flash_attn_func(q, q, q, causal=True)
                if tuple(out.shape) != tuple(q.shape) or not bool(torch.isfinite(out).all()):
                    raise RuntimeError(f"a test call returned {tuple(out.shape)} / non-finite values")
            except Exception as exc:  # ImportError, OSError, RuntimeError (no kernel image), ...
                message = str(exc).splitlines()[0][:300] if str(exc) else ""
                reason = (f"flash-attn is installed but does not work with torch {torch.__version__} on this device "
                          f"({type(exc).__name__}: {message}); rebuild it against this torch")
    if reason is None:
        choice, reason = "flash_attention_2", "flash-attn imports and runs on this device"
    else:
        choice = SDPA_VARLEN  # PyTorch SDPA, per sequence on packed (remove-padding) inputs
    line = f"attention implementation: {choice} ({reason})"
    if line not in _ATTN_CHOICES_LOGGED:
        _ATTN_CHOICES_LOGGED.add(line)
        # a warning when flash-attn is installed (the user wants it) but cannot be used
        installed = cuda and importlib.util.find_spec("flash_attn") is not None
        logger.log(logging.WARNING if installed and choice != "flash_attention_2" else logging.INFO, line)
    return choice


def _load_config(
    path: str, override_config: Mapping[str, Any] | None, trust_remote_code: bool, **fixed: Any
) -> PretrainedConfig:
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    _apply_overrides(config, dict(override_config or {}))
    _apply_overrides(config, fixed)
    return config


def _apply_overrides(config: PretrainedConfig, overrides: Mapping[str, Any]) -> None:
    """Set `overrides` on `config`, recursing into nested sub-configs (e.g. `text_config`)."""
    for key, value in overrides.items():
        current = getattr(config, key, None)
        if isinstance(value, Mapping) and isinstance(current, PretrainedConfig):
            _apply_overrides(current, value)
        else:
            setattr(config, key, value)


def _on_this_rank(
    auto_class: type,
    path: str,
    config: PretrainedConfig,
    dtype: str | torch.dtype | None,
    attn_implementation: str | None,
    trust_remote_code: bool,
    rank0_only: bool,
    loading_info: dict | None = None,
) -> nn.Module:
    """`auto_class.from_pretrained(path)`; with `rank0_only`, on ranks other than 0 the same model
    built from `config` on the meta device instead: no weights read and no memory taken, as
    `weights_from_rank0` then gives these ranks their shards of rank 0's weights. `loading_info`, where
    the weights are read, receives from_pretrained's (missing_keys, unexpected_keys, ...)."""
    kwargs: dict[str, Any] = dict(
        dtype=to_torch_dtype(dtype),
        attn_implementation=attn_implementation or default_attn_implementation(),
        trust_remote_code=trust_remote_code,
    )
    if not rank0_only or not dist.is_initialized() or dist.get_rank() == 0:
        if loading_info is None:
            return auto_class.from_pretrained(path, config=config, **kwargs)
        model, info = auto_class.from_pretrained(path, config=config, output_loading_info=True, **kwargs)
        loading_info.update(info)
        return model
    with torch.device("meta"):
        model = auto_class.from_config(config, **kwargs)
    # what from_pretrained does besides reading the weights
    model.eval()
    if model.can_generate():
        try:
            model.generation_config = GenerationConfig.from_pretrained(path)
        except OSError:  # no generation_config.json: keep the one derived from the model config
            pass
    return model


def load_causal_lm(
    path: str,
    dtype: str | torch.dtype | None = None,
    override_config: Mapping[str, Any] | None = None,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    rank0_only: bool = False,
) -> nn.Module:
    """A Hugging Face causal LM from a local folder, on the host, in `dtype` (None: fp32).

    fp32 is the right dtype for a trained actor (the optimizer keeps fp32 master weights; FSDP mixed
    precision computes in bf16); a frozen reference can load in bf16. `attn_implementation=None`
    picks `default_attn_implementation()`. `rank0_only=True`: only rank 0 reads the weights, the
    other ranks get an empty (meta-device) model to shard inside `weights_from_rank0`.
    """
    config = _load_config(path, override_config, trust_remote_code)
    return _on_this_rank(
        AutoModelForCausalLM, path, config, dtype, attn_implementation, trust_remote_code, rank0_only
    )


def load_value_model(
    path: str,
    dtype: str | torch.dtype | None = None,
    override_config: Mapping[str, Any] | None = None,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    rank0_only: bool = False,
    value_head_init: str = "zero",
) -> nn.Module:
    """The critic: a backbone with a linear value head per token.

    This is `AutoModelForTokenClassification` with one label. From a causal-LM folder the backbone
    weights (`model.*`) are the policy's, the LM head is dropped and `score` (hidden -> 1) is new,
    initialised by `value_head_init`: "zero" (the default; lm-human-preferences and DeepSpeed-Chat:
    every first value is 0, and the backbone's features are not disturbed by a random head's
    gradients) or "normal" (HF's normal(0, initializer_range) from a fixed seed). Either way every
    run, and every rank, starts from the same critic.

    From a reward model's folder (a `*ForSequenceClassification` with one label, as DeepSpeed-Chat and
    lm-human-preferences start their critics) the backbone and the reward head's `score` weights are
    both loaded, as the value head: the first values are the reward model's per-token scores, and
    `value_head_init` is not used. A bias the reward model lacks is 0.

    The HF class (rather than a hand-written wrapper) keeps `_no_split_modules`, gradient checkpointing
    and `save_pretrained` working, so a critic checkpoint is an ordinary HF folder. Output: `.logits` of
    shape (batch, seq, 1) = V of the state after reading token t. Dropout on the head is switched off
    (HF defaults it to 0.1 when the config names none): it would make the values of the update differ
    from those of `compute_values`. `rank0_only` as in `load_causal_lm` (the other ranks then receive
    rank 0's head).
    """
    if value_head_init not in VALUE_HEAD_INITS:
        raise ValueError(f"value_head_init={value_head_init!r} is not one of {list(VALUE_HEAD_INITS)}")
    config = _load_config(path, override_config, trust_remote_code)
    from_reward_model = is_sequence_classifier(config)
    if from_reward_model and config.num_labels != 1:
        raise ValueError(f"{path} is a sequence classifier with num_labels={config.num_labels}; a critic can start "
                         "from a reward model with one label only")
    _apply_overrides(config, {"num_labels": 1, "classifier_dropout": 0.0})
    loading_info: dict = {}
    model = _on_this_rank(AutoModelForTokenClassification, path, config, dtype, attn_implementation,
                          trust_remote_code, rank0_only, loading_info=loading_info)
    head: nn.Linear = model.score
    if head.weight.is_meta:  # built empty on a rank other than 0
        return model
    missing = set(loading_info.get("missing_keys", ()))
    with torch.no_grad():
        if from_reward_model:
            if "score.weight" in missing:
                raise ValueError(f"{path} is a sequence classifier but has no `score.weight`; its head cannot be "
                                 "loaded as the value head")
            if head.bias is not None and "score.bias" in missing:
                head.bias.zero_()
            return model
        if value_head_init == "zero":
            head.weight.zero_()
        else:
            generator = torch.Generator().manual_seed(_VALUE_HEAD_SEED)
            std = float(getattr(model.config, "initializer_range", 0.02))
            head.weight.copy_(torch.randn(head.weight.shape, generator=generator) * std)
        if head.bias is not None:
            head.bias.zero_()
    return model


def is_sequence_classifier(config: PretrainedConfig | Mapping[str, Any]) -> bool:
    """Whether a model folder's config (object or config.json dict) names a `*ForSequenceClassification`
    architecture: a reward model."""
    architectures = config.get("architectures") if isinstance(config, Mapping) else config.architectures
    return any(str(name).endswith("ForSequenceClassification") for name in architectures or ())


def load_reward_model(
    path: str,
    dtype: str | torch.dtype | None = None,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    rank0_only: bool = False,
) -> nn.Module:
    """A sequence-classification reward model (one score per position, `num_labels=1`) from a
    local folder, in `dtype`; `rank0_only` as in `load_causal_lm`."""
    config = _load_config(path, None, trust_remote_code, num_labels=1)
    return _on_this_rank(
        AutoModelForSequenceClassification, path, config, dtype, attn_implementation, trust_remote_code, rank0_only
    )


def shards_on_host(cpu_offload: bool) -> bool:
    """Whether `fsdp_config.offload_policy` keeps this process's shards in host memory: FSDP2's
    `CPUOffloadPolicy`, on a GPU only (on CPU the shards are in host memory anyway)."""
    return bool(cpu_offload) and device.is_cuda()


def rank0_broadcast_device(cpu_offload: bool) -> torch.device:
    """The device on which every rank holds its shards and buffers while `weights_from_rank0` sends rank 0's
    weights: host memory when the shards live there (`shards_on_host`; the broadcasts then go over gloo, the
    host half of `device.dist_backend()`), else this process's device (NCCL on GPUs). It depends on nothing
    that differs between ranks, so every rank sends or receives each tensor on the same kind of device."""
    return torch.device("cpu") if shards_on_host(cpu_offload) else device.get_device()


def _move_buffers(model: nn.Module, target: torch.device) -> None:
    """Every buffer of `model` to `target`, as `model.to` moves them (parameters stay where they are); a
    buffer that several modules share stays shared."""
    moved: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device != target:
                if id(buffer) not in moved:
                    moved[id(buffer)] = buffer.to(target)
                module._buffers[name] = moved[id(buffer)]


@contextmanager
def weights_from_rank0(model: nn.Module, cpu_offload: bool = False) -> Iterator[None]:
    """Shard `model` in place inside this block (`apply_fsdp2`); on leaving it, every rank holds its
    shards of rank 0's weights and rank 0's buffers.

        model = load_causal_lm(path, rank0_only=True)   # rank 0 reads, the others are empty
        with weights_from_rank0(model):
            apply_fsdp2(model, mesh)

    Only rank 0 ever holds the whole model; it sends it one tensor at a time, and every other rank
    keeps its slice of each, so a rank other than 0 needs its shards plus one full tensor, not the
    whole model (a 7B model in fp32 on an 8-GPU node: ~30 GB of host memory on rank 0 instead of
    ~30 GB on each of the 8 ranks). Models loaded on every rank work too (they are overwritten with
    rank 0's weights). With one rank there is nothing to do. `cpu_offload`: the block shards with
    `apply_fsdp2(..., cpu_offload=...)` set the same way.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        yield
        return
    is_rank0 = dist.get_rank() == 0
    # References, not copies: sharding replaces the module's parameters, these keep the full tensors.
    full_state = model.state_dict() if is_rank0 else {}
    yield
    # `fully_shard` moved rank 0's buffers to the compute device whatever the offload policy (it offloads
    # the shards only), and the other ranks' model is still empty: every rank's shards and buffers go to
    # the one device of the broadcasts, or rank 0 would send over NCCL while the others wait on gloo.
    source = rank0_broadcast_device(cpu_offload)
    if not is_rank0:
        # meta shards -> uninitialised shards (FSDP2 re-registers them, pinned when offloaded)
        model.to_empty(device=source)
    _move_buffers(model, source)
    set_model_state_dict(
        model, full_state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    del full_state
    # Buffers are not sharded, and the non-persistent ones (rotary `inv_freq`) are not in a state dict.
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)
    _move_buffers(model, device.get_device())  # where the forward reads them, as FSDP2 placed rank 0's


def apply_lora(model: nn.Module, rank: int, alpha: float, target_modules: str | Iterable[str] = "all-linear") -> nn.Module:
    """`model` wrapped by PEFT with a LoRA adapter of `rank` on `target_modules` ("all-linear": every linear
    layer but the output head); call before `apply_fsdp2`. Only the adapter's `lora_A` / `lora_B` require
    gradients, so an optimizer built from the trainable parameters holds nothing else. The base model stays
    reachable unchanged: `with model.disable_adapter():` computes the initial policy (the reference)."""
    from peft import LoraConfig, get_peft_model

    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    return get_peft_model(model, LoraConfig(r=int(rank), lora_alpha=alpha, target_modules=targets, bias="none"))


def is_lora_model(model: nn.Module) -> bool:
    """Whether `model` carries LoRA adapters (`apply_lora`)."""
    return any(_lora_factors_of(module) is not None for module in model.modules())


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer's activations in backward; call before `apply_fsdp2`.

    Non-reentrant checkpointing is the variant that composes with FSDP2's hooks.
    """
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


# --------------------------------------------------------------------------------------------------
# FSDP2
# --------------------------------------------------------------------------------------------------


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


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
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


def _resolve_gather_once(model: nn.Module, setting: bool | None, mp_policy: MixedPrecisionPolicy) -> bool:
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
) -> nn.Module:
    """Shard `model` in place with FSDP2: each decoder layer is its own all-gather unit, then the root
    takes what is left (embeddings, final norm, LM / value head). Returns the same object.

    On a mesh of one rank FSDP2 has nothing to shard: it would only copy each unit's weights into a
    gathered buffer before its forward and back after, through DTensor's dispatch. Unless it has something else
    to do there -- cast the weights (mixed precision, an fp32 head), keep them on the host (`cpu_offload`)
    -- the model is left a plain module on the device (`fsdp_on_one_rank=True` wraps it anyway). Every
    helper here takes either.

    Each of `fp32_modules` (a critic's value head) becomes a unit of its own that computes in fp32
    whatever the mixed precision: its bf16 input is cast up and its output is not rounded to bf16,
    which would leave a value about 3 significant digits. Its output, when a view (a Linear with a bias
    on a 3-D input returns one), is copied to a tensor of its own first (`_output_not_a_view`).

    The root keeps its parameters gathered between forward and backward (FSDP2's default for a root:
    backward needs them first); run inference-only passes inside `no_grad_pass`, which frees them after.
    `gather_once_per_pass` lets such a pass gather each layer once for all its micro-batches; None decides
    by the model's size and the device's memory (`gather_once_fits`).
    `cpu_offload` keeps the shards, gradients and optimizer step on the host for good (FSDP2's
    `CPUOffloadPolicy`; meaningless, and skipped, on CPU); do not combine it with the per-phase
    `offload_*` / `load_*` helpers below, which would move that state back to the device.
    """
    kwargs: dict[str, Any] = {"mesh": mesh, "mp_policy": _mixed_precision_policy(mixed_precision)}
    fp32_modules = list(fp32_modules)
    if not fsdp_on_one_rank and nothing_for_fsdp_to_do(model, mesh, kwargs["mp_policy"], fp32_modules, cpu_offload):
        # Where FSDP2 would have put it (a fake-tensor trace's mesh is on the host whatever the machine); moved
        # only when elsewhere, as `.to` cannot swap a fake tensor's storage.
        target = device.get_device() if mesh.device_type == device.get_device().type else torch.device(mesh.device_type)
        if any(t.device != target for t in (*model.parameters(), *model.buffers())):
            model.to(target)
        return model
    gather_once_per_pass = _resolve_gather_once(model, gather_once_per_pass, kwargs["mp_policy"])
    kwargs["offload_policy"] = CPUOffloadPolicy() if shards_on_host(cpu_offload) else OffloadPolicy()
    units: list[tuple[nn.Module, bool]] = []
    for layer in _decoder_layers(model):
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
    return model


@contextmanager
def no_grad_pass(model: nn.Module) -> Iterator[None]:
    """An inference-only pass over several micro-batches (log-probs, values, scores), without gradients.

    When `model` was sharded with `gather_once_per_pass` (by default on CPU, and on a GPU when the model
    fits; see `apply_fsdp2`), each unit's parameters are all-gathered by the first micro-batch and kept
    until the pass ends, instead of being gathered again for every micro-batch: one all-gather per layer
    per pass, at the cost of a full copy of the weights (in the compute dtype) on the device while the
    pass runs. Either way, everything is resharded on
    leaving, as no backward follows to do it. A plain `torch.no_grad()` for a model not sharded here.
    """
    units = getattr(model, "_hflow_reshard_after_forward", [])
    keep_gathered = bool(units) and getattr(model, "_hflow_gather_once_per_pass", False)
    if keep_gathered:
        for unit, _ in units:
            unit.set_reshard_after_forward(False, recurse=False)
    try:
        with torch.no_grad():
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


def clean_param_name(name: str) -> str:
    """The Hugging Face checkpoint name of a (possibly wrapped, possibly PEFT) module's parameter or buffer."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name.removeprefix(_PEFT_PREFIX).replace(_PEFT_BASE_LAYER, ".")


def _lora_factors_of(module: nn.Module) -> tuple[nn.Parameter, nn.Parameter, float, bool] | None:
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
        found = _lora_factors_of(module)
        if found is not None:
            factors[clean_param_name(f"{module_name}.base_layer.weight")] = found
    return factors


def _is_lora_param(name: str) -> bool:
    return ".lora_" in name


@torch.no_grad()
def iter_full_params(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for every parameter and persistent buffer, one at a time.

    The names are those of the unwrapped model's `state_dict()`, except that a tied parameter is
    yielded once, under its first name (e.g. `model.embed_tokens.weight`, not also `lm_head.weight`):
    HF and vLLM loaders re-tie it. Each sharded parameter is all-gathered when the consumer asks for it,
    so at most one full tensor exists beside the shards; every rank must consume the generator in the
    same order (each gather is a collective).

    A LoRA model (`apply_lora`) yields the base model's names and shapes with the adapters merged in:
    W + scaling * B @ A for each wrapped linear, and no `lora_*` tensor -- what vLLM, the weight stream
    and a Hugging Face export need, since none of them knows the adapters.
    """
    reshard_fsdp_model(model)  # after a forward without backward, some parameters are still gathered
    compute_device = device.get_device()

    def gather(tensor: torch.Tensor) -> torch.Tensor:
        # Shards kept on the host (CPUOffloadPolicy) are gathered on the device, not by a host collective.
        return tensor.to(compute_device).full_tensor() if isinstance(tensor, DTensor) else tensor

    lora = _lora_weights(model)
    for name, tensor in _named_weights(model):
        full = gather(tensor)
        if name in lora:
            lora_a, lora_b, scaling, fan_in_fan_out = lora[name]
            delta = gather(lora_b).to(full.dtype) @ gather(lora_a).to(full.dtype)
            full = full + scaling * (delta.T if fan_in_fan_out else delta)
        yield name, full.detach()


def full_param_shapes(model: nn.Module) -> list[tuple[str, torch.Size, torch.dtype]]:
    """(HF name, full shape, dtype) of what `iter_full_params` yields, in its order, without gathering."""
    return [(name, tensor.shape, tensor.dtype) for name, tensor in _named_weights(model)]


def _named_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
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


# --------------------------------------------------------------------------------------------------
# Optimizer and learning-rate schedule
# --------------------------------------------------------------------------------------------------


def build_optimizer(params: Iterable[nn.Parameter], optim_cfg: Any) -> Optimizer:
    """AdamW from the `optim` section (`lr`, `betas`, `weight_decay`; every key present: build one by hand
    from `hflow.trainer.config.default_config().actor_rollout_ref.actor.optim`)."""
    betas = optim_cfg.betas
    return torch.optim.AdamW(
        params,
        lr=float(optim_cfg.lr),
        betas=(float(betas[0]), float(betas[1])),
        weight_decay=float(optim_cfg.weight_decay),
    )


def build_lr_scheduler(optimizer: Optimizer, optim_cfg: Any, total_steps: int) -> LambdaLR:
    """LR schedule of `optim.warmup_style` (`constant` or `cosine`) over `total_steps` optimizer-schedule
    steps. Warmup lasts `optim.lr_warmup_steps`, or when that is negative
    `int(optim.lr_warmup_steps_ratio * total_steps)`."""
    warmup = int(optim_cfg.lr_warmup_steps)
    if warmup < 0:
        warmup = int(float(optim_cfg.lr_warmup_steps_ratio) * total_steps)
    style = optim_cfg.warmup_style
    if style == "constant":
        return get_constant_schedule_with_warmup(optimizer, num_warmup_steps=warmup)
    if style == "cosine":
        return get_cosine_schedule_with_warmup(
            optimizer,
            num_warmup_steps=warmup,
            num_training_steps=total_steps,
            min_lr_ratio=float(optim_cfg.min_lr_ratio),
            num_cycles=float(optim_cfg.num_cycles),
        )
    raise ValueError(f"optim.warmup_style={style!r} is not supported; use 'constant' or 'cosine'")
