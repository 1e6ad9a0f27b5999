"""The inverted-reward control of the built-in vision task (tests/trainer/test_vision_task_learns.py,
bench/vision_task.py): training rows (extra_info.split == "train") are paid for a wrong answer, validation
rows get the true score, so validation measures what the policy learned."""

from hflow.reward.score import vision_digits


def inverted(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    score = vision_digits.compute_score(solution_str, ground_truth)
    return score if extra_info["split"] != "train" else 1.0 - score
