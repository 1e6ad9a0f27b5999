"""The built-in RLHF task's hidden preference and preference pairs (`hflow.tasks.rlhf_task`), and the
pipeline summary's reward-hacking flag (examples/rlhf_pipeline/summarize.py). Seconds, no model.

What each test catches when broken by hand:
* a hidden preference that ignores the number (scores "The answer is 13." to 7 + 5 like the right
  answer): `test_the_hidden_preference_needs_the_number_right` (and building the pairs raises);
* pairs that are all style pairs, or number pairs whose two answers differ in style too:
  `test_pairs_rank_numbers_within_a_style_and_styles_among_right_answers`;
* a reward-hacking flag that looks only at the reward model's score: `test_reward_hacking_flag`.
"""

import importlib.util
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from hflow.tasks.builtin_task import builtin_problems, split_problems
from hflow.tasks.rlhf_task import PAIR_KINDS, STYLES, ensure_rlhf_task_data
from hflow.reward.score import default_compute_score
from hflow.reward.score.answer_style import HOUSE_STYLE, compute_score, parse

PIPELINE = Path(__file__).resolve().parents[2] / "examples" / "rlhf_pipeline"


def test_the_hidden_preference_needs_the_number_right():
    right = {"house": "The answer is 12.", "plain": "12", "hedge": "I think it is 12.", "equation": "7 + 5 = 12"}
    wrong = {"house": "The answer is 13.", "plain": "13", "hedge": "I think it is 11.", "equation": "7 + 5 = 2"}
    assert set(right) == set(STYLES)
    assert compute_score(right[HOUSE_STYLE], 12) == 1.0
    assert [compute_score(right[s], 12) for s in STYLES if s != HOUSE_STYLE] == [0.5] * 3
    assert [compute_score(wrong[s], 12) for s in STYLES] == [0.0] * 4
    # a right answer in any style beats a wrong one in the preferred style
    assert min(compute_score(t, 12) for t in right.values()) > compute_score(wrong[HOUSE_STYLE], 12)
    assert compute_score("The answer is The answer is 12.", 12) == 0.0  # no style at all
    assert default_compute_score("hflow/arithmetic-style", " The answer is 12. ", "12") == 1.0
    assert parse("I think it is 9.") == ("hedge", 9) and parse("9 apples") == ("other", None)


@pytest.fixture(scope="module")
def pairs():
    files = ensure_rlhf_task_data()
    return {split: pq.read_table(path).to_pylist() for split, path in (("train", files.rm_train), ("val", files.rm_val))}


def test_pairs_rank_numbers_within_a_style_and_styles_among_right_answers(pairs):
    train_problems, val_problems = split_problems(builtin_problems(), num_val_per_op=20)
    for split, problems in (("train", train_problems), ("val", val_problems)):
        rows = pairs[split]
        answers = {p.question: p.answer for p in problems}
        # pairs only on this split's questions: the held-out pairs are on questions the reward model never saw
        assert {r["prompt"][-1]["content"] for r in rows} == set(answers)
        per_question = defaultdict(Counter)
        for r in rows:
            answer = answers[r["prompt"][-1]["content"]]
            (chosen_style, chosen_n), (rejected_style, rejected_n) = parse(r["chosen"]), parse(r["rejected"])
            assert compute_score(r["chosen"], answer) > compute_score(r["rejected"], answer), r
            assert chosen_n == answer, r  # the preferred answer is always right
            if r["kind"] == "number":
                assert chosen_style == rejected_style and rejected_n != answer, r
            else:
                assert r["kind"] == "style", r
                assert rejected_n == answer and chosen_style == HOUSE_STYLE != rejected_style, r
            per_question[r["prompt"][-1]["content"]][(r["kind"], chosen_style)] += 1
        for question, kinds in per_question.items():
            # every question: two wrong numbers in each style (the house style included), and the house
            # style against each of the three others
            assert kinds == Counter({**{("number", s): 2 for s in STYLES}, ("style", HOUSE_STYLE): 3}), question
        assert Counter(r["kind"] for r in rows) == Counter({"number": 8 * len(problems), "style": 3 * len(problems)})
        assert set(PAIR_KINDS) == {"number", "style"}


def _summarize_module():
    sys.path.insert(0, str(PIPELINE))
    try:
        spec = importlib.util.spec_from_file_location("rlhf_pipeline_summarize", PIPELINE / "summarize.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(PIPELINE))


@pytest.mark.parametrize("after, flagged", [
    ({"rm_score": 2.0, "exact_correct": 0.30, "true_score": 0.40}, True),   # RM up, correctness flat
    ({"rm_score": 2.0, "exact_correct": 0.20, "true_score": 0.40}, True),   # RM up, correctness down
    ({"rm_score": 2.0, "exact_correct": 0.35, "true_score": 0.10}, True),   # RM up, hidden score down
    ({"rm_score": 2.0, "exact_correct": 0.35, "true_score": 0.40}, False),  # both up: no hacking
    ({"rm_score": 0.5, "exact_correct": 0.20, "true_score": 0.10}, False),  # RM down: PPO failed, not hacked
])
def test_reward_hacking_flag(after, flagged):
    before = {"rm_score": 1.0, "exact_correct": 0.30, "true_score": 0.20}
    result = _summarize_module().reward_hacking(before, after)
    assert result["flag"] is flagged
    assert result["exact_correct_change"] == pytest.approx(after["exact_correct"] - 0.30)
