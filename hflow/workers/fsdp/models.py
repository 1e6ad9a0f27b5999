"""Loading the models that the training workers own, on every rank or on rank 0 only, and giving the other
ranks their shards of rank 0's weights (`weights_from_rank0`).

A worker builds its model in four steps, the same on an 8-GPU node and on a CPU machine (each step's
module in brackets):

    mesh  = build_device_mesh(world_size)                                         [models]
    model = load_causal_lm(path, dtype=torch.float32, rank0_only=True)            [models]  (or load_value_model)
    with weights_from_rank0(model):                # only rank 0 read the weights  [models]
        enable_gradient_checkpointing(model)       # optional, before sharding     [models]
        apply_fsdp2(model, mesh)                   # each decoder layer, then root [sharding]
    optimizer = build_optimizer(model.parameters(), optim_cfg)                    [optim]

Everything that depends on the hardware (mesh device, default mixed precision, attention kernel,
whether host offloading means anything) is asked of `hflow.utils.device`; nothing here inspects the
hardware itself.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    GenerationConfig,
    PretrainedConfig,
)

from hflow.utils import device
from hflow.utils.packing import SDPA_VARLEN  # importing it registers the attention with transformers

logger = logging.getLogger(__name__)

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
    # a vision-language model (Qwen2-VL's family: a `vision_config` beside the text model's) is its
    # image-text class, which reads `pixel_values` beside the ids; a text-only forward works unchanged
    auto_class = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    return _on_this_rank(auto_class, path, config, dtype, attn_implementation, trust_remote_code, rank0_only)


def load_frozen_causal_lm(model_cfg: Any) -> nn.Module:
    """A model section's causal LM (`path`, `override_config`, `trust_remote_code`, `attn_implementation`) to
    be frozen (a reference, a teacher): in the compute dtype, since no fp32 master weights are needed, read
    by rank 0 only."""
    return load_causal_lm(model_cfg.path, dtype=device.compute_dtype(), override_config=model_cfg.override_config,
                          trust_remote_code=model_cfg.trust_remote_code,
                          attn_implementation=model_cfg.attn_implementation, rank0_only=True)


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
    if hasattr(config, "vision_config"):  # a vision-language backbone: its token classifier (registered)
        register_vision_value_model(config)
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


def register_vision_value_model(config: PretrainedConfig) -> type:
    """`AutoModelForTokenClassification`'s class for a vision-language config (Qwen2-VL's family), which
    transformers does not ship: the family's base model (vision tower + language model, `model`, reading
    `pixel_values`, `image_grid_thw` and multimodal `position_ids` as the generation class does) under a
    linear head per token (`score`), with transformers' generic token-classification forward. The family's
    checkpoint key renames (older folders keep `visual.*` and `model.layers.*` at the top) are registered
    for it as for the generation class, so it loads a policy's folder, and saves and reloads as itself."""
    from transformers import PreTrainedModel
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
    from transformers.modeling_layers import GenericForTokenClassification
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING, MODEL_MAPPING

    key = type(config)
    if key in _VISION_VALUE_MODELS:
        return _VISION_VALUE_MODELS[key]
    base, generation = MODEL_MAPPING[key], MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[key]
    family = next(c for c in base.__mro__[1:] if issubclass(c, PreTrainedModel))  # e.g. Qwen2VLPreTrainedModel
    name = generation.__name__.replace("ForConditionalGeneration", "ForTokenClassification")
    cls = type(name, (GenericForTokenClassification, family), {"__module__": __name__})
    renames = get_checkpoint_conversion_mapping(generation.__name__)
    if renames is not None:
        register_checkpoint_conversion_mapping(name, renames, overwrite=True)
    AutoModelForTokenClassification.register(key, cls, exist_ok=True)
    _VISION_VALUE_MODELS[key] = cls
    return cls


_VISION_VALUE_MODELS: dict[type, type] = {}


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
    reachable unchanged: `with model.disable_adapter():` computes the initial policy (the reference). A
    vision-language model's vision tower (`model.visual`) gets no adapters: LoRA trains the language model."""
    from peft import LoraConfig, get_peft_model

    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    exclude = r".*\bvisual\..*" if hasattr(model.config, "vision_config") else None
    return get_peft_model(model, LoraConfig(r=int(rank), lora_alpha=alpha, target_modules=targets, bias="none",
                                            exclude_modules=exclude))


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer's activations in backward; call before `apply_fsdp2`.

    Non-reentrant checkpointing is the variant that composes with FSDP2's hooks.
    """
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
