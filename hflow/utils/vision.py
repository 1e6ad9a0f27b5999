"""Images in prompts: the processor, the dataset's image column, and the vision inputs of a forward pass.

Data follows verl's convention: a row's ``images`` column holds the prompt's images (each raw bytes, a path,
or a ``{"bytes": ..., "path": ...}`` struct, as `datasets` writes them), and each image sits in the prompt
text as an ``<image>`` placeholder, in order. The dataset turns each placeholder into an image part of its
message (``{"type": "image"}``), so the model's chat template writes the model's own marker
(Qwen2-VL: ``<|vision_start|><|image_pad|><|vision_end|>``), and the processor expands each image's pad
token to one token per merged patch.

A sample's vision inputs travel beside its tensors as ``multi_modal_inputs`` (a dict per sample in the
non-tensor batch: ``pixel_values`` (patches, D) and ``image_grid_thw`` (images, 3)). A forward over a
micro-batch concatenates its rows' inputs in row order (`batch_vision_inputs`) and gives the language model
multimodal rotary positions (Qwen2-VL's mrope: temporal, height, width) computed for each sequence on its
own (`rope_positions`); the packed (remove-padding) forward takes those same per-sequence positions at the
valid tokens (`packed_rope_positions`), never positions computed over the packed row, which would run on
from one sequence into the next.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hflow.utils.errors import ConfigError, DataError

__all__ = ["IMAGE_PLACEHOLDER", "MM_INPUTS", "PROCESSOR_FILES", "ImageTextProcessor", "batch_vision_inputs",
           "copy_processor_files", "decode_image", "freeze_vision_tower", "has_vision_tower",
           "load_processor", "mm_token_type_ids", "packed_rope_positions", "rope_positions",
           "split_image_placeholders", "vision_tower"]

IMAGE_PLACEHOLDER = "<image>"
MM_INPUTS = "multi_modal_inputs"  # the non-tensor column of each sample's vision inputs (a dict; {} without images)
# The image processor's file in a model folder; without it the folder has no processor for images.
IMAGE_PROCESSOR_FILE = "preprocessor_config.json"
# What a model folder holds for its processor besides the tokenizer's files (which `save_pretrained` writes).
PROCESSOR_FILES = (IMAGE_PROCESSOR_FILE, "processor_config.json", "video_preprocessor_config.json",
                   "chat_template.json")


def copy_processor_files(source: str | os.PathLike, dest: str | os.PathLike) -> list[str]:
    """Copy a model folder's processor files (`PROCESSOR_FILES` that exist) into an export of it, so the
    export loads with its processor as the original does. Returns the names copied."""
    import shutil

    copied = []
    for name in PROCESSOR_FILES:
        path = os.path.join(source, name)
        if os.path.isfile(path):
            shutil.copyfile(path, os.path.join(dest, name))
            copied.append(name)
    return copied


def vision_tower(model: torch.nn.Module) -> torch.nn.Module | None:
    """The vision encoder (with its patch merger) of a Qwen2-VL-family model (`model.visual`), else None."""
    for owner in (model, getattr(model, "model", None)):
        if owner is not None and isinstance(getattr(owner, "visual", None), torch.nn.Module):
            return owner.visual
    return None


def freeze_vision_tower(model: torch.nn.Module, key: str = "actor_rollout_ref.actor.freeze_vision_tower") -> None:
    """`key` (the actor's or the critic's `freeze_vision_tower`): the vision encoder keeps its weights (no
    gradient, no optimizer state); the language model (and a critic's value head) trains on."""
    tower = vision_tower(model)
    if tower is None:
        raise ConfigError(f"{key}=true, but the model ({type(model).__name__}) "
                          "has no vision tower; set it to false for a text-only model")
    tower.requires_grad_(False)


def has_vision_tower(model_path: str) -> bool:
    """Whether the model folder's config describes a vision-language model (a `vision_config`)."""
    config_file = os.path.join(model_path, "config.json")
    if not os.path.isfile(config_file):
        return False
    with open(config_file) as f:
        return "vision_config" in json.load(f)


def load_processor(model_path: str, tokenizer: Any, trust_remote_code: bool = False) -> Any | None:
    """The model folder's processor for images, or None when the folder has none (a text-only model).

    `AutoProcessor` where it can be built. Qwen2-VL's processor also builds a video processor, which needs
    torchvision; where torchvision is missing (the CPU stack: no wheel matches the CPU torch build) the same
    folder's image processor and `tokenizer` make an `ImageTextProcessor`, which does what the Qwen2-VL
    processor does for images.
    """
    if not os.path.isfile(os.path.join(model_path, IMAGE_PROCESSOR_FILE)):
        return None
    from transformers import AutoImageProcessor, AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except ImportError as err:
        if "torchvision" not in str(err).lower():
            raise
        image_processor = AutoImageProcessor.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        return ImageTextProcessor(image_processor, tokenizer)
    if getattr(processor, "image_processor", None) is None:
        return None
    return processor


class ImageTextProcessor:
    """The image half of a Qwen2-VL-family processor: images to patches (the folder's image processor), and
    each image pad token of the text expanded to one token per merged patch of its image."""

    image_token = "<|image_pad|>"

    def __init__(self, image_processor: Any, tokenizer: Any) -> None:
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        if self.image_token_id is None or self.image_token_id == tokenizer.unk_token_id:
            raise ConfigError(f"the tokenizer has no {self.image_token!r} token, which a Qwen2-VL-family model "
                              "marks images with; use the model folder's own tokenizer")

    def __call__(self, text: Sequence[str], images: Sequence[Any] | None = None, return_tensors: str = "pt",
                 **kwargs: Any) -> dict[str, torch.Tensor]:
        texts = list(text)
        out: dict[str, torch.Tensor] = {}
        if images:
            vision = self.image_processor(images=list(images), return_tensors=return_tensors)
            merge = self.image_processor.merge_size ** 2
            counts = iter((vision["image_grid_thw"].prod(-1) // merge).tolist())
            expanded = []
            for piece in texts:
                parts = piece.split(self.image_token)
                expanded.append(parts[0] + "".join(self.image_token * next(counts) + p for p in parts[1:]))
            texts = expanded
            out.update(pixel_values=vision["pixel_values"], image_grid_thw=vision["image_grid_thw"])
        encoded = self.tokenizer(texts, add_special_tokens=False, return_tensors=return_tensors, padding=True)
        out.update(input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"])
        return out


def decode_image(value: Any, where: Callable[[], str]) -> Any:
    """One image of the ``images`` column as an RGB PIL image; a missing or unreadable one is a `DataError`
    naming `where()` (file and row)."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, dict):  # datasets' Image feature: {"bytes": ..., "path": ...}
        value = value.get("bytes") or value.get("path")
    if isinstance(value, Image.Image):
        return value.convert("RGB")
    try:
        if isinstance(value, (bytes, bytearray)):
            image = Image.open(io.BytesIO(value))
        elif isinstance(value, (str, os.PathLike)):
            if not os.path.isfile(value):
                raise DataError(f"{where()}: image {os.fspath(value)!r} does not exist; fix the path in the images "
                                "column (relative paths are read from the working directory), or drop the row")
            image = Image.open(value)
        else:
            raise DataError(f"{where()}: an entry of the images column is {type(value).__name__}; give raw bytes, a "
                            "path, or a {'bytes': ..., 'path': ...} struct")
        image.load()
    except (UnidentifiedImageError, OSError) as err:
        raise DataError(f"{where()}: an image of the images column is not a readable image ({type(err).__name__}: "
                        f"{err}); fix or drop the row") from None
    return image.convert("RGB")


def split_image_placeholders(messages: list[dict[str, Any]], num_images: int,
                             where: Callable[[], str]) -> list[dict[str, Any]]:
    """`messages` with each ``<image>`` of a text content turned into an image part, in order:
    ``"a <image> b"`` -> ``[{"type": "text", "text": "a "}, {"type": "image"}, {"type": "text", "text": " b"}]``.
    The placeholders must match the row's images one to one (a `DataError` naming the row otherwise)."""
    found = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages if isinstance(m["content"], str))
    if found != num_images:
        raise DataError(f"{where()}: the prompt has {found} {IMAGE_PLACEHOLDER} placeholder(s) and the images "
                        f"column {num_images} image(s); put one {IMAGE_PLACEHOLDER} in the text where each image goes")
    out = []
    for message in messages:
        content = message["content"]
        if not isinstance(content, str) or IMAGE_PLACEHOLDER not in content:
            out.append(message)
            continue
        parts: list[dict[str, Any]] = []
        for i, text in enumerate(content.split(IMAGE_PLACEHOLDER)):
            if i:
                parts.append({"type": "image"})
            if text:
                parts.append({"type": "text", "text": text})
        out.append({**message, "content": parts})
    return out


# ---- forward -------------------------------------------------------------------------------------------


def batch_vision_inputs(rows: Sequence[dict[str, torch.Tensor] | None], device: torch.device) -> dict[str, torch.Tensor]:
    """The vision inputs of a micro-batch: its rows' ``pixel_values`` and ``image_grid_thw`` concatenated in
    row order (the model matches them to the image tokens in that order); {} when no row has an image."""
    rows = [r for r in rows if r and "image_grid_thw" in r]
    if not rows:
        return {}
    return {key: torch.cat([torch.as_tensor(r[key]) for r in rows]).to(device)
            for key in ("pixel_values", "image_grid_thw")}


def _rope_owner(model: torch.nn.Module) -> Any:
    """The first module of `model` whose class has `get_rope_index` (Qwen2-VL: the model itself, under any
    wrapper: FSDP2 keeps the class, PEFT wraps it)."""
    for module in model.modules():
        if hasattr(type(module), "get_rope_index"):
            return module
    raise TypeError(f"{type(model).__name__} has no get_rope_index: it is not a Qwen2-VL-family model, whose "
                    "multimodal rotary positions hflow computes")


def mm_token_type_ids(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """0 for text, 1 for image tokens (what the model's processor returns alongside the ids)."""
    return (input_ids == model.config.image_token_id).int()


def rope_positions(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   image_grid_thw: torch.Tensor | None) -> torch.Tensor:
    """Multimodal rotary positions (3, B, T) of a padded batch, each row from its own valid tokens (the
    padding skipped), with the model's own rule (`get_rope_index`). Given to the model explicitly, so it
    keeps no state between calls (Qwen2-VL caches `rope_deltas` when it computes them itself)."""
    owner = _rope_owner(model)
    positions, _ = owner.get_rope_index(input_ids, mm_token_type_ids=mm_token_type_ids(owner, input_ids),
                                        image_grid_thw=image_grid_thw, attention_mask=attention_mask)
    return positions


def packed_rope_positions(positions: torch.Tensor, attention_mask: torch.Tensor,
                          text_positions: torch.Tensor) -> torch.Tensor:
    """Positions of the packed row (4, 1, N): the text positions (restarting at every sequence; the model
    reads its attention layout from them) on top of the padded batch's per-sequence mrope positions (3, B, T)
    taken at the valid tokens, in the packing's order (row after row)."""
    valid = attention_mask.bool()
    return torch.cat([text_positions.unsqueeze(0), positions[:, valid].unsqueeze(1)], dim=0)
