"""`teacher`: the distillation teacher's section (typed defaults; comments in `config/ppo_trainer.yaml`), its
checks before Ray starts, and its per-rank normalisation in the worker.

The teacher is any Hugging Face causal LM that shares the student's tokenizer: it scores the student's
token ids as they are, so the two vocabularies must map the same text to the same ids (`check_teacher_vocab`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig

from hflow.config_schema import ConfigError, check_positive, ref
from hflow.utils import device
from hflow.workers.config import (CPU_TOKEN_BUDGET, check_model_path, check_offload, check_tokenizer_path,
                                  resolved_copy)


@dataclass
class TeacherModelConfig:
    path: Optional[str] = None  # None = no teacher
    tokenizer_path: Optional[str] = None  # None = path
    override_config: dict[str, Any] = field(default_factory=dict)
    trust_remote_code: bool = False
    attn_implementation: Optional[str] = ref("actor_rollout_ref.model.attn_implementation")
    use_remove_padding: Optional[bool] = ref("actor_rollout_ref.model.use_remove_padding")  # None = by device


@dataclass
class TeacherFSDPConfig:
    param_offload: bool = True  # used once per step: its shards wait in host memory between uses
    offload_policy: bool = False
    reshard_after_forward: bool = True
    gather_once_per_pass: Optional[bool] = None  # None = by model size and device memory


@dataclass
class TeacherConfig:
    model: TeacherModelConfig = field(default_factory=TeacherModelConfig)
    log_prob_micro_batch_size_per_gpu: int = 16
    log_prob_use_dynamic_bsz: Optional[bool] = ref("actor_rollout_ref.actor.use_dynamic_bsz")  # None = by device
    log_prob_max_token_len_per_gpu: Optional[int] = ref("actor_rollout_ref.actor.ppo_max_token_len_per_gpu")
    temperature: float = ref("actor_rollout_ref.rollout.temperature")
    topk: int = 16  # tokens of the teacher's distribution per position kept for the JSD term (algorithm.distill.jsd_coef)
    fsdp_config: TeacherFSDPConfig = field(default_factory=TeacherFSDPConfig)


def check_teacher(config: Any) -> None:
    """Before Ray starts: a distillation weight needs a teacher, a teacher needs a distillation weight (it
    would load for nothing), and the teacher's folder, tokenizer, batch, top-k and offload settings are usable."""
    teacher, distill = config.teacher, config.algorithm.distill
    weights = {"algorithm.distill.coef": float(distill.coef), "algorithm.distill.jsd_coef": float(distill.jsd_coef)}
    check_positive(teacher.topk, "teacher.topk")
    if teacher.model.path is None:
        for key, weight in weights.items():
            if weight > 0:
                raise ConfigError(f"{key}={weight:g} distils from a teacher, but teacher.model.path is null; set it "
                                  "to a Hugging Face causal LM folder that shares the student's tokenizer, or set "
                                  f"{key}=0")
        return
    if not any(weights.values()):
        raise ConfigError(f"teacher.model.path={teacher.model.path} is set but algorithm.distill.coef=0 and "
                          "algorithm.distill.jsd_coef=0, so nothing uses the teacher; set one of them > 0, or "
                          "teacher.model.path=null")
    check_model_path(teacher.model.path, "teacher.model.path")
    check_teacher_head(teacher.model.path)
    check_tokenizer_path(teacher.model, "teacher.model")
    if not teacher.log_prob_use_dynamic_bsz:
        check_positive(teacher.log_prob_micro_batch_size_per_gpu, "teacher.log_prob_micro_batch_size_per_gpu")
    else:
        check_positive(teacher.log_prob_max_token_len_per_gpu, "teacher.log_prob_max_token_len_per_gpu")
    check_offload(teacher.fsdp_config, "teacher.fsdp_config")
    if float(distill.jsd_coef) > 0 and config.actor_rollout_ref.model.get("fused_lm_head"):
        raise ConfigError("algorithm.distill.jsd_coef > 0 compares the student's distribution with the teacher's, "
                          "which needs the student's logits, and actor_rollout_ref.model.fused_lm_head=true never "
                          "builds them; set fused_lm_head=false, or algorithm.distill.jsd_coef=0")


# Heads that score text instead of predicting the next token. Loaded as a causal LM, such a folder gets a
# freshly initialised LM head (transformers only warns), and the student is distilled towards its noise.
SCORE_HEADS = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering")


def check_teacher_head(path: Any) -> None:
    """The teacher's folder is a causal LM, not a reward or value model (read from its config.json)."""
    architectures = json.loads((Path(str(path)).expanduser() / "config.json").read_text()).get("architectures") or []
    scorers = [str(name) for name in architectures if str(name).endswith(SCORE_HEADS)]
    if scorers:
        raise ConfigError(f"teacher.model.path={path} is a {scorers[0]} (a reward or value model: a score head, no "
                          "language-model head); loaded as the teacher its LM head would be random and the student "
                          "would be distilled towards noise. Point teacher.model.path at a causal LM "
                          "(*ForCausalLM) that shares the student's tokenizer")


def check_teacher_vocab(config: Any) -> None:
    """The teacher reads the student's token ids: both tokenizers must map every token to the same id, and
    the teacher's embedding must have a row for each of them. Loads the two tokenizers (no model)."""
    from transformers import AutoConfig, AutoTokenizer

    student, teacher = config.actor_rollout_ref.model, config.teacher.model
    names = {"student": str(student.tokenizer_path or student.path), "teacher": str(teacher.tokenizer_path or teacher.path)}
    vocabs = {}
    for who, model in (("student", student), ("teacher", teacher)):
        try:
            tokenizer = AutoTokenizer.from_pretrained(names[who], trust_remote_code=bool(model.trust_remote_code))
        except (OSError, ValueError) as err:
            raise ConfigError(f"the {who}'s tokenizer does not load from {names[who]}: {err}") from None
        vocabs[who] = tokenizer.get_vocab()
    if vocabs["student"] != vocabs["teacher"]:
        differ = sorted(set(vocabs["student"].items()) ^ set(vocabs["teacher"].items()), key=str)[:3]
        raise ConfigError(
            f"the teacher ({names['teacher']}, {len(vocabs['teacher'])} tokens) and the student "
            f"({names['student']}, {len(vocabs['student'])} tokens) have different vocabularies (e.g. "
            f"{', '.join(f'{tok!r}: {idx}' for tok, idx in differ)}); the teacher scores the student's token ids, so "
            "teacher.model.path must be a model with the student's tokenizer")
    rows = AutoConfig.from_pretrained(str(teacher.path), trust_remote_code=bool(teacher.trust_remote_code))
    rows = int(rows.get_text_config().vocab_size)
    needed = max(vocabs["student"].values()) + 1
    if int(config.teacher.topk) > rows:
        raise ConfigError(f"teacher.topk={config.teacher.topk} is more than the teacher's {rows} tokens; set it "
                          f"to at most {rows}")
    if rows < needed:
        raise ConfigError(f"teacher.model.path={teacher.path} has {rows} embedding rows but the student's tokenizer "
                          f"({names['student']}) uses ids up to {needed - 1}; use a teacher with the student's vocabulary")


def normalize_teacher(config: DictConfig) -> DictConfig:
    """The worker's copy of the section, checked again where it runs."""
    cfg = resolved_copy(config)
    check_model_path(cfg.model.path, "teacher.model.path")
    # the student's keys left to the device (the trainer resolves them at start; a caller of its own may not)
    if cfg.model.use_remove_padding is None:
        cfg.model.use_remove_padding = device.is_cuda()
    if cfg.log_prob_use_dynamic_bsz is None:
        cfg.log_prob_use_dynamic_bsz = device.is_cuda()
    if cfg.log_prob_max_token_len_per_gpu is None:
        cfg.log_prob_max_token_len_per_gpu = CPU_TOKEN_BUDGET
    if not cfg.log_prob_use_dynamic_bsz:
        check_positive(cfg.log_prob_micro_batch_size_per_gpu, "teacher.log_prob_micro_batch_size_per_gpu")
    check_offload(cfg.fsdp_config, "teacher.fsdp_config")
    # where DataParallelPPOActor reads it
    cfg.use_remove_padding = bool(cfg.model.use_remove_padding)
    return cfg
