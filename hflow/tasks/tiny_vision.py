"""A tiny Qwen2-VL model and its processor files, built locally for tests (nothing is downloaded).

The folder holds what a Qwen2-VL checkpoint holds: `config.json` (a `vision_config` beside the text
model's), the weights, the built-in byte-level tokenizer with the vision special tokens added
(``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>``, ``<|video_pad|>``), a chat template that
writes an image part of a message as ``<|vision_start|><|image_pad|><|vision_end|>``, the image processor's
`preprocessor_config.json` and `processor_config.json`. It loads with `AutoModelForImageTextToText`
and `hflow.utils.vision.load_processor` (with `AutoProcessor` where torchvision is installed).

    from hflow.tasks.tiny_vision import build_vision_lm
    model_dir = build_vision_lm("/tmp/qwen2-vl-tiny")
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import GenerationConfig, Qwen2VLConfig, Qwen2VLForConditionalGeneration

from hflow.tasks.tiny_models import build_tokenizer

__all__ = ["VISION_CHAT_TEMPLATE", "VISION_TOKENS", "build_vision_lm"]

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

# ChatML, with a message's content either a string or a list of parts ({"type": "text", "text": ...} or
# {"type": "image"}), as Qwen2-VL's own template.
VISION_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Images are resized to between 56x56 and 112x112 pixels: 16 to 64 patches of 14 pixels a side, 4 to 16 image
# tokens after the 2x2 merge.
_MIN_PIXELS, _MAX_PIXELS = 56 * 56, 112 * 112


def build_vision_lm(save_dir: str | Path, *, seed: int = 0, hidden_size: int = 256, num_layers: int = 2,
                    vision_depth: int = 2, vision_dim: int = 64, max_pixels: int = _MAX_PIXELS) -> Path:
    """Write a randomly initialised tiny Qwen2-VL (text: `hidden_size`, 4 heads of 64, `num_layers`; vision:
    `vision_depth` blocks of width `vision_dim`, patch 14, 2x2 merge) with its tokenizer and processor files
    into `save_dir`. fp32 weights drawn from `seed` without touching the caller's RNG. Returns the folder."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(save_dir)
    tokenizer.add_tokens(list(VISION_TOKENS), special_tokens=True)
    tokenizer.chat_template = VISION_CHAT_TEMPLATE
    tokenizer.save_pretrained(str(save_dir))
    Qwen2VLImageProcessorPil(min_pixels=_MIN_PIXELS, max_pixels=max_pixels, patch_size=14, merge_size=2,
                             temporal_patch_size=2).save_pretrained(str(save_dir))
    (save_dir / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2VLProcessor"}) + "\n")

    ids = dict(zip(VISION_TOKENS, tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))))
    head_dim = 64
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=hidden_size, num_hidden_layers=num_layers,
            num_attention_heads=hidden_size // head_dim, num_key_value_heads=max(1, hidden_size // head_dim // 2),
            intermediate_size=2 * hidden_size, max_position_embeddings=2048,
            # mrope: the head's 32 rotary frequencies split into temporal, height and width sections
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [16, 8, 8]},
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(depth=vision_depth, embed_dim=vision_dim, hidden_size=hidden_size, num_heads=2,
                           mlp_ratio=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False, dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(config)
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(str(save_dir))
    return save_dir
