"""`teacher`: the distillation teacher's section (typed defaults; comments in `config/ppo_trainer.yaml`), its
checks before Ray starts, and its per-rank normalisation in the worker.

The teacher is any Hugging Face causal LM that shares the student's tokenizer: it scores the student's
token ids as they are, so the two vocabularies must map the same text to the same ids (`check_teacher_vocab`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf

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
    # model: the folder at model.path (or a server at url); self: the policy's own starting weights (OPSD),
    # shown the row's privileged context, frozen like the reference policy
    source: str = "model"
    privileged_template: Any = None  # source=self: "{prompt}... {ground_truth}" or a list of row fields appended
    by_data_source: dict[str, Any] = field(default_factory=dict)  # {data_source: {model: {path: ...}}}
    required: bool = False  # with by_data_source: every data source in the training data must have a teacher
    url: Optional[str] = None  # an OpenAI-compatible server (vllm serve) scoring by prompt log-probs
    url_model: Optional[str] = None  # the model name the server serves; None = the first of its /v1/models
    url_timeout_s: float = 10.0  # the preflight probe's (and each scoring request's connect) timeout


TEACHER_SOURCES = ("model", "self")
MODEL_KEYS = frozenset(f.name for f in fields(TeacherModelConfig))


def uses_teacher(config: Any) -> bool:
    """Whether the run distils from a teacher of any kind (a folder, the policy itself, per data source, a URL)."""
    teacher = config.teacher
    return (teacher.model.path is not None or teacher.source == "self" or bool(teacher.by_data_source)
            or teacher.url is not None)


def resolve_teacher(config: Any) -> None:
    """`teacher.source=self`: the teacher's folder is the policy's own (its starting weights, loaded frozen by
    the teacher worker like the reference policy), so the teacher's machinery and memory plan see a model."""
    if config.teacher.source == "self":
        if config.teacher.model.path is None:
            config.teacher.model.path = config.actor_rollout_ref.model.path
        config.data.return_raw_chat = True  # the privileged prompt is built from the row's messages


def teacher_models(teacher: Any) -> dict[str, Any]:
    """{name: model section} of the local teachers: "" for `teacher.model`, else one per
    `teacher.by_data_source` entry (its `model` keys over `teacher.model`'s)."""
    if teacher.by_data_source:
        return {str(name): OmegaConf.merge(teacher.model, entry.get("model") or {})
                for name, entry in teacher.by_data_source.items()}
    return {"": teacher.model} if teacher.model.path is not None else {}


def teacher_kinds(config: Any) -> list[str]:
    """The keys that name a teacher, as the user set them (more than one is refused)."""
    teacher = config.teacher
    own = teacher.source == "self"
    return [key for key, on in (("teacher.source=self", own),
                                ("teacher.model.path", teacher.model.path is not None and not own),
                                ("teacher.by_data_source", bool(teacher.by_data_source)),
                                ("teacher.url", teacher.url is not None)) if on]


def check_teacher(config: Any) -> None:
    """Before Ray starts: a distillation weight needs a teacher, a teacher needs a distillation weight (it
    would load for nothing), one kind of teacher at a time, and the teacher's folders, tokenizer, batch,
    top-k, template, URL and offload settings are usable."""
    teacher, distill = config.teacher, config.algorithm.distill
    weights = {"algorithm.distill.coef": float(distill.coef), "algorithm.distill.jsd_coef": float(distill.jsd_coef)}
    check_positive(teacher.topk, "teacher.topk")
    if teacher.source not in TEACHER_SOURCES:
        raise ConfigError(f"teacher.source={teacher.source} is unknown; choose one of {', '.join(TEACHER_SOURCES)}")
    policy = config.actor_rollout_ref.model.path
    if teacher.source == "self" and teacher.model.path not in (None, policy):
        raise ConfigError(f"teacher.source=self scores with the policy's own weights, but teacher.model.path="
                          f"{teacher.model.path} names another model; set teacher.model.path=null, or "
                          "teacher.source=model to distil from that folder")
    kinds = teacher_kinds(config)
    if len(kinds) > 1:
        raise ConfigError(f"{kinds[0]} and {kinds[1]} both name the teacher; keep one of them")
    if not kinds:
        for key, weight in weights.items():
            if weight > 0:
                raise ConfigError(f"{key}={weight:g} distils from a teacher, but teacher.model.path is null (and no "
                                  "teacher.source=self, teacher.by_data_source or teacher.url is set); set it to a "
                                  "Hugging Face causal LM folder that shares the student's tokenizer, or set "
                                  f"{key}=0")
        return
    if not any(weights.values()):
        named = {"teacher.model.path": f"teacher.model.path={teacher.model.path}", "teacher.url": f"teacher.url={teacher.url}"}
        raise ConfigError(f"{named.get(kinds[0], kinds[0])} is set but algorithm.distill.coef=0 and algorithm.distill.jsd_coef=0, so "
                          f"nothing uses the teacher; set one of them > 0, or unset {kinds[0].split('=')[0]}")
    check_privileged_template(teacher)
    if teacher.source == "self" and config.actor_rollout_ref.rollout.multi_turn.enable:
        raise ConfigError("teacher.source=self rebuilds each prompt with the privileged context, without the tools' "
                          "schemas that multi-turn prompts carry, so the teacher would read another prompt than "
                          "the one it should; set actor_rollout_ref.rollout.multi_turn.enable=false, or use "
                          "teacher.source=model")
    if teacher.url is not None:
        check_url_settings(teacher)
    for name, entry in teacher.by_data_source.items():
        check_source_entry(name, entry)
    for name, model in teacher_models(teacher).items():
        prefix = f"teacher.by_data_source.{name}.model" if name else "teacher.model"
        check_model_path(model.path, f"{prefix}.path")
        check_teacher_head(model.path, f"{prefix}.path")
        check_tokenizer_path(model, prefix)
    if not teacher.log_prob_use_dynamic_bsz:
        check_positive(teacher.log_prob_micro_batch_size_per_gpu, "teacher.log_prob_micro_batch_size_per_gpu")
    else:
        check_positive(teacher.log_prob_max_token_len_per_gpu, "teacher.log_prob_max_token_len_per_gpu")
    check_offload(teacher.fsdp_config, "teacher.fsdp_config")
    if float(distill.jsd_coef) > 0 and config.actor_rollout_ref.model.get("fused_lm_head"):
        raise ConfigError("algorithm.distill.jsd_coef > 0 compares the student's distribution with the teacher's, "
                          "which needs the student's logits, and actor_rollout_ref.model.fused_lm_head=true never "
                          "builds them; set fused_lm_head=false, or algorithm.distill.jsd_coef=0")


def check_privileged_template(teacher: Any) -> None:
    """`teacher.privileged_template`: a non-empty string or list of row fields with source=self, else unset."""
    template = teacher.privileged_template
    if teacher.source != "self":
        if template is not None:
            raise ConfigError("teacher.privileged_template is read only with teacher.source=self (the policy as its "
                              "own teacher); set teacher.source=self, or teacher.privileged_template=null")
        return
    if isinstance(template, str) and template.strip():
        return
    if isinstance(template, (list, ListConfig)) and template and all(isinstance(f, str) and f for f in template):
        return
    raise ConfigError(f"teacher.privileged_template={template} must be a non-empty string with row fields (e.g. "
                      "\"{prompt} The answer is {ground_truth}.\") or a list of row fields (e.g. [ground_truth]); "
                      "teacher.source=self shows the policy that context beside the student's prompt")


def check_url_settings(teacher: Any) -> None:
    """`teacher.url`: http(s), a positive timeout, and temperature 1 (a server's prompt log-probs are of the
    raw logits: it applies no temperature to them)."""
    if not str(teacher.url).startswith(("http://", "https://")):
        raise ConfigError(f"teacher.url={teacher.url} must start with http:// or https:// (an OpenAI-compatible "
                          "server such as `vllm serve`, e.g. http://host:8000)")
    if not float(teacher.url_timeout_s) > 0:
        raise ConfigError(f"teacher.url_timeout_s={teacher.url_timeout_s} must be > 0 (seconds)")
    if float(teacher.temperature) != 1.0:
        raise ConfigError(f"teacher.url scores with the server's prompt log-probs, which are at temperature 1, but "
                          f"teacher.temperature={teacher.temperature}; set teacher.temperature=1.0 (and sample at "
                          "actor_rollout_ref.rollout.temperature=1.0, which it follows by default)")


def check_source_entry(name: Any, entry: Any) -> None:
    """One `teacher.by_data_source` entry: `{model: {path: ..., <teacher.model keys>}}`."""
    key = f"teacher.by_data_source.{name}"
    if not isinstance(entry, (dict, DictConfig)) or set(entry.keys()) != {"model"}:
        raise ConfigError(f"{key} must be {{model: {{path: <folder>}}}} (the teacher of rows whose data_source is "
                          f"{name!r}), got {entry}")
    model = entry.model
    unknown = sorted(set(model.keys()) - MODEL_KEYS) if isinstance(model, (dict, DictConfig)) else ["(not a mapping)"]
    if unknown:
        raise ConfigError(f"{key}.model has unknown key {unknown[0]}; its keys are those of teacher.model "
                          f"({', '.join(sorted(MODEL_KEYS))})")


# Heads that score text instead of predicting the next token. Loaded as a causal LM, such a folder gets a
# freshly initialised LM head (transformers only warns), and the student is distilled towards its noise.
SCORE_HEADS = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering")


def check_teacher_head(path: Any, key: str = "teacher.model.path") -> None:
    """The teacher's folder is a causal LM, not a reward or value model (read from its config.json)."""
    architectures = json.loads((Path(str(path)).expanduser() / "config.json").read_text()).get("architectures") or []
    scorers = [str(name) for name in architectures if str(name).endswith(SCORE_HEADS)]
    if scorers:
        raise ConfigError(f"{key}={path} is a {scorers[0]} (a reward or value model: a score head, no "
                          "language-model head); loaded as the teacher its LM head would be random and the student "
                          f"would be distilled towards noise. Point {key} at a causal LM "
                          "(*ForCausalLM) that shares the student's tokenizer")


def check_teacher_vocab(config: Any) -> None:
    """The teacher reads the student's token ids: both tokenizers must map every token to the same id, and
    the teacher's embedding must have a row for each of them (each local teacher). Loads the tokenizers (no model)."""
    from transformers import AutoConfig

    student = config.actor_rollout_ref.model
    student_name = str(student.tokenizer_path or student.path)
    student_vocab = load_vocab(student, student_name, "student")
    for name, teacher in teacher_models(config.teacher).items():
        key = f"teacher.by_data_source.{name}.model.path" if name else "teacher.model.path"
        teacher_name = str(teacher.tokenizer_path or teacher.path)
        teacher_vocab = load_vocab(teacher, teacher_name, "teacher")
        if student_vocab != teacher_vocab:
            differ = sorted(set(student_vocab.items()) ^ set(teacher_vocab.items()), key=str)[:3]
            raise ConfigError(
                f"the teacher ({teacher_name}, {len(teacher_vocab)} tokens) and the student "
                f"({student_name}, {len(student_vocab)} tokens) have different vocabularies (e.g. "
                f"{', '.join(f'{tok!r}: {idx}' for tok, idx in differ)}); the teacher scores the student's token "
                f"ids, so {key} must be a model with the student's tokenizer")
        rows = AutoConfig.from_pretrained(str(teacher.path), trust_remote_code=bool(teacher.trust_remote_code))
        rows = int(rows.get_text_config().vocab_size)
        needed = max(student_vocab.values()) + 1
        if int(config.teacher.topk) > rows:
            raise ConfigError(f"teacher.topk={config.teacher.topk} is more than the teacher's {rows} tokens; set it "
                              f"to at most {rows}")
        if rows < needed:
            raise ConfigError(f"{key}={teacher.path} has {rows} embedding rows but the student's tokenizer "
                              f"({student_name}) uses ids up to {needed - 1}; use a teacher with the student's "
                              "vocabulary")


def load_vocab(model: Any, name: str, who: str) -> dict[str, int]:
    """The token -> id map of a model section's tokenizer (at `name`)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name, trust_remote_code=bool(model.trust_remote_code)).get_vocab()
    except (OSError, ValueError) as err:
        raise ConfigError(f"the {who}'s tokenizer does not load from {name}: {err}") from None


def normalize_teacher(config: DictConfig) -> DictConfig:
    """The worker's copy of the section, checked again where it runs."""
    cfg = resolved_copy(config)
    models = teacher_models(cfg)
    if not models:
        raise ConfigError("the teacher worker has no model: set teacher.model.path (or teacher.by_data_source)")
    for name, model in models.items():
        check_model_path(model.path, f"teacher.by_data_source.{name}.model.path" if name else "teacher.model.path")
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
