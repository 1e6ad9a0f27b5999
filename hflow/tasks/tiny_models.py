"""Deterministic tiny tokenizers and models for tests, examples and CPU defaults.

Nothing is downloaded: the tokenizer is a byte-level BPE trained with `tokenizers` on a fixed
built-in corpus, and the model is a randomly initialised Qwen2 or Llama with a seeded RNG. The same
arguments give bit-identical files, so a test can build its model folder in a temporary directory
instead of shipping weights. A causal-LM folder loads with both `AutoModelForCausalLM.from_pretrained`
and `vllm.LLM(model=folder)`.

    from hflow.tasks.tiny_models import build_causal_lm
    model_dir = build_causal_lm("/tmp/qwen2-tiny", preset="tiny")
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    GenerationConfig,
    PreTrainedTokenizerFast,
)

__all__ = [
    "CHAT_TEMPLATE",
    "PRESETS",
    "SPECIAL_TOKENS",
    "TinyModelSpec",
    "build_causal_lm",
    "build_token_classification",
    "build_tokenizer",
]

# Head sizes the vLLM CPU attention backend supports; other sizes fail inside vLLM at engine start.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, "<|endoftext|>", "<|im_start|>", EOS_TOKEN)

# ChatML: <|im_start|>role\ncontent<|im_end|>\n per message; the generation prompt opens an
# assistant turn, which the model ends with <|im_end|> (its EOS).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Enough text to fill a few hundred merges: numbers and arithmetic (GSM8K-style toy tasks), chat
# roles and everyday English words.
_CORPUS = [
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 25 30 40 50 60 70 80 90 100 1000",
    "1 + 1 = 2. 2 + 3 = 5. 7 - 4 = 3. 6 * 7 = 42. 81 / 9 = 9. (3 + 4) * 2 = 14. 10 % 3 = 1.",
    "12 + 30 = 42, 99 - 11 = 88, 25 * 4 = 100, 144 / 12 = 12, 2 ^ 10 = 1024, 3.5 + 1.5 = 5.0",
    "Question: what is 17 plus 25? Answer: 17 + 25 = 42. The answer is #### 42",
    "Question: Tom has 3 apples and buys 4 more. How many apples does he have? Answer: 3 + 4 = 7 #### 7",
    "Let's think step by step. First, add the numbers. Then, multiply the result by two.",
    "system user assistant You are a helpful assistant. Please answer the question.",
    "the of and to a in is it you that he was for on are with as I his they be at one have this",
    "from or had by hot word but what some we can out other were all there when up use your how",
    "said an each she which do their time if will way about many then them write would like so",
    "these her long make thing see him two has look more day could go come did number sound no",
    "most people my over know water than call first who may down side been now find any new work",
    "part take get place made live where after back little only round man year came show every",
    "good me give our under name very through just form sentence great think say help low line",
    "differ turn cause much mean before move right boy old too same tell does set three want air",
    "well also play small end put home read hand port large spell add even land here must big",
    "high such follow act why ask men change went light kind off need house picture try us again",
    "animal point mother world near build self earth father head stand own page should country",
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with one step.",
    "Reward is one if the final answer is correct and zero otherwise. Sum, total, count, half, double.",
]


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of a tiny decoder-only model; `hidden_size / num_heads` is the head size."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02


PRESETS: dict[str, TinyModelSpec] = {
    # 1.44M parameters with the default tokenizer.
    "tiny": TinyModelSpec(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=512),
    # 12.3M parameters: big enough that vLLM clearly beats HF generate on CPU.
    "small": TinyModelSpec(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=1408),
}

_ARCHITECTURES = ("qwen2", "llama", "qwen3_moe")

# Qwen2's pre-tokenizer (single digits, words with their leading space, punctuation runs). transformers
# rebuilds this pipeline for every model_type "qwen2" folder whatever tokenizer.json says, so training
# with it keeps the tokenizer we save and the one AutoTokenizer loads identical, for every arch.
_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def build_tokenizer(
    save_dir: str | Path,
    vocab_size: int = 512,
    model_max_length: int = 2048,
    *,
    extra_corpus: Sequence[str] = (),
    added_tokens: Sequence[str] = (),
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on the built-in corpus and save it (with its chat template) to `save_dir`.

    Byte-level means every string round-trips, whatever the corpus covered. `vocab_size` counts the
    256 byte tokens, the special tokens and the merges. Prompts are padded on the left.

    `extra_corpus` lines are trained on after the built-in ones (text a task wants in few tokens, such
    as its tool-call markup); `added_tokens` become single, normal (not special) tokens after the
    merges, like Qwen2.5's ``<tool_call>``: matched before pre-tokenization, kept when special tokens are
    skipped in decoding. The defaults give the built-in tokenizer, byte for byte.
    """
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=1,
        show_progress=False,
    )
    bpe.train_from_iterator([*_CORPUS, *extra_corpus], trainer=trainer)
    if added_tokens:
        bpe.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)],
        padding_side="left",
        model_max_length=model_max_length,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(save_dir))
    return tokenizer


def build_causal_lm(
    save_dir: str | Path,
    preset: str = "tiny",
    *,
    arch: str = "qwen2",
    seed: int = 0,
    tokenizer_kwargs: Mapping[str, Any] | None = None,
    num_experts: int = 0,
    experts_per_token: int = 2,
    **shape: int | bool | float,
) -> Path:
    """Write a randomly initialised causal LM, its configs and its tokenizer into one HF folder.

    `num_experts` > 0 (with `arch="qwen3_moe"`) makes every MLP a mixture of that many experts of
    `intermediate_size`, `experts_per_token` of them per token (top-k, renormalised).

    `shape` overrides fields of `PRESETS[preset]` (`hidden_size`, `num_layers`, `num_heads`,
    `num_kv_heads`, `intermediate_size`, `max_position_embeddings`, `tie_word_embeddings`,
    `initializer_range`); the vocabulary size is the tokenizer's. `tokenizer_kwargs` go to
    `build_tokenizer` (`vocab_size`, `extra_corpus`, `added_tokens`). Weights are fp32 safetensors
    drawn from `seed` without touching the caller's RNG. Returns the folder.
    """
    moe: dict[str, Any] = {}
    if (arch == "qwen3_moe") != (num_experts > 0):
        raise ValueError(f"arch={arch!r} with num_experts={num_experts}: a mixture of experts is arch='qwen3_moe' "
                         "with num_experts > 0")
    if num_experts:
        spec = replace(PRESETS[preset], **shape)
        moe = {"num_experts": num_experts, "num_experts_per_tok": experts_per_token, "norm_topk_prob": True,
               "moe_intermediate_size": spec.intermediate_size, "head_dim": spec.hidden_size // spec.num_heads}
    return _build(save_dir, AutoModelForCausalLM, preset, arch, seed, shape, tokenizer_kwargs=tokenizer_kwargs, **moe)


def build_token_classification(
    save_dir: str | Path,
    preset: str = "tiny",
    *,
    arch: str = "qwen2",
    seed: int = 0,
    num_labels: int = 1,
    **shape: int | bool | float,
) -> Path:
    """Like `build_causal_lm`, with a per-token `num_labels` head: a critic (value model) for tests.

    HF only: vLLM does not serve these heads.
    """
    return _build(save_dir, AutoModelForTokenClassification, preset, arch, seed, shape, num_labels=num_labels)


def _build(
    save_dir: str | Path,
    auto_class: type,
    preset: str,
    arch: str,
    seed: int,
    shape: dict[str, int | bool | float],
    tokenizer_kwargs: Mapping[str, Any] | None = None,
    **config_kwargs: Any,
) -> Path:
    if arch not in _ARCHITECTURES:
        raise ValueError(f"arch={arch!r} is not supported; choose one of {_ARCHITECTURES}")
    if preset not in PRESETS:
        raise ValueError(f"preset={preset!r} is unknown; choose one of {sorted(PRESETS)}")
    unknown = set(shape) - {f.name for f in fields(TinyModelSpec)}
    if unknown:
        raise ValueError(f"unknown shape arguments {sorted(unknown)}; see TinyModelSpec")
    spec = replace(PRESETS[preset], **shape)
    _check_shape(spec)

    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(save_dir, model_max_length=spec.max_position_embeddings, **(tokenizer_kwargs or {}))
    config = AutoConfig.for_model(
        arch,
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        intermediate_size=spec.intermediate_size,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        initializer_range=spec.initializer_range,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        **config_kwargs,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = auto_class.from_config(config, dtype=torch.float32)
    if model.can_generate():
        model.generation_config = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    model.save_pretrained(str(save_dir))
    return save_dir


def _check_shape(spec: TinyModelSpec) -> None:
    if spec.hidden_size % spec.num_heads:
        raise ValueError(f"hidden_size={spec.hidden_size} is not divisible by num_heads={spec.num_heads}")
    if spec.num_heads % spec.num_kv_heads:
        raise ValueError(f"num_heads={spec.num_heads} is not divisible by num_kv_heads={spec.num_kv_heads}")
    head_dim = spec.hidden_size // spec.num_heads
    if head_dim not in VLLM_CPU_HEAD_SIZES:
        raise ValueError(
            f"head size hidden_size/num_heads = {head_dim} is not supported by vLLM on CPU; "
            f"pick hidden_size and num_heads so that it is one of {VLLM_CPU_HEAD_SIZES}"
        )
