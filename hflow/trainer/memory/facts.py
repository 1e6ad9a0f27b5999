"""What the memory plan (`memory_plan.py`) reads before it adds anything up: each role's dtypes and
gathering, the model's size and shape from its config.json (built on the meta device), the device's
memory, and the passes traced under torch's `FSDPMemTracker` (`memory_trace.py`), cached in this process
and on disk (`$HFLOW_CACHE/memory_plan`) by everything they depend on."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from hflow.utils.errors import ConfigError

GIB = 2**30
_CACHE_VERSION = "1"
# `hflow.workers.fsdp.GATHER_ONCE_MAX_FRACTION` (that package imports transformers)
GATHER_ONCE_MAX_FRACTION = 0.25
# `hflow.workers.fsdp.UPDATE_GATHER_MAX_FRACTION`
UPDATE_GATHER_MAX_FRACTION = 0.25
_TRACES: dict[str, dict[str, int]] = {}  # this process's traces, by key


# ------------------------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Role:
    """One FSDP model of the run: what it stores per rank and how it computes."""

    kind: str  # causal | value
    model_dtype: str
    param_dtype: str | None
    reduce_dtype: str | None
    gradient_checkpointing: bool
    gather_once: bool
    reshard_after_forward: bool
    params_offloaded: bool  # between its phases, on the host
    optimizer_offloaded: bool
    packed: bool
    lora: tuple | None = None
    gather_once_update: bool = False  # an update keeps every unit gathered (`gather_once_per_update`)


def dtype_bytes(name: str) -> int:
    import torch

    return getattr(torch, name).itemsize


def mixed_dtypes(fsdp_config: DictConfig, target: str) -> tuple[str | None, str | None]:
    """(param_dtype, reduce_dtype) of `fsdp_config.mixed_precision` on the target (`_mixed_precision_policy`)."""
    setting = OmegaConf.select(fsdp_config, "mixed_precision")
    if setting is None:
        return ("bfloat16", "float32") if target == "cuda" else (None, None)
    setting = OmegaConf.to_container(setting) if isinstance(setting, DictConfig) else dict(setting)
    return setting.get("param_dtype"), setting.get("reduce_dtype")


def model_config_text(model_cfg: DictConfig) -> str:
    """config.json of the model folder with the run's `override_config`, as sorted JSON."""
    path = Path(str(model_cfg.path)).expanduser() / "config.json"
    try:
        raw = json.loads(path.read_text())
    except OSError as err:
        raise ConfigError(f"the memory plan reads the model's config.json ({err.strerror}: {path}); set the model's "
                          "path key (e.g. actor_rollout_ref.model.path, critic.model.path) to a Hugging Face model "
                          "folder") from None
    if "model_type" not in raw:
        raise ConfigError(f"{path} names no model_type: the memory plan cannot build the model from it")
    overrides = OmegaConf.to_container(model_cfg.override_config) if model_cfg.get("override_config") else {}
    raw.update(overrides or {})
    for key in ("transformers_version", "_name_or_path", "architectures", "auto_map", "torch_dtype", "dtype"):
        raw.pop(key, None)
    return json.dumps(raw, sort_keys=True)


def model_numel(model_config: str, kind: str = "causal") -> tuple[int, int, dict[str, int]]:
    """(parameters, largest parameter's elements, model shape facts) of the model built on the meta device."""

    def compute() -> dict[str, int]:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, \
            AutoModelForTokenClassification

        config = AutoConfig.for_model(**json.loads(model_config))
        if kind == "value":
            config.num_labels = 1
        # a vision-language policy counts its vision tower too (its image-text class, as the workers load it)
        policy = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
        auto = AutoModelForTokenClassification if kind == "value" else policy
        with torch.device("meta"):
            model = auto.from_config(config)
        sizes = {name: p.numel() for name, p in model.named_parameters()}
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = int(text.num_attention_heads)
        return {"numel": sum(sizes.values()), "largest": max(sizes.values()), "layers": int(text.num_hidden_layers),
                "kv_heads": int(getattr(text, "num_key_value_heads", None) or heads),
                "head_dim": int(getattr(text, "head_dim", None) or text.hidden_size // heads)}

    facts = cached(f"numel:{kind}:{model_config}", compute)
    return facts["numel"], facts["largest"], facts


def gather_once(setting, numel: int, param_bytes: int, target: str, device_bytes: float) -> bool:
    """`gather_once_per_pass`; null as `fsdp.gather_once_fits` decides it (repeated here: importing
    hflow.workers.fsdp imports transformers; a test checks they agree)."""
    if setting is not None:
        return bool(setting)
    return target != "cuda" or numel * param_bytes <= GATHER_ONCE_MAX_FRACTION * device_bytes


def gather_once_update(setting, numel: int, param_bytes: int, grad_bytes: int, target: str,
                       device_bytes: float) -> bool:
    """`gather_once_per_update`; null as `fsdp.update_gather_fits` decides it (repeated here, as above)."""
    if setting is not None:
        return bool(setting)
    return target != "cuda" or numel * (param_bytes + grad_bytes) <= UPDATE_GATHER_MAX_FRACTION * device_bytes


def default_device_bytes(config: DictConfig, target: str) -> float:
    """`trainer.device_memory_gb` (GiB), else this machine's device: the GPU's memory, or on CPU the host's
    memory divided by the worker processes of the node."""
    if config.trainer.device_memory_gb is not None:
        return float(config.trainer.device_memory_gb) * GIB
    if target == "cuda":
        import torch

        if torch.cuda.is_available():
            return float(torch.cuda.get_device_properties(0).total_memory)
        raise ConfigError("the memory plan for a GPU needs its memory: set trainer.device_memory_gb "
                          "(or --device-memory-gb) on a machine without one")
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host / max(1, int(config.trainer.n_gpus_per_node))


# ------------------------------------------------------------------------------------------- tracing


def cached(key_text: str, compute) -> dict:
    """`compute()` (a JSON-able dict), cached in this process and on disk under a key made of `key_text`, the
    tracing code (`hflow/trainer/memory/trace.py`) and the torch/transformers versions. A hit imports neither
    torch's tracer nor transformers."""
    from importlib.metadata import version

    source = (Path(__file__).with_name("trace.py")).read_bytes()
    key = hashlib.sha256("\n".join([_CACHE_VERSION, key_text, version("torch"), version("transformers"),
                                    hashlib.sha256(source).hexdigest()]).encode()).hexdigest()[:32]
    if key in _TRACES:
        return _TRACES[key]
    from hflow.utils.cache import default_cache_root

    path = default_cache_root() / "memory_plan" / f"{key}.json"
    try:
        _TRACES[key] = json.loads(path.read_text())
        return _TRACES[key]
    except (OSError, ValueError):
        pass
    result = compute()
    _TRACES[key] = result
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(result))
        tmp.replace(path)
    except OSError:
        pass
    return result


def trace(spec) -> dict[str, int]:
    """`memory_trace.trace_fake(spec)`, cached (`cached`)."""

    def compute() -> dict[str, int]:
        from hflow.trainer.memory.trace import trace_fake

        return trace_fake(spec)

    return cached(spec.key(), compute)


def traced_components(peak: dict[str, int], role: str) -> dict[str, float]:
    from hflow.trainer.memory.trace import CATEGORIES

    out: dict[str, float] = {}
    for category, value in peak.items():
        if category == "Total":
            continue
        label = f"{role} {CATEGORIES.get(category, category)}"
        out[label] = out.get(label, 0) + value
    return out
