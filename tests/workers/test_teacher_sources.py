"""The teacher's kinds beside a model folder, each through the trainer's own call (`TeacherScorer`) and the real
teacher worker (a local group of one rank), against a plain float64 forward of each model, log_softmax(logits / T):

* `teacher.source=self` (OPSD): the policy scores the student's response tokens after the row's privileged
  prompt (here the answer); equal to a hand forward of the policy on [privileged prompt ids + the student's
  response ids], and different from the same policy's scores on the student's own prompt;
* `teacher.by_data_source`: rows of source A scored by teacher A, rows of B by teacher B (two different
  models), rows of a third source by none (zeros, `teacher_row_mask` 0).

The remote teacher (`teacher.url`, a local vLLM server) is in test_remote_teacher.py.
"""

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from hflow.protocol import DataProto
from hflow.tasks.assets import prompt_ids
from hflow.tasks.tiny_models import build_causal_lm
from hflow.trainer.config import default_config
from hflow.workers.teacher.config import resolve_teacher

TEMPERATURE = 0.7
QUESTIONS = ["What is 2 + 3?", "What is 7 + 1?", "What is 4 + 4?"]
ANSWERS = ["5", "8", "8"]
TEMPLATE = "{prompt}\nThe answer is {ground_truth}."


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("teachers")
    return {name: build_causal_lm(root / name, preset="tiny", seed=seed) for name, seed in (("policy", 0), ("a", 1),
                                                                                            ("b", 2))}


@pytest.fixture(scope="module")
def tokenizer(models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(models["policy"])


def student_batch(tokenizer, sources: list[str]) -> DataProto:
    """The rows as the trainer holds them after generation: left-padded student prompts, right-padded
    responses (row 2 ends early), the rows' fields as non-tensor columns."""
    prompts = [prompt_ids(tokenizer, q) for q in QUESTIONS]
    replies = [tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
               for text in ("The sum is 5", "It is 9 I think", "8")]
    width, length = max(map(len, prompts)), max(map(len, replies))
    pad = tokenizer.pad_token_id
    prompt_block = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    responses = torch.tensor([r + [pad] * (length - len(r)) for r in replies])
    attention = torch.cat([torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts]),
                           torch.tensor([[1] * len(r) + [0] * (length - len(r)) for r in replies])], dim=1)
    return DataProto.from_dict(
        {"input_ids": torch.cat([prompt_block, responses], 1), "attention_mask": attention,
         "position_ids": (attention.cumsum(-1) - 1).clamp(min=0), "responses": responses,
         "response_mask": attention[:, width:].clone()},
        non_tensors={"raw_prompt": objects([[{"role": "user", "content": q}] for q in QUESTIONS]),
                     "data_source": np.array(sources, dtype=object),
                     "reward_model": np.array([{"ground_truth": a} for a in ANSWERS], dtype=object),
                     "extra_info": np.array([{"index": i} for i in range(3)], dtype=object)})


def objects(values: list) -> np.ndarray:
    """A 1-D object array (numpy would make lists of equal length a 2-D one)."""
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        out[i] = value
    return out


def hand_log_probs(model_dir, prompt: list[int], response: list[int]) -> torch.Tensor:
    """log pi(y_t | prompt, y_<t) / T of each response token: one unpadded float64 forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1] / TEMPERATURE
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def teacher_config(models, **teacher):
    config = default_config()
    config.actor_rollout_ref.model.path = str(models["policy"])
    config.teacher.temperature = TEMPERATURE
    config.teacher.log_prob_micro_batch_size_per_gpu = 2  # two micro-batches: rows come back in order
    for key, value in teacher.items():
        OmegaConf.update(config.teacher, key, value, merge=True)
    resolve_teacher(config)
    return config


def score(config, tokenizer, batch: DataProto, topk: int = 0) -> DataProto:
    """The trainer's call: a teacher worker group (local backend) behind `TeacherScorer`."""
    from hflow.single_controller.base import ClassWithInitArgs
    from hflow.single_controller.local import LocalWorkerGroup
    from hflow.workers.teacher.scorer import TeacherScorer
    from hflow.workers.teacher.worker import TeacherWorker

    group = LocalWorkerGroup(ClassWithInitArgs(TeacherWorker, config=config.teacher))
    try:
        group.call(TeacherWorker.init_model)
        return TeacherScorer(config, tokenizer, group).score(batch, topk)
    finally:
        group.shutdown()


def sampled(batch: DataProto, row: int) -> list[int]:
    mask = batch.batch["response_mask"][row].bool()
    return batch.batch["responses"][row][mask].tolist()


def test_self_teacher_scores_the_students_tokens_after_the_privileged_prompt(models, tokenizer):
    batch = student_batch(tokenizer, ["hflow/arithmetic"] * 3)
    config = teacher_config(models, source="self", privileged_template=TEMPLATE)
    assert config.teacher.model.path == str(models["policy"]) and config.data.return_raw_chat  # resolved
    teacher = score(config, tokenizer, batch).batch["teacher_log_prob"]
    # the same policy on the student's own prompt: what a teacher without the privileged context would say
    plain = score(teacher_config(models, **{"model.path": str(models["policy"])}), tokenizer, batch)
    plain = plain.batch["teacher_log_prob"]
    mask = batch.batch["response_mask"].bool()
    for row, (question, answer) in enumerate(zip(QUESTIONS, ANSWERS)):
        privileged = prompt_ids(tokenizer, f"{question}\nThe answer is {answer}.")
        expected = hand_log_probs(models["policy"], privileged, sampled(batch, row))
        torch.testing.assert_close(teacher[row][mask[row]].double(), expected, atol=1e-5, rtol=0)
        without = hand_log_probs(models["policy"], prompt_ids(tokenizer, question), sampled(batch, row))
        torch.testing.assert_close(plain[row][mask[row]].double(), without, atol=1e-5, rtol=0)
    # the privileged context changes the scores (the check above could not pass with either prompt)
    assert (teacher - plain)[mask].abs().max() > 1e-2


def test_privileged_batch_keeps_the_response_ids_as_sampled(tokenizer):
    from hflow.workers.teacher.privileged import privileged_batch

    batch = student_batch(tokenizer, ["hflow/arithmetic"] * 3)
    inputs = privileged_batch(batch, tokenizer, ["ground_truth"])
    length = batch.batch["responses"].shape[1]
    assert torch.equal(inputs.batch["responses"], batch.batch["responses"])
    assert torch.equal(inputs.batch["input_ids"][:, -length:], batch.batch["responses"])
    assert torch.equal(inputs.batch["attention_mask"][:, -length:], batch.batch["attention_mask"][:, -length:])
    for row, (question, answer) in enumerate(zip(QUESTIONS, ANSWERS)):  # a list of fields: appended, one a line
        prompt = inputs.batch["input_ids"][row, :-length][inputs.batch["attention_mask"][row, :-length].bool()]
        assert prompt.tolist() == prompt_ids(tokenizer, f"{question}\n{answer}")


def test_each_data_source_is_scored_by_its_own_teacher(models, tokenizer):
    batch = student_batch(tokenizer, ["src/a", "src/b", "src/none"])
    config = teacher_config(models, by_data_source={"src/a": {"model": {"path": str(models["a"])}},
                                                    "src/b": {"model": {"path": str(models["b"])}}})
    out = score(config, tokenizer, batch, topk=4)
    teacher, row_mask = out.batch["teacher_log_prob"], out.batch["teacher_row_mask"]
    assert row_mask.tolist() == [1.0, 1.0, 0.0]
    mask = batch.batch["response_mask"].bool()
    prompts = [prompt_ids(tokenizer, q) for q in QUESTIONS]
    for row, name in ((0, "a"), (1, "b")):
        expected = hand_log_probs(models[name], prompts[row], sampled(batch, row))
        torch.testing.assert_close(teacher[row][mask[row]].double(), expected, atol=1e-5, rtol=0)
        other = hand_log_probs(models["b" if name == "a" else "a"], prompts[row], sampled(batch, row))
        assert (expected - other).abs().max() > 1e-2  # the two teachers do differ
    assert (teacher[2] == 0).all() and (out.batch["teacher_topk_log_probs"][2] == 0).all()
    assert (out.batch["teacher_topk_log_probs"][:2][mask[:2]] < 0).all()  # top-k came back for scored rows


def test_rows_without_a_teacher_get_no_distillation_reward(models, tokenizer):
    """The trainer's mask: `teacher_row_mask` 0 takes a row out of the reverse-KL reward and its metrics."""
    from hflow.algorithms.distill import mix_distillation_reward

    batch = student_batch(tokenizer, ["src/a", "src/none", "src/none"])
    config = teacher_config(models, by_data_source={"src/a": {"model": {"path": str(models["a"])}}})
    out = score(config, tokenizer, batch)
    mask = batch.batch["response_mask"] * out.batch["teacher_row_mask"][:, None]
    student = torch.full(mask.shape, -3.0)
    rewards, _ = mix_distillation_reward(torch.zeros(mask.shape), out.batch["teacher_log_prob"], student, mask,
                                         coef=1.0, task_reward_coef=0.0)
    assert (rewards[1:] == 0).all() and (rewards[0][mask[0].bool()] != 0).all()
