"""Turn a sharded training checkpoint into a plain Hugging Face folder, offline, in one CPU process.

    python -m hflow.cli.convert_checkpoint CKPT_DIR OUT_DIR [--ema] [--dtype bfloat16] [--verify]

CKPT_DIR is one worker's checkpoint, `<trainer.default_local_dir>/global_step_N/actor` (a
`global_step_N` folder is accepted: its `actor/`, or an SFT run's `model/`, is used). The model's
entries of `model_optim/` (DCP shards written by any number of ranks) are read without a process group
and without the optimizer state; LoRA adapters are merged into their base weights
(W + scaling * B @ A, scaling = lora_alpha / r as PEFT computes it) under the base model's names;
`--ema` writes the EMA of the weights (`actor.ema.enable`) instead of the live ones. OUT_DIR gets
config, generation config, tokenizer and safetensors shards (`hflow.workers.fsdp.checkpoint.save_hf_model`'s
writer); a tied `lm_head` is left out, as Hugging Face loaders re-tie it. `--verify` then loads OUT_DIR
with `transformers` and compares its logits
with the checkpoint's own model (base weights plus unmerged adapters, as in training) built on CPU.

What the conversion reads beside the shards (every checkpoint holds it, see
`hflow.workers.fsdp.checkpoint.save_model_info`):

    huggingface/                   config, generation config, tokenizer (weights only with hf_model)
    lora/adapter_config.json       PEFT's adapter config of a LoRA actor (r, lora_alpha, target_modules)

OUT_DIR must be new or empty; `--overwrite` replaces a folder that hflow wrote (an earlier output of the
converter or a training run's Hugging Face export): every such folder lists its files in
`.hflow-output.json`, and a folder without that manifest, or holding anything it does not list (a user's
file), is refused, naming those files: nothing the converter did not write is ever deleted. OUT_DIR is also
refused, before anything is read, when it is, holds or lies inside the checkpoint (or `--model-path`), or
lies in or holds a training checkpoint folder (an experiment's folder with `global_step_*/` or
`latest_checkpointed_iteration.txt`), see `hflow.utils.safe_output`. The new folder is written beside
OUT_DIR and renamed into place when complete; an earlier one is removed only then.

Checkpoints written before those files existed convert with `--model-path` (the run's
`actor_rollout_ref.model.path`: config and tokenizer) and `--lora-alpha` (the run's `model.lora_alpha`).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from hflow.workers.fsdp.checkpoint import HF_DIR, LORA_DIR
from hflow.utils.errors import UserError
from hflow.utils.safe_output import MANIFEST, OutputError, check_output_folder

__all__ = ["CheckpointError", "convert_checkpoint", "main", "verify_conversion"]

_SHARDS = "model_optim"
_MODEL, _EMA = "model", "ema"
_ROLE_DIRS = ("actor", "model")  # a PPO step's actor; an SFT / reward-model step's only model
_BATCH_BYTES = 2**30  # tensors read from the shards per DCP call
_LORA_FACTOR = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])\.(?P<adapter>[^.]+)\.weight$")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# --verify: largest max |logit difference| accepted, by output dtype (16-bit: the weights' rounding)
_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 0.25, torch.float16: 0.05}
_PROMPTS = (
    "Question: what is 17 plus 25? Answer:",
    "The quick brown fox jumps over the lazy dog.",
    "You are a helpful assistant. Please answer the question.",
    "1 + 1 = 2. 2 + 3 = 5. 6 * 7 =",
    "Let's think step by step. First, add the numbers.",
    "Tom has 3 apples and buys 4 more. How many apples does he have?",
)


class CheckpointError(UserError, ValueError):
    """A folder that cannot be converted; the message names it and says what to pass instead."""


# ---- finding the checkpoint ------------------------------------------------------------------------------


def resolve_source(path: str | Path) -> Path:
    """The checkpoint folder to convert at `path`, or a CheckpointError saying what is wrong with it."""
    path = Path(path).expanduser()
    if path.name.endswith(".incomplete"):
        raise CheckpointError(
            f"{path} is a half-written checkpoint (a save that did not finish leaves '.incomplete' folders); "
            "convert the complete global_step_N/actor folder of an earlier step instead")
    if not path.exists():
        replaced = path.with_name(path.name + ".replaced")
        if replaced.is_dir():  # a save died between its two renames: the previous copy is complete
            return resolve_source(replaced)
        raise CheckpointError(f"{path} does not exist; pass a checkpoint folder such as "
                              "<trainer.default_local_dir>/global_step_N/actor")
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a folder; pass a checkpoint folder such as global_step_N/actor")
    if (path / _SHARDS).is_dir():
        if not (path / _SHARDS / ".metadata").is_file():
            raise CheckpointError(f"{path / _SHARDS} has no .metadata: the save did not finish; "
                                  "convert an earlier global_step_N/actor")
        return path
    roles = [path / name for name in _ROLE_DIRS if (path / name / _SHARDS).is_dir()]
    if roles:  # a step folder: its actor (PPO) or model (SFT, reward model)
        return resolve_source(roles[0])
    if path.name.startswith("global_step_"):
        found = sorted(p.name for p in path.iterdir() if p.is_dir())
        raise CheckpointError(f"{path} is a step folder without an actor/ (or model/) checkpoint (it holds "
                              f"{found}); pass the worker's folder, e.g. {path}/actor")
    if list(path.glob("global_step_*")):
        raise CheckpointError(f"{path} holds step folders, not a checkpoint; pass one of them, e.g. "
                              f"{sorted(path.glob('global_step_*'))[-1]}/actor")
    if (path / "config.json").is_file() and list(path.glob("*.safetensors")):
        raise CheckpointError(f"{path} is already a Hugging Face folder, not a training checkpoint")
    raise CheckpointError(f"{path} is not a checkpoint folder (no {_SHARDS}/ with DCP shards); pass "
                          "<trainer.default_local_dir>/global_step_N/actor")


def _hf_source(checkpoint: Path, model_path: str | Path | None) -> Path:
    """The folder with config and tokenizer: the checkpoint's `huggingface/`, else `model_path`."""
    if model_path is not None:
        folder = Path(model_path).expanduser()
        if not (folder / "config.json").is_file():
            raise CheckpointError(f"--model-path {folder} has no config.json; pass the run's "
                                  "actor_rollout_ref.model.path (a Hugging Face model folder)")
        return folder
    folder = checkpoint / HF_DIR
    if not (folder / "config.json").is_file():
        raise CheckpointError(
            f"{folder} has no config.json (the checkpoint was written before hflow saved the model's config "
            "with it); pass --model-path with the run's actor_rollout_ref.model.path for config and tokenizer")
    return folder


# ---- reading the shards ----------------------------------------------------------------------------------


def _metadata(checkpoint: Path):
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(checkpoint / _SHARDS)).read_metadata()


def _read(checkpoint: Path, metadata, keys: list[str]) -> dict[str, torch.Tensor]:
    """Full tensors of the given DCP keys, assembled from every rank's shards in this process (only those
    keys' byte ranges are read: never the optimizer state)."""
    import torch.distributed.checkpoint as dcp

    state = {}
    for key in keys:
        entry = metadata.state_dict_metadata[key]
        state[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
    if state:
        with warnings.catch_warnings():  # "torch.distributed is disabled ...": the point here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(checkpoint / _SHARDS), no_dist=True)
    return state


@dataclass
class _Weight:
    """One output tensor: where its value is in the shards, and its adapter's factors if it has one."""

    key: str
    dtype: torch.dtype
    lora_a: str | None = None
    lora_b: str | None = None

    def keys(self) -> list[str]:
        return [k for k in (self.key, self.lora_a, self.lora_b) if k is not None]


def _entries(metadata, prefix: str) -> dict[str, str]:
    """{HF name: DCP key} of the tensors saved under `prefix` ("model": PEFT / wrapper names cleaned)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from hflow.workers.fsdp import clean_param_name

    names = {}
    for key, entry in metadata.state_dict_metadata.items():
        if key.startswith(prefix + ".") and isinstance(entry, TensorStorageMetadata):
            names[clean_param_name(key[len(prefix) + 1:])] = key
    return names


def _plan(metadata, ema: bool, tied: bool) -> tuple[dict[str, _Weight], dict[str, int]]:
    """What to write, by HF name, and each adapted module's LoRA rank."""
    model = _entries(metadata, _MODEL)
    if not model:
        raise CheckpointError("the checkpoint's shards hold no model (checkpoint.contents without 'model')")
    source = model
    if ema:
        averages = _entries(metadata, _EMA)
        if not averages:
            raise CheckpointError("the checkpoint has no EMA of the weights (the run did not set "
                                  "actor_rollout_ref.actor.ema.enable=true); convert without --ema")
        source = {**model, **averages}  # the model's own persistent buffers where the EMA has none
    weights, factors, ranks = {}, {}, {}
    for name, key in model.items():
        if ".lora_" not in name:
            if not (tied and name == "lm_head.weight"):
                weights[name] = _Weight(source[name], metadata.state_dict_metadata[key].properties.dtype)
            continue
        match = _LORA_FACTOR.match(name)
        if match is None:
            raise CheckpointError(f"unsupported adapter tensor {key} (only LoRA on linear layers merges)")
        factors.setdefault(match["module"], {}).setdefault(match["adapter"], {})[match["which"]] = source[name]
    for module, adapters in factors.items():
        if len(adapters) != 1:
            raise CheckpointError(f"{module} has several LoRA adapters {sorted(adapters)}; one can be merged")
        (pair,) = adapters.values()
        weight = weights.get(f"{module}.weight")
        if weight is None or set(pair) != {"A", "B"}:
            raise CheckpointError(f"LoRA factors of {module} without their base weight or partner in the shards")
        weight.lora_a, weight.lora_b = pair["A"], pair["B"]
        ranks[module] = int(metadata.state_dict_metadata[pair["A"]].size[0])
    return weights, ranks


@dataclass
class _Lora:
    alpha: float
    target_modules: object = None  # as saved (None: the adapted modules found in the shards)

    def scaling(self, rank: int) -> float:
        return self.alpha / rank  # PEFT's LoRA scaling (hflow never sets use_rslora)


def _lora_settings(checkpoint: Path, lora_alpha: float | None) -> _Lora:
    saved = checkpoint / LORA_DIR / "adapter_config.json"
    if saved.is_file():
        config = json.loads(saved.read_text())
        unsupported = [k for k in ("rank_pattern", "alpha_pattern", "use_dora", "use_rslora", "fan_in_fan_out")
                       if config.get(k)]
        if unsupported:
            raise CheckpointError(f"{saved}: LoRA with {unsupported} is not supported by the converter")
        alpha = float(config["lora_alpha"]) if lora_alpha is None else float(lora_alpha)
        return _Lora(alpha, config.get("target_modules"))
    if lora_alpha is None:
        raise CheckpointError(
            f"{checkpoint} holds LoRA adapters but no {LORA_DIR}/adapter_config.json (written by older hflow); "
            "pass --lora-alpha with the run's actor_rollout_ref.model.lora_alpha (the rank is read from the shards)")
    return _Lora(float(lora_alpha))


def _batches(weights: dict[str, _Weight], metadata) -> Iterator[list[str]]:
    def size_of(key: str) -> int:
        entry = metadata.state_dict_metadata[key]
        return entry.size.numel() * entry.properties.dtype.itemsize

    batch, size = [], 0
    for name, weight in weights.items():
        nbytes = sum(size_of(k) for k in weight.keys())
        if batch and size + nbytes > _BATCH_BYTES:
            yield batch
            batch, size = [], 0
        batch.append(name)
        size += nbytes
    if batch:
        yield batch


def iter_merged_weights(checkpoint: Path, ema: bool = False, tied: bool = False, lora_alpha: float | None = None,
                        dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) of the checkpoint's model (or EMA), adapters merged, a batch of shards at a time."""
    metadata = _metadata(checkpoint)
    weights, ranks = _plan(metadata, ema, tied)
    lora = _lora_settings(checkpoint, lora_alpha) if ranks else None
    for batch in _batches(weights, metadata):
        tensors = _read(checkpoint, metadata, [k for name in batch for k in weights[name].keys()])
        for name in batch:
            weight = weights[name]
            full = tensors.pop(weight.key)
            if weight.lora_a is not None:
                a, b = tensors.pop(weight.lora_a).float(), tensors.pop(weight.lora_b).float()
                delta = lora.scaling(ranks[name.removesuffix(".weight")]) * (b @ a)
                full = full.float() + delta
            yield name, full.to(dtype or weight.dtype)


# ---- converting ------------------------------------------------------------------------------------------


class _CopyFiles:
    """Stands in for the tokenizer in `save_hf_model`: its `save_pretrained` copies the source folder's
    files as they are (tokenizer files, chat template, remote code), never the weights or configs."""

    _SKIP = ("config.json", "generation_config.json", "adapter_config.json", MANIFEST)
    _WEIGHTS = (".safetensors", ".bin", ".index.json", ".pt", ".pth", ".h5", ".msgpack", ".gguf")

    def __init__(self, folder: Path):
        self.folder = folder

    def save_pretrained(self, dest) -> None:
        for path in self.folder.iterdir():
            if path.is_file() and path.name not in self._SKIP and not path.name.endswith(self._WEIGHTS):
                shutil.copy2(path, Path(dest) / path.name)


@dataclass
class _ModelInfo:
    """What `save_hf_model` reads from a model besides its weights."""

    config: object
    generation_config: object = None


def _load_config(hf_dir: Path):
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(hf_dir)
    generation = GenerationConfig.from_pretrained(hf_dir) if (hf_dir / "generation_config.json").is_file() else None
    return config, generation


def _is_tied(config) -> bool:
    return bool(getattr(config, "tie_word_embeddings", False))


def convert_checkpoint(src: str | Path, dst: str | Path, ema: bool = False, dtype: torch.dtype | str | None = None,
                       model_path: str | Path | None = None, lora_alpha: float | None = None,
                       overwrite: bool = False) -> Path:
    """Write the checkpoint at `src` as a Hugging Face folder `dst` (see the module docstring); returns `dst`.

    `dtype`: of the written weights (default: as saved). Fails with a CheckpointError, before writing
    anything, on a folder it cannot convert, and with an OutputError on a `dst` that
    `hflow.utils.safe_output.check_output_folder` refuses (an existing non-empty one unless `overwrite`).
    """
    from hflow.workers.fsdp.checkpoint import save_hf_model

    checkpoint = resolve_source(src)
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise CheckpointError(f"dtype {dtype!r} is not one of {sorted(_DTYPES)}")
        dtype = _DTYPES[dtype]
    try:
        dst = check_output_folder(dst, arg="OUT_DIR", what="the Hugging Face folder", overwrite=overwrite,
                                  inputs={"the checkpoint": src, "the checkpoint folder": checkpoint,
                                          "--model-path": model_path})
    except OutputError as err:
        raise CheckpointError(str(err)) from None
    hf_dir = _hf_source(checkpoint, model_path)
    config, generation = _load_config(hf_dir)
    if dtype is not None:
        config.dtype = dtype
    weights = iter_merged_weights(checkpoint, ema=ema, tied=_is_tied(config), lora_alpha=lora_alpha, dtype=dtype)
    # the writer of the trainer's own export: shards of ~4 GiB, config, tie; staged beside dst, which it replaces
    # only once the new folder is complete
    save_hf_model(_ModelInfo(config, generation), dst, tokenizer=_CopyFiles(hf_dir), weights=weights, arg="OUT_DIR")
    return dst


# ---- verifying -------------------------------------------------------------------------------------------


def _reference_model(checkpoint: Path, ema: bool, model_path, lora_alpha):
    """The checkpoint's own model on CPU in fp32: the base architecture, LoRA adapters added as the actor
    adds them (unmerged), every tensor read from the shards under its training name."""
    from transformers import AutoModelForCausalLM

    from hflow.workers.fsdp import clean_param_name

    config, _ = _load_config(_hf_source(checkpoint, model_path))
    metadata = _metadata(checkpoint)
    _, ranks = _plan(metadata, ema, tied=False)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if ranks:
        from hflow.workers.fsdp.lora import add_lora

        lora = _lora_settings(checkpoint, lora_alpha)
        if len(set(ranks.values())) != 1:
            raise CheckpointError(f"LoRA ranks differ between modules {sorted(set(ranks.values()))}")
        targets = lora.target_modules or sorted({m.rsplit(".", 1)[-1] for m in ranks})
        model = add_lora(model, next(iter(ranks.values())), lora.alpha, targets)
    state, seen = {}, set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:  # a tied weight once, under its first name (EMA: the one it averages)
            seen.add(tensor.data_ptr())
            state[name] = tensor
    keys = {}
    for name in state:
        key = f"{_MODEL}.{name}"
        if ema and f"{_EMA}.{clean_param_name(name)}" in metadata.state_dict_metadata:
            key = f"{_EMA}.{clean_param_name(name)}"
        if key not in metadata.state_dict_metadata:
            raise CheckpointError(f"the checkpoint has no {key} that the model's {name} needs")
        keys[name] = key
    loaded = _read(checkpoint, metadata, sorted(set(keys.values())))
    with torch.no_grad():
        for name, tensor in state.items():
            tensor.copy_(loaded[keys[name]])
    return model.eval()


def _prompt_ids(out_dir: Path, n: int, vocab_size: int) -> list[torch.Tensor]:
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(out_dir)
        return [torch.tensor([tokenizer(_PROMPTS[i % len(_PROMPTS)])["input_ids"]]) for i in range(n)]
    except Exception:  # no usable tokenizer: fixed random token ids
        gen = torch.Generator().manual_seed(0)
        return [torch.randint(0, vocab_size, (1, 16), generator=gen) for _ in range(n)]


@torch.no_grad()
def verify_conversion(src: str | Path, out_dir: str | Path, ema: bool = False, prompts: int = 4,
                      model_path: str | Path | None = None, lora_alpha: float | None = None) -> float:
    """Max |logit difference| over `prompts` prompts between the converted folder (loaded by
    `transformers.AutoModelForCausalLM`, computing in fp32) and the checkpoint's own unmerged model."""
    from transformers import AutoModelForCausalLM

    checkpoint = resolve_source(src)
    reference = _reference_model(checkpoint, ema, model_path, lora_alpha)
    converted = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    diff = 0.0
    for ids in _prompt_ids(Path(out_dir), prompts, converted.config.get_text_config().vocab_size):
        diff = max(diff, (converted(input_ids=ids).logits - reference(input_ids=ids).logits).abs().max().item())
    return diff


def _written_dtype(out_dir: Path) -> torch.dtype:
    """The dtype of the first floating-point tensor written to `out_dir`."""
    from safetensors import safe_open

    for path in sorted(Path(out_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if f.get_slice(key).get_dtype() in ("F32", "BF16", "F16"):
                    return f.get_tensor(key).dtype
    return torch.float32


# ---- command line ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hflow.cli.convert_checkpoint", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="global_step_N/actor (or global_step_N) of a training run")
    parser.add_argument("out", help="the Hugging Face folder to write (must not exist, or be empty)")
    parser.add_argument("--ema", action="store_true", help="write the EMA of the weights (actor.ema.enable)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), help="dtype of the written weights (default: as saved)")
    parser.add_argument("--verify", action="store_true",
                        help="compare the output's logits with the checkpoint's own model; exit 1 beyond --tolerance")
    parser.add_argument("--prompts", type=int, default=4, help="prompts --verify runs (default 4)")
    parser.add_argument("--tolerance", type=float,
                        help="largest max |logit difference| --verify accepts (default 1e-5 for float32 weights, "
                             "0.25 for bfloat16, 0.05 for float16)")
    parser.add_argument("--model-path", help="config and tokenizer folder for a checkpoint without huggingface/ "
                                             "(the run's actor_rollout_ref.model.path)")
    parser.add_argument("--lora-alpha", type=float,
                        help="LoRA alpha for a checkpoint without lora/adapter_config.json (model.lora_alpha)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a folder at OUT_DIR that hflow wrote (its .hflow-output.json lists every file "
                             "in it; never a folder it reads, nor one holding or inside a training checkpoint)")
    args = parser.parse_args(argv)
    dtype = _DTYPES.get(args.dtype)
    try:
        out = convert_checkpoint(args.checkpoint, args.out, ema=args.ema, dtype=dtype, model_path=args.model_path,
                                 lora_alpha=args.lora_alpha, overwrite=args.overwrite)
        print(f"convert_checkpoint: wrote {out}", flush=True)
        if not args.verify:
            return 0
        diff = verify_conversion(args.checkpoint, out, ema=args.ema, prompts=args.prompts,
                                 model_path=args.model_path, lora_alpha=args.lora_alpha)
    except UserError as err:
        print(f"hflow: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a path that cannot be read or written: its name and why, no traceback
        print(f"hflow: error: {err.filename or args.out}: {err.strerror or err}; check the paths given to "
              "python -m hflow.cli.convert_checkpoint", file=sys.stderr)
        return 2
    tolerance = args.tolerance if args.tolerance is not None else _TOLERANCE[_written_dtype(out)]
    verdict = "OK" if diff <= tolerance else "FAIL"
    print(f"convert_checkpoint: verify {verdict}: max |logit difference| {diff:.3g} over {args.prompts} prompts "
          f"(tolerance {tolerance:g})", flush=True)
    return 0 if diff <= tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
