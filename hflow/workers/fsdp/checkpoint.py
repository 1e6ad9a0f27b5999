"""Checkpoints of FSDP2 models: sharded training state, and a plain Hugging Face export.

Training state (`FSDPCheckpointManager`): the model and optimizer are saved with
`torch.distributed.checkpoint` (each rank writes its own shards, any world size can load them), the LR
scheduler and every RNG stream per rank with `torch.save`. A checkpoint is written into a temporary
folder beside its destination and renamed into place only when every rank has finished, so an
interrupted save never damages the previous checkpoint and never leaves a half-written one under the
real name.

Layout of a checkpoint folder:

    model_optim/            DCP shards of {"model", "optimizer"} (.metadata, __<rank>_0.distcp)
    extra_rank_<r>.pt       LR scheduler state, RNG states and other stateful objects of rank r
    huggingface/            config, generation config, tokenizer (written with every checkpoint, for
                            hflow.cli.convert_checkpoint); + safetensors when contents include "hf_model"
    lora/adapter_config.json  (LoRA actors) the adapters' rank, alpha and targets
    <name>/                 (contents include "hf_model") each extra export, e.g. the actor's EMA
                            weights as `ema_huggingface/`

Sharded state beside the model (`sharded_state`, e.g. an EMA of the weights, whose state dict holds
DTensors with the parameters' placements) goes into `model_optim/` with the model, under its own name,
so it is resharded on load like the model.

The Hugging Face export (`save_hf_model`) gathers full parameters one tensor at a time and writes
safetensors that `transformers` and vLLM load as they are.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch
import torch.distributed as dist

from hflow.utils import device
from hflow.utils.safe_output import check_replaceable, staged_folder
from hflow.utils.vision import copy_processor_files

HF_DIR = "huggingface"  # config, tokenizer (+ weights with hf_model) of a checkpoint
LORA_DIR = "lora"  # a LoRA model's adapter config
_TMP_SUFFIX = ".incomplete"
_OLD_SUFFIX = ".replaced"
_SHARD_BYTES = 4 * 2**30  # safetensors files of at most ~4 GiB, as Hugging Face does

logger = logging.getLogger(__name__)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def rng_state() -> dict:
    """Every RNG stream of this process, in types `torch.load(weights_only=True)` reads back (tensors,
    numbers, tuples): a checkpoint from elsewhere can then never run code when it is loaded."""
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state = {"python": random.getstate(),
             "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached_gaussian)),
             "torch": torch.get_rng_state()}
    if device.is_cuda():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached_gaussian))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and device.is_cuda():
        torch.cuda.set_rng_state(state["cuda"])


def resolve_checkpoint(path: str | os.PathLike) -> Path | None:
    """The usable checkpoint at `path`: itself, or the copy it replaced if a save died mid-rename."""
    path = Path(path)
    if path.is_dir():
        return path
    replaced = path.with_name(path.name + _OLD_SUFFIX)
    return replaced if replaced.is_dir() else None


def commit_folder(tmp: Path, final: Path) -> None:
    """Move a completely written `tmp` folder to `final` (rank 0 only), replacing any older copy.

    Until the second rename, `final` or its `.replaced` copy is a complete checkpoint.
    """
    old = final.with_name(final.name + _OLD_SUFFIX)
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    if old.exists():
        shutil.rmtree(old)


class FSDPCheckpointManager:
    """Save and load the sharded training state of one FSDP2 model (all ranks call both)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 lr_scheduler=None, tokenizer=None, contents: Iterable[str] = ("model", "optimizer", "extra"),
                 stateful: dict | None = None, sharded_state: dict | None = None,
                 hf_exports: dict[str, Callable[[Path], None]] | None = None):
        unknown = set(contents) - {"model", "optimizer", "extra", "hf_model"}
        if unknown:
            raise ValueError(
                f"checkpoint.contents has unknown entries {sorted(unknown)}; use model, optimizer, extra, hf_model"
            )
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.tokenizer = tokenizer
        self.contents = set(contents)
        # Other per-rank state with state_dict()/load_state_dict() (e.g. the generation RNG stream).
        self.stateful = dict(stateful or {})
        # Sharded state saved with the model (contents include "model"): state_dict() gives tensors that
        # DCP fills in place on load; an object may define reset(), called when a checkpoint lacks it.
        self.sharded_state = dict(sharded_state or {})
        # Extra Hugging Face folders written beside huggingface/: {folder name: writer(folder path)},
        # called on every rank (the writers gather shards).
        self.hf_exports = dict(hf_exports or {})

    def _state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        state = {}
        if "model" in self.contents:
            state["model"] = get_model_state_dict(self.model)
        if "optimizer" in self.contents and self.optimizer is not None:
            state["optimizer"] = get_optimizer_state_dict(self.model, self.optimizer)
        if "model" in self.contents:
            for name, obj in self.sharded_state.items():
                state[name] = obj.state_dict()
        return state

    def save_checkpoint(self, path: str | os.PathLike, global_step: int = 0) -> Path:
        import torch.distributed.checkpoint as dcp

        final = Path(path)
        tmp = final.with_name(final.name + _TMP_SUFFIX)
        if _rank() == 0:
            if tmp.exists():  # left by an earlier save that died
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        _barrier()
        state = self._state()
        if state:
            dcp.save(state, checkpoint_id=str(tmp / "model_optim"))
        if "extra" in self.contents:
            extra = {"rng": rng_state(), "global_step": global_step}
            if self.lr_scheduler is not None:
                extra["lr_scheduler"] = self.lr_scheduler.state_dict()
            extra["stateful"] = {name: obj.state_dict() for name, obj in self.stateful.items()}
            torch.save(extra, tmp / f"extra_rank_{_rank()}.pt")
        if "hf_model" in self.contents:
            save_hf_model(self.model, tmp / HF_DIR, tokenizer=self.tokenizer)
            for folder, export in self.hf_exports.items():
                export(tmp / folder)
        if _rank() == 0 and "model" in self.contents:
            save_model_info(tmp, self.model, self.tokenizer)
        _barrier()
        if _rank() == 0:
            commit_folder(tmp, final)
        _barrier()
        return final

    def load_checkpoint(self, path: str | os.PathLike) -> dict:
        """Restore model, optimizer, scheduler and this rank's RNG; returns the extra dict (or {})."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        found = resolve_checkpoint(path)
        if found is None:
            raise FileNotFoundError(f"no checkpoint at {path} (a folder written by save_checkpoint)")
        state = self._state()
        absent = []
        if state:
            saved = {key.split(".", 1)[0] for key in
                     dcp.FileSystemReader(str(found / "model_optim")).read_metadata().state_dict_metadata}
            absent = [name for name in self.sharded_state if name in state and name not in saved]
            for name in absent:  # e.g. an EMA enabled on resuming a run that had none
                del state[name]
            dcp.load(state, checkpoint_id=str(found / "model_optim"))
            if "model" in state:
                set_model_state_dict(self.model, state["model"])
            if "optimizer" in state:
                set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
            for name, obj in self.sharded_state.items():
                if name in state:
                    obj.load_state_dict(state[name])
        for name in absent:  # after the model: the state restarts from the loaded weights
            logger.warning("checkpoint %s has no %r state; it restarts from the loaded model", found, name)
            if hasattr(self.sharded_state[name], "reset"):
                self.sharded_state[name].reset()
        extra_path = found / f"extra_rank_{_rank()}.pt"
        own = extra_path.exists()
        if not own:  # a checkpoint of fewer ranks (DCP reshards the tensors; this is the rest)
            extra_path = found / "extra_rank_0.pt"
        if "extra" not in self.contents or not extra_path.exists():
            return {}
        extra = torch.load(extra_path, weights_only=True)
        # The step and the learning-rate schedule are the same on every rank; a rank without a file of its own
        # takes rank 0's, or it would step its shards at another rate than the others'.
        if self.lr_scheduler is not None and "lr_scheduler" in extra:
            self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        if not own:
            # Random streams are each rank's own: a copy of rank 0's would sample what rank 0 samples.
            logger.warning("checkpoint %s has no state of rank %d (saved by fewer ranks): its random streams "
                           "start afresh", found, _rank())
            return extra
        set_rng_state(extra["rng"])
        for name, obj in self.stateful.items():
            if name in extra.get("stateful", {}):
                obj.load_state_dict(extra["stateful"][name])
        return extra


def save_tokenizer_and_processor(tokenizer, dest: str | os.PathLike) -> None:
    """The tokenizer's files, and the processor files of the folder it was loaded from (a vision-language
    model's image processor: without them the export would load as a text-only model)."""
    tokenizer.save_pretrained(dest)
    source = getattr(tokenizer, "name_or_path", None)
    if source and os.path.isdir(source):
        copy_processor_files(source, dest)


def save_model_info(folder: Path, model: torch.nn.Module, tokenizer=None) -> None:
    """What reading a checkpoint offline needs beside its shards (`hflow.cli.convert_checkpoint`): the
    model's config, generation config and tokenizer in `huggingface/` (unless an hf_model export put them
    there), and a LoRA model's adapter config (rank, alpha, targets) in `lora/`."""
    hf_dir = folder / HF_DIR
    if not (hf_dir / "config.json").exists():
        model.config.save_pretrained(hf_dir)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(hf_dir)
        if tokenizer is not None:
            save_tokenizer_and_processor(tokenizer, hf_dir)
    adapter = (getattr(model, "peft_config", None) or {}).get("default")
    if adapter is not None:
        adapter.save_pretrained(folder / LORA_DIR)


def save_hf_model(model: torch.nn.Module, path: str | os.PathLike, tokenizer=None,
                  dtype: torch.dtype | None = None,
                  weights: Iterable[tuple[str, torch.Tensor]] | None = None,
                  arg: str = "the Hugging Face export folder") -> None:
    """Write `model` (FSDP2-sharded or plain) as a Hugging Face folder: config, tokenizer, safetensors.

    Every rank takes part in gathering each full parameter (one at a time, so peak memory is one full
    tensor on the device); rank 0 keeps them on CPU and writes the files, into a temporary folder that
    is renamed into place when complete (`hflow.utils.safe_output.staged_folder`: with the manifest of its
    files). An existing folder at `path` is replaced only when hflow wrote all of it (`check_replaceable`,
    checked on every rank before any gathering; `arg` names the folder in its message). `weights`: (HF name,
    full tensor) pairs to write instead of the model's own (e.g. `ParamEMA.iter_full()`); the model still
    gives the config and the tie.
    """
    from hflow.workers.fsdp.params import iter_full_params

    final = Path(path)
    check_replaceable(final, arg=arg)  # on every rank: none waits in a collective for one that refused
    config = getattr(model, "config", None)
    tied = bool(config is not None and getattr(config, "tie_word_embeddings", False))
    tensors = {}
    for name, tensor in (iter_full_params(model) if weights is None else weights):
        if _rank() == 0 and not (tied and name == "lm_head.weight"):
            tensors[name] = tensor.detach().to("cpu", dtype or tensor.dtype).contiguous()
    if _rank() != 0:
        _barrier()
        return
    with staged_folder(final, written_by="hflow: a Hugging Face export (save_hf_model)", arg=arg) as tmp:
        tmp.mkdir()
        _write_hf_folder(tmp, tensors, model, config, tokenizer)
    _barrier()


def _write_hf_folder(tmp: Path, tensors: dict[str, torch.Tensor], model, config, tokenizer) -> None:
    from safetensors.torch import save_file

    shards = _split_into_shards(tensors)
    if len(shards) == 1:
        save_file(shards[0], tmp / "model.safetensors", metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            filename = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, tmp / filename, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, filename))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    if config is not None:
        config.save_pretrained(tmp)
        generation_config = getattr(model, "generation_config", None)
        if generation_config is not None:
            generation_config.save_pretrained(tmp)
    if tokenizer is not None:
        save_tokenizer_and_processor(tokenizer, tmp)


def _split_into_shards(tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    shards, current, size = [], {}, 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > _SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor
        size += nbytes
    shards.append(current)
    return shards
