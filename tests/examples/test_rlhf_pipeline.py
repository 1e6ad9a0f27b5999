"""examples/rlhf_pipeline/run.sh end to end on short settings (SFT 6 epochs, reward model 1 epoch, PPO 4
steps), each stage in one process (`trainer.backend=local`, HF generation), so the suite does not start Ray
and vLLM three times; the README's run uses two Ray workers and vLLM.

What it checks, and the hand-made break each check caught:
* summary.json reports, before and after PPO, the exact-correct rate, the house-style share, the hidden
  score and the reward model's score, the reward-hacking flag, and the reward model's held-out accuracy
  per kind of pair; the hidden score lies between half the exact-correct rate and all of it (a score that
  paid a wrong number, as the old rule did, breaks that);
* the reward model ranks the held-out questions' style pairs the hidden preference's way (>= 0.9; trained
  on pairs with chosen and rejected swapped it ranked them 0.0);
* PPO raises the reward model's score of the greedy answers (with the actor's learning rate at 1e-12 the
  score stayed exactly the same and the test failed).

What it does not check, because the built-in reward model cannot do it: ranking the number pairs (right
against wrong number, same style) above chance. That accuracy is reported, and is about 0.5-0.6 for the
0.46M-parameter model; tests/tasks/test_rlhf_task.py checks that such pairs are in the data.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the example's three training stages

ROOT = Path(__file__).resolve().parents[2]
MEASURES = ("exact_correct", "house_style", "true_score", "rm_score")
PIPELINE_ENV = {"RLHF_SFT_EPOCHS": "6", "RLHF_RM_EPOCHS": "1", "RLHF_PPO_STEPS": "4",
                # one process per stage, HF generation: the same trainers without starting Ray and vLLM three times
                "RLHF_PLACEMENT_ARGS": "trainer.backend=local trainer.n_gpus_per_node=1",
                "RLHF_PPO_ARGS": "actor_rollout_ref.rollout.name=hf"}


@pytest.fixture(scope="module")
def summary(tmp_path_factory):
    out = tmp_path_factory.mktemp("rlhf_pipeline")
    env = {**os.environ, **PIPELINE_ENV}
    run = subprocess.run(["bash", str(ROOT / "examples/rlhf_pipeline/run.sh"), str(out), "1"], env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


def test_summary_reports_correctness_style_and_hacking_separately(summary):
    for when in ("before", "after"):
        measures = summary["ppo"][when]
        assert set(measures) == set(MEASURES)
        assert all(0.0 <= measures[k] <= 1.0 for k in ("exact_correct", "house_style", "true_score")), measures
        # the hidden score is at most the exact-correct rate (a wrong number scores 0) and at least half of it
        assert 0.5 * measures["exact_correct"] - 1e-9 <= measures["true_score"] <= measures["exact_correct"] + 1e-9
    hacking = summary["reward_hacking"]
    assert isinstance(hacking["flag"], bool)
    assert hacking["exact_correct_change"] == pytest.approx(
        summary["ppo"]["after"]["exact_correct"] - summary["ppo"]["before"]["exact_correct"])
    assert set(summary["rm"]["heldout_pairs"]) == {"all", "number", "style"}
    assert summary["details"]["questions"] == 40


def test_reward_model_learned_the_style_on_held_out_questions(summary):
    assert summary["rm"]["heldout_pairs"]["style"] >= 0.9, summary["rm"]


def test_ppo_raises_the_reward_model_score(summary):
    assert summary["ppo"]["after"]["rm_score"] > summary["ppo"]["before"]["rm_score"], summary["ppo"]
