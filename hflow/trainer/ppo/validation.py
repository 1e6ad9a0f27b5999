"""Validation of the PPO trainer's policy, and the JSON-lines dumps of samples it writes.

Every validation prompt is answered (`actor_rollout_ref.rollout.val_kwargs`: `n` samples each, greedy or
sampled) by the current policy and scored by the batch scorer's validation reward; the metrics are
`val-core/<data_source>/reward/...` and `val-aux/...` (see `metric_utils.process_validation_metrics`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from torch.utils.data import DataLoader

from hflow.protocol import DataProto
from hflow.trainer.ppo.metric_utils import format_validation_metrics, process_validation_metrics


def validate(config, tokenizer, val_dataset, collate_fn, rollouts, scorer, step: int) -> dict[str, float]:
    """Generate for every validation prompt with `rollouts` (the current policy), score with `scorer`;
    returns the validation metrics. Writes the samples to `trainer.validation_data_dir` when set and
    prints the first `trainer.log_val_generations`."""
    val_kwargs = config.actor_rollout_ref.rollout.val_kwargs
    data_sources, inputs, groups, outputs, scores = [], [], [], [], []
    extra_infos: dict[str, list] = {}
    size = config.data.val_batch_size or len(val_dataset)
    for batch_dict in DataLoader(val_dataset, batch_size=size, shuffle=False, drop_last=False, collate_fn=collate_fn):
        batch = DataProto.from_single_dict(batch_dict).repeat(val_kwargs.n, interleave=True)
        # A prompt's samples are grouped by its text; rows with images differ by their pictures (the text drops the
        # image tokens: a task that asks the same question of every picture would be one group), so those group by row.
        images = batch.non_tensor_batch.get("multi_modal_data", [None] * len(batch))
        pictured = [bool(data and data.get("image")) for data in images]
        batch = rollouts.generate(batch, do_sample=val_kwargs.do_sample, validate=True)
        batch_scores, extra = scorer.score_validation(batch)
        scores.extend(batch_scores)
        for key, values in extra.items():
            extra_infos.setdefault(key, []).extend(values)
        texts = tokenizer.batch_decode(batch.batch["prompts"], skip_special_tokens=True)
        inputs.extend(texts)
        first = len(groups) // val_kwargs.n  # this batch's first row
        groups += [f"{text}\x00row {first + i // val_kwargs.n}" if image else text
                   for i, (text, image) in enumerate(zip(texts, pictured, strict=True))]
        outputs.extend(tokenizer.batch_decode(batch.batch["responses"], skip_special_tokens=True))
        data_sources.extend(batch.non_tensor_batch.get("data_source", ["unknown"] * len(batch)))
    if config.trainer.validation_data_dir:
        write_jsonl(Path(config.trainer.validation_data_dir) / f"{step}.jsonl",
                    [{"input": i, "output": o, "score": s, "step": step} for i, o, s in zip(inputs, outputs, scores)])
    for i in range(min(config.trainer.log_val_generations, len(inputs))):
        print(f"[validation {i}] score={scores[i]:.3f}\n  prompt: {inputs[i]!r}\n  response: {outputs[i]!r}")
    infos = {"reward": scores, **{k: v for k, v in extra_infos.items() if len(v) == len(scores)}}
    return format_validation_metrics(process_validation_metrics(np.array(data_sources, dtype=object), groups, infos))


def dump_generations(tokenizer, batch: DataProto, path: Path, step: int) -> None:
    """A training step's samples (`trainer.rollout_data_dir`): prompt, response, score (and episode). With a
    distillation teacher, also the token ids as sampled (`prompt_ids`, `response_ids`: the attended ones) and
    the teacher's log-prob of each response token (`teacher_log_prob`), so what it scored can be checked."""
    inputs = tokenizer.batch_decode(batch.batch["prompts"], skip_special_tokens=True)
    outputs = tokenizer.batch_decode(batch.batch["responses"], skip_special_tokens=True)
    scores = batch.batch["token_level_scores"].sum(-1).tolist()
    rows = [{"input": i, "output": o, "score": s, "step": step} for i, o, s in zip(inputs, outputs, scores)]
    for row, episode in zip(rows, batch.non_tensor_batch.get("episode", [])):
        row["episode"] = episode  # multi-turn: each message and tool call, readable
    if "teacher_log_prob" in batch.batch.keys():
        attention, length = batch.batch["attention_mask"].bool(), batch.batch["responses"].shape[-1]
        for index, row in enumerate(rows):
            prompt, response = attention[index, :-length], attention[index, -length:]
            row["prompt_ids"] = batch.batch["prompts"][index][prompt].tolist()
            row["response_ids"] = batch.batch["responses"][index][response].tolist()
            row["teacher_log_prob"] = batch.batch["teacher_log_prob"][index][response].tolist()
    write_jsonl(path, rows)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
