"""The distillation signal, end to end on tiny models: the teacher worker's log-probs (the real worker, on a
local group of one rank) and the student's (the actor's log-prob entry point) of the sampled responses,
mixed by the trainer's function into token rewards, equal a hand computation -- a plain forward of each
model over the whole sequence, log_softmax(logits / T) at the sampled tokens, teacher minus student, zero
where the loss mask is 0 (left-padded prompts, tool tokens inside a multi-turn response, right padding) --
to 1e-6."""

import pytest
import torch
from omegaconf import OmegaConf

from hflow.algorithms.distill import generalized_jsd, mix_distillation_reward
from hflow.protocol import DataProto
from hflow.single_controller.base import ClassWithInitArgs
from hflow.tasks.tiny_models import build_causal_lm
from hflow.trainer.config import default_section

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    return (build_causal_lm(root / "student", preset="tiny", seed=0),
            build_causal_lm(root / "teacher", preset="tiny", seed=1))


def _batch(vocab: int) -> DataProto:
    """Three left-padded prompts of width 5 and responses of width 6; row 1 has two tool tokens in the
    middle of its response (mask 0, attention 1), row 2 ends early (right padding)."""
    gen = torch.Generator().manual_seed(0)
    prompt_len, response_len = 5, 6
    input_ids = torch.randint(3, vocab, (3, prompt_len + response_len), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :2] = 0  # left padding
    attention_mask[2, -2:] = 0  # a response that ended after 4 tokens
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    response_mask = attention_mask[:, prompt_len:].clone()
    response_mask[1, 2:4] = 0  # tool output: in the context, not sampled
    return DataProto.from_dict({"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
                                "responses": input_ids[:, prompt_len:].clone(), "response_mask": response_mask})


def _hand_log_probs(model_dir, batch: DataProto) -> torch.Tensor:
    """log pi(y_t | y_<t) / T at each response position, by a plain HF forward in float64."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=batch.batch["position_ids"]).logits
    response_len = batch.batch["responses"].shape[1]
    logits = logits[:, -response_len - 1:-1] / TEMPERATURE
    return torch.log_softmax(logits, -1).gather(-1, batch.batch["responses"][..., None])[..., 0]


def test_distillation_reward_equals_a_hand_computation(two_models):
    from hflow.single_controller.local import LocalWorkerGroup
    from hflow.workers.actor import DataParallelPPOActor
    from hflow.workers.teacher.worker import TeacherWorker
    from transformers import AutoModelForCausalLM

    student_dir, teacher_dir = two_models
    cfg = default_section("teacher")
    cfg.model.path = str(teacher_dir)
    cfg.log_prob_micro_batch_size_per_gpu = 2  # two micro-batches: rows come back in order
    cfg.temperature = TEMPERATURE
    vocab = AutoModelForCausalLM.from_pretrained(student_dir).config.vocab_size
    batch = _batch(vocab)

    group = LocalWorkerGroup(ClassWithInitArgs(TeacherWorker, config=cfg))
    try:
        group.call(TeacherWorker.init_model)
        teacher_log_prob = group.call(TeacherWorker.compute_teacher_log_prob, batch).batch["teacher_log_prob"]
    finally:
        group.shutdown()
    student = DataParallelPPOActor(OmegaConf.create({"use_remove_padding": False}),
                                   AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32))
    student_batch = DataProto.from_dict(dict(batch.batch.items()),
                                        meta_info={"temperature": TEMPERATURE, "micro_batch_size": 3})
    old_log_probs, _ = student.compute_log_prob(student_batch)

    mask = batch.batch["response_mask"]
    scores = torch.zeros_like(old_log_probs)
    scores[0, -1] = 1.0  # a task score on the last token: weighted out by task_reward_coef=0 below
    rewards, metrics = mix_distillation_reward(scores, teacher_log_prob, old_log_probs, mask, coef=0.5,
                                               task_reward_coef=0.0)

    expected = 0.5 * (_hand_log_probs(teacher_dir, batch) - _hand_log_probs(student_dir, batch)) * mask
    assert mask.sum() < mask.numel() and (expected[mask.bool()] != 0).all()  # the check could fail either way
    torch.testing.assert_close(rewards.double(), expected, atol=1e-6, rtol=0)
    assert metrics["distill/reverse_kl"] == pytest.approx(-(expected.sum() / 0.5 / mask.sum()).item(), abs=1e-6)
    # with the task's weight: its score adds on top, where it was placed
    mixed, _ = mix_distillation_reward(scores, teacher_log_prob, old_log_probs, mask, coef=0.5, task_reward_coef=2.0)
    torch.testing.assert_close(mixed - rewards, 2.0 * scores)


def test_generalized_jsd_limits_and_symmetry():
    gen = torch.Generator().manual_seed(0)
    p = torch.log_softmax(torch.randn(4, 7, generator=gen, dtype=torch.float64), -1)
    q = torch.log_softmax(torch.randn(4, 7, generator=gen, dtype=torch.float64), -1)
    # by hand: beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q
    beta = 0.3
    m = beta * p.exp() + (1 - beta) * q.exp()
    expected = beta * (p.exp() * (p - m.log())).sum(-1) + (1 - beta) * (q.exp() * (q - m.log())).sum(-1)
    torch.testing.assert_close(generalized_jsd(q, p, beta), expected)
    torch.testing.assert_close(generalized_jsd(q, p, 0.5), generalized_jsd(p, q, 0.5))  # the symmetric JSD
    assert torch.allclose(generalized_jsd(p, p, beta), torch.zeros(4, dtype=torch.float64), atol=1e-12)
    assert (generalized_jsd(q, p, beta) > 0).all()
    with pytest.raises(ValueError, match="0 < beta < 1"):
        generalized_jsd(q, p, 1.0)
