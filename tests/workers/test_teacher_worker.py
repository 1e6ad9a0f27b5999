"""The distillation signals, end to end on tiny models, against a hand computation (a plain float64 forward of
each model over the whole sequence, log_softmax(logits / T)), to 1e-6:

* the reverse-KL reward: the teacher worker's log-probs (the real worker, on a local group of one rank) and
  the student's (the actor's log-prob entry point) of the sampled responses, mixed by the trainer's function
  into token rewards: teacher minus student, zero where the loss mask is 0 (left-padded prompts, tool tokens
  inside a multi-turn response, right padding);
* the GKD term (`algorithm.distill.jsd_coef`): the teacher worker's top-k ids and log-probs, and the JSD the
  actor's update adds to its loss (its reported value, and the parameter change it makes), padded and packed,
  over two micro-batches."""

import pytest
import torch
from omegaconf import OmegaConf

from hflow.algorithms.distill import generalized_jsd, mix_distillation_reward
from hflow.protocol import DataProto
from hflow.single_controller.base import ClassWithInitArgs
from hflow.tasks.tiny_models import build_causal_lm
from hflow.trainer.config import default_config, default_section
from hflow.workers.config import resolved_copy

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
    # the ends, read as GKD does: forward KL(teacher || student) at 0, reverse KL(student || teacher) at 1
    torch.testing.assert_close(generalized_jsd(q, p, 0.0), (p.exp() * (p - q)).sum(-1))
    torch.testing.assert_close(generalized_jsd(q, p, 1.0), (q.exp() * (q - p)).sum(-1))
    with pytest.raises(ValueError, match="0 <= beta <= 1"):
        generalized_jsd(q, p, 1.5)


TOPK, BETA, LR = 5, 0.3, 1.0


def _hand_logits(model_dir, batch: DataProto, grad: bool = False):
    """(model in float64, the response positions' logits / T (B, L, V)) by a plain HF forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    with torch.set_grad_enabled(grad):
        logits = model(input_ids=batch.batch["input_ids"], attention_mask=batch.batch["attention_mask"],
                       position_ids=batch.batch["position_ids"]).logits
    response_len = batch.batch["responses"].shape[1]
    return model, logits[:, -response_len - 1:-1] / TEMPERATURE


def _hand_jsd(student_logits, teacher_logits, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """(token-mean JSD over the mask, the teacher's top-k ids): the generalized JSD written out on
    probabilities, over the teacher's top-k tokens and one bucket holding the rest of each distribution."""
    teacher_p = torch.softmax(teacher_logits, -1)
    top_p, ids = teacher_p.topk(TOPK, -1)
    student_p = torch.softmax(student_logits, -1).gather(-1, ids)
    t = torch.cat([top_p, 1 - top_p.sum(-1, keepdim=True)], -1)
    s = torch.cat([student_p, 1 - student_p.sum(-1, keepdim=True)], -1)
    m = BETA * t + (1 - BETA) * s
    jsd = (BETA * t * (t / m).log() + (1 - BETA) * s * (s / m).log()).sum(-1)
    return (jsd * mask).sum() / mask.sum(), ids


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_jsd_term_equals_a_hand_computation(two_models, packed):
    """The teacher's top-k (worker) and the actor's GKD term (its update, alone in the loss: zero advantages)
    equal the hand computation: the term's value to 1e-6 and one SGD step's parameter change to the hand
    gradient's. Two micro-batches of the three rows; the masked tool tokens and padding count nothing."""
    from hflow.single_controller.local import LocalWorkerGroup
    from hflow.workers.actor import DataParallelPPOActor
    from hflow.workers.teacher.worker import TeacherWorker
    from transformers import AutoModelForCausalLM

    student_dir, teacher_dir = two_models
    vocab = AutoModelForCausalLM.from_pretrained(student_dir).config.vocab_size
    batch = _batch(vocab)
    cfg = default_section("teacher")
    cfg.model.path, cfg.model.use_remove_padding = str(teacher_dir), packed
    cfg.log_prob_micro_batch_size_per_gpu, cfg.temperature = 2, TEMPERATURE
    group = LocalWorkerGroup(ClassWithInitArgs(TeacherWorker, config=cfg))
    try:
        group.call(TeacherWorker.init_model)
        teacher_batch = DataProto.from_dict(dict(batch.batch.items()), meta_info={"topk": TOPK})
        teacher = group.call(TeacherWorker.compute_teacher_log_prob, teacher_batch).batch
    finally:
        group.shutdown()

    mask = batch.batch["response_mask"]
    _, teacher_logits = _hand_logits(teacher_dir, batch)
    hand_teacher = torch.log_softmax(teacher_logits, -1).topk(TOPK, -1)
    valid = batch.batch["attention_mask"][:, -mask.shape[1]:].bool()  # the teacher scores tool tokens too
    assert teacher["teacher_topk_ids"].dtype == torch.int32
    assert torch.equal(teacher["teacher_topk_ids"][valid].long(), hand_teacher.indices[valid])
    torch.testing.assert_close(teacher["teacher_topk_log_probs"][valid].double(), hand_teacher.values[valid],
                               atol=1e-6, rtol=0)

    config = resolved_copy(default_config().actor_rollout_ref.actor)
    for key, value in {"ppo_mini_batch_size_per_rank": 3, "ppo_micro_batch_size_per_gpu": 2, "shuffle": False,
                       "grad_clip": 1e6, "use_remove_padding": packed}.items():
        OmegaConf.update(config, key, value)
    model = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    actor = DataParallelPPOActor(config, model, torch.optim.SGD(model.parameters(), lr=LR))
    data = DataProto.from_dict({**dict(batch.batch.items()), "advantages": torch.zeros(mask.shape),
                                "teacher_topk_ids": teacher["teacher_topk_ids"],
                                "teacher_topk_log_probs": teacher["teacher_topk_log_probs"]},
                               meta_info={"temperature": TEMPERATURE, "distill_jsd": {"coef": 2.0, "beta": BETA}})
    metrics = actor.update_policy(data)

    hand_model, student_logits = _hand_logits(student_dir, batch, grad=True)
    hand, ids = _hand_jsd(student_logits, teacher_logits, mask)
    assert torch.equal(ids[valid], hand_teacher.indices[valid])
    assert metrics["actor/distill_jsd"][0] == pytest.approx(hand.item(), abs=1e-6)
    assert hand.item() > 1e-3  # the two models differ: a term of 0 would pass nothing
    (2.0 * hand).backward()
    moved = 0.0
    for name, param in model.named_parameters():
        expected = before[name].double() - LR * dict(hand_model.named_parameters())[name].grad
        torch.testing.assert_close(param.detach().double(), expected, atol=1e-6, rtol=0, msg=name)
        moved = max(moved, (param.detach() - before[name]).abs().max().item())
    assert moved > 1e-4  # the step moved the weights: the comparison is not vacuous
