"""`TeacherScorer`: the trainer's one call for the teacher's columns of a batch, whatever the teacher is.

* `teacher.model.path`: the teacher worker scores the batch as it is.
* `teacher.source=self` (OPSD): the worker holds the policy's starting weights (frozen, like the reference
  policy) and scores the student's responses after the row's privileged prompt (`privileged_batch`).
* `teacher.by_data_source`: each data source's rows in a call of their own to the worker's model for that
  source (every rank must run the same model's forward); rows of a source without a teacher get zeros and
  `teacher_row_mask` 0, which takes them out of both distillation terms.
* `teacher.url`: the server scores the batch (`RemoteTeacher`); no worker.
"""

from __future__ import annotations

from typing import Any

import torch

from hflow.protocol import DataProto
from hflow.workers.teacher.privileged import privileged_batch, rows_of
from hflow.workers.teacher.remote import RemoteTeacher, check_remote_teacher

__all__ = ["TeacherScorer"]


class TeacherScorer:
    def __init__(self, config: Any, tokenizer, group=None):
        self.teacher = config.teacher
        self.tokenizer = tokenizer
        self.chat_template = config.data.get("chat_template")
        self.group = group  # the teacher worker group (None with teacher.url)
        self.remote = None
        if self.teacher.url is not None:
            topk = int(self.teacher.topk) if float(config.algorithm.distill.jsd_coef) > 0 else 0
            self.remote = RemoteTeacher(self.teacher, check_remote_teacher(self.teacher, tokenizer, topk))

    def score(self, batch: DataProto, topk: int) -> DataProto:
        """`teacher_log_prob` (B, L) of the sampled responses; with `topk` > 0 also `teacher_topk_ids` and
        `teacher_topk_log_probs` (B, L, k); with `teacher.by_data_source` also `teacher_row_mask` (B,)."""
        if self.remote is not None:
            return self.remote.score(batch, topk)
        inputs = batch
        if self.teacher.source == "self":
            inputs = privileged_batch(batch, self.tokenizer, self.teacher.privileged_template, self.chat_template)
        if not self.teacher.by_data_source:
            return self._call(inputs, topk, "")
        responses = batch.batch["responses"]
        columns = {"teacher_log_prob": torch.zeros(responses.shape), "teacher_row_mask": torch.zeros(len(batch))}
        if topk > 0:
            columns["teacher_topk_ids"] = torch.zeros(*responses.shape, topk, dtype=torch.int32)
            columns["teacher_topk_log_probs"] = torch.zeros(*responses.shape, topk)
        sources = batch.non_tensor_batch["data_source"]
        for name in self.teacher.by_data_source:
            rows = rows_of(sources, str(name))
            if len(rows) == 0:
                continue
            scored = self._call(inputs.select_idxs(rows), topk, str(name))
            index = torch.as_tensor(rows)
            for key, value in scored.batch.items():
                columns[key][index] = value.to(columns[key].dtype)
            columns["teacher_row_mask"][index] = 1.0
        return DataProto.from_dict(columns)

    def _call(self, inputs: DataProto, topk: int, name: str) -> DataProto:
        from hflow.workers.teacher.worker import TeacherWorker

        inputs.meta_info.update(topk=topk, teacher=name)
        return self.group.call(TeacherWorker.compute_teacher_log_prob, inputs)
