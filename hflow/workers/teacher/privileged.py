"""Self-distillation (OPSD, `teacher.source=self`): the teacher is the policy shown context the student's
prompt lacks (the ground truth, a hint, a worked solution), scoring the student's own response tokens.

* `privileged_text`: the teacher's user message for one row, from `teacher.privileged_template` (a format
  string over the row's fields, or a list of fields appended to the prompt on lines of their own).
* `privileged_batch`: the teacher's input for a batch: per row the privileged prompt, rendered with the chat
  template and tokenized as the dataset tokenizes prompts, left-padded, followed by the student's response
  block exactly as sampled (the same ids, the same right padding; never decoded and re-encoded). The teacher's
  log-probs then come out at the student's response positions, aligned token for token.
* `check_teacher_data`: preflight's pass over the training rows: every field the template names exists in
  every row, and (`teacher.by_data_source`) the teachers' sources match the data's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hflow.config_schema import ConfigError
from hflow.protocol import DataProto
from hflow.utils.errors import DataError

__all__ = ["check_teacher_data", "privileged_batch", "privileged_text", "row_fields"]


def row_fields(row: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The names a template may use: `prompt` (the last user message's text), `ground_truth`
    (`reward_model.ground_truth`), the row's other columns (`data_source`, `ability`, `extra_info`, ...)
    and the keys of `extra_info` (a column of the same name wins)."""
    extra = row.get("extra_info")
    fields = {**(extra if isinstance(extra, dict) else {}), **row}
    reward_model = row.get("reward_model")
    if isinstance(reward_model, dict) and "ground_truth" in reward_model:
        fields["ground_truth"] = reward_model["ground_truth"]
    fields["prompt"] = next((m.get("content") for m in reversed(messages) if m.get("role") == "user"), "")
    return fields


def privileged_text(template: Any, fields: dict[str, Any], where: str) -> str:
    """The teacher's user message: `template.format(**fields)`, or (a list of field names) the prompt with
    each field's value on a line of its own. A field the row lacks: DataError naming it and `where`."""
    try:
        if isinstance(template, str):
            return template.format_map(fields)
        return "\n".join([str(fields["prompt"]), *(str(fields[name]) for name in template)])
    except KeyError as err:
        raise DataError(f"{where} has no field {err.args[0]!r}, which teacher.privileged_template={template} names "
                        f"(the row has: {', '.join(sorted(map(str, fields)))}); add it to every row (or to its "
                        "extra_info), or change teacher.privileged_template") from None


def privileged_messages(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """`messages` with the last user message's content replaced by `text` (system and earlier turns kept)."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    if last is None:
        return [*messages, {"role": "user", "content": text}]
    return [*messages[:last], {**messages[last], "content": text}, *messages[last + 1:]]


def encode_prompt(tokenizer, messages: list[dict[str, Any]], chat_template: str | None) -> list[int]:
    """As `RLHFDataset` encodes a prompt: the chat template's text (generation prompt on), then its ids."""
    kwargs = {"chat_template": chat_template} if chat_template else {}
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def privileged_batch(batch: DataProto, tokenizer, template: Any, chat_template: str | None = None) -> DataProto:
    """The teacher's input ids for `batch` (needs its `raw_prompt` messages: the trainer turns on
    `data.return_raw_chat`): privileged prompt ids (left-padded to the longest) + the student's `responses`
    as they are, with their attention; `responses` itself is passed on unchanged, so the teacher's
    log-probs are those of the student's tokens at the student's response positions."""
    responses = batch.batch["responses"]
    response_attention = batch.batch["attention_mask"][:, -responses.shape[1]:]
    rows = batch.non_tensor_batch
    prompts = []
    for i in range(len(batch)):
        messages = list(rows["raw_prompt"][i])
        row = {key: values[i] for key, values in rows.items() if key != "raw_prompt"}
        text = privileged_text(template, row_fields(row, messages), f"batch row {i} (index {row.get('index')})")
        prompts.append(encode_prompt(tokenizer, privileged_messages(messages, text), chat_template))
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    prompt_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], dtype=responses.dtype)
    prompt_attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                                    dtype=response_attention.dtype)
    attention_mask = torch.cat([prompt_attention, response_attention], dim=1)
    return DataProto.from_dict({
        "input_ids": torch.cat([prompt_ids, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": responses,
    })


def check_teacher_data(config: Any) -> None:
    """Before Ray starts, over the training files: with `teacher.source=self`, every row has each field the
    privileged template names (DataError naming the file, row and field); with `teacher.by_data_source`,
    each key is a data source of the data (a typo would silently leave its rows without a teacher), and with
    `teacher.required=true` each data source of the data has a teacher."""
    from hflow.utils.dataset.sources import describe_row, read_table, resolve_files, split_for

    teacher, data = config.teacher, config.data
    if teacher.source != "self" and not teacher.by_data_source:
        return
    seen: set[str] = set()
    split, _ = split_for(data, "data.train_files")
    for path in resolve_files(data.train_files, "data.train_files"):
        table = read_table(path, "data.train_files", split=split)  # parquet, JSONL or a saved dataset
        if data.reward_fn_key in table.column_names:
            seen.update(map(str, table.column(data.reward_fn_key).to_pylist()))
        if teacher.source != "self":
            continue
        for index, row in enumerate(table.to_pylist()):
            messages = row.pop(data.prompt_key, None) or []
            privileged_text(teacher.privileged_template, row_fields(row, list(messages)),
                            f"data.train_files: {describe_row(path, index)}")
    if teacher.by_data_source:
        keys = set(map(str, teacher.by_data_source))
        unknown = sorted(keys - seen)
        if unknown:
            raise ConfigError(f"teacher.by_data_source.{unknown[0]} names a data source that no training row has "
                              f"(the data's: {', '.join(sorted(seen))}); fix the key, or remove the entry")
        missing = sorted(seen - keys)
        if teacher.required and missing:
            raise ConfigError(f"teacher.required=true, but data_source {missing[0]!r} of the training data has no "
                              "teacher in teacher.by_data_source; add one for it, or set teacher.required=false "
                              "(its rows then get no distillation term)")


def rows_of(sources: np.ndarray, name: str) -> np.ndarray:
    """The batch indices whose data source is `name`."""
    return np.flatnonzero(np.asarray([str(s) == name for s in sources]))
