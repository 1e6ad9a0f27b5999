"""On-policy distillation in the trainer's other modes, end to end on the built-in task: asynchronous steps
(`trainer.async_steps=1`: the batch trained was sampled by the policy one update older) and a LoRA student
(`actor_rollout_ref.model.lora_rank > 0`), each with both signals on (the reverse-KL reward and the JSD term).

Each run dumps its samples (`trainer.rollout_data_dir`) with the token ids as sampled and the teacher's
log-prob of each response token; a plain transformers forward of the teacher over those ids, at the rollout's
temperature, must give the same log-probs: the teacher scored exactly what the sampler produced, whichever
policy version produced it.
"""

import json

import pytest
import torch

from tests.trainer.test_distillation import teacher_paths
from tests.trainer.test_placement import run_builtin

pytestmark = pytest.mark.slow  # training runs (async and LoRA students)

STEPS = 3
LEAN = ("data.train_batch_size=8", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "trainer.val_before_train=false", "trainer.test_freq=100", f"trainer.total_training_steps={STEPS}",
        "algorithm.distill.coef=1.0", "algorithm.distill.jsd_coef=1.0", "teacher.topk=8")


def assert_teacher_scored_the_samples(dump_dir, teacher_path: str, temperature: float) -> int:
    """Every dumped sample's teacher log-probs equal a plain forward of the teacher over its ids; returns
    how many samples were checked."""
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(teacher_path, dtype=torch.float32).eval()
    checked = 0
    for step in range(1, STEPS + 1):
        for line in open(dump_dir / f"{step}.jsonl"):
            row = json.loads(line)
            prompt, response = row["prompt_ids"], row["response_ids"]
            assert len(response) == len(row["teacher_log_prob"]) > 0, row
            with torch.no_grad():
                logits = teacher(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1]
            expected = torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(row["teacher_log_prob"]), expected, atol=1e-4, rtol=0)
            checked += 1
    return checked


def assert_trained_with_both_signals(records: list[dict]) -> list[dict]:
    steps = [r for r in records if "actor/pg_loss" in r]
    assert len(steps) == STEPS, records
    for r in steps:
        assert r["actor/distill_jsd"] > 0 and r["distill/reverse_kl"] == r["distill/reverse_kl"], r
    return steps


def test_async_student_with_a_teacher(ray_session, tmp_path):
    """One training worker and one vLLM engine (`split`); the engine samples batch t+1 while batch t trains."""
    records = run_builtin(tmp_path, *LEAN, "trainer.placement=split", "trainer.rollout_n_gpus=1",
                          "trainer.async_steps=1", f"teacher.model.path={teacher_paths()['teacher']}",
                          f"trainer.rollout_data_dir={tmp_path / 'dump'}")
    steps = assert_trained_with_both_signals(records)
    # after the first step, each batch trained was sampled one update before it
    assert [r["training/staleness/max"] for r in steps][1:] == [1] * (STEPS - 1), steps
    assert assert_teacher_scored_the_samples(tmp_path / "dump", teacher_paths()["teacher"], 1.0) == 8 * 4 * STEPS


def test_lora_student_with_a_teacher(tmp_path):
    """Adapters only train; the teacher is a full model of its own beside the actor (one local rank); the
    student's forwards are packed (remove-padding), the engine samples at T = 0.8."""
    records = run_builtin(tmp_path, *LEAN, "trainer.backend=local", "trainer.n_gpus_per_node=1",
                          "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.model.lora_rank=8",
                          "actor_rollout_ref.actor.optim.lr=2e-3", "actor_rollout_ref.model.use_remove_padding=true",
                          f"teacher.model.path={teacher_paths()['teacher']}", "actor_rollout_ref.rollout.temperature=0.8",
                          f"trainer.rollout_data_dir={tmp_path / 'dump'}")
    assert_trained_with_both_signals(records)
    assert assert_teacher_scored_the_samples(tmp_path / "dump", teacher_paths()["teacher"], 0.8) == 8 * 4 * STEPS
