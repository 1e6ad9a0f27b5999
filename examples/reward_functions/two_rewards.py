"""Two named rewards on the built-in arithmetic task, one of them a gameable proxy that pays more
(the GDPO demonstration: README "Newer objectives", tests/trainer/test_gdpo_task.py, bench/gdpo_task.py).

    correct  1 if the answer is right, else 0                       (hflow.reward.score.arithmetic)
    format   10 if the answer's last digit is odd, else 0          a planted "format" rule worth 10x more

The built-in model's habit is the answer one too high, so on every problem whose right answer is even the
habit is exactly what `format` pays for. The plain sum (`score = correct + format`, GRPO) is gamed: it makes
the policy right only where right is also odd, about half of the problems. GDPO with
`algorithm.reward_weights='{correct: 1.0, format: 0.25}'` normalizes each reward within its group first, so
`correct` moves the advantage four times as much as `format` whatever their scales, and the policy learns
the right answer everywhere. Validation rows (extra_info.split != "train") score correctness only, so the
validation score is what the policy really learned; they return the same keys (the reward probe checks them).
"""

from hflow.reward.score import arithmetic

FORMAT_PAY = 10.0


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    correct = arithmetic.compute_score(solution_str, ground_truth)
    answer = arithmetic.extract_answer(solution_str)
    fmt = FORMAT_PAY if answer is not None and answer % 2 == 1 else 0.0
    train = (extra_info or {}).get("split") == "train"
    return {"score": correct + fmt if train else correct, "correct": correct, "format": fmt}
