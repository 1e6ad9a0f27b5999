"""An example custom reward: the GSM8K score minus a small penalty for long answers.

    python -m hflow.trainer.main_ppo ... \
        custom_reward_function.path=examples/reward_functions/length_penalty.py \
        custom_reward_function.name=compute_score \
        +custom_reward_function.reward_kwargs.penalty_per_char=0.0005
"""

from hflow.reward.score import gsm8k


def compute_score(data_source, solution_str, ground_truth, extra_info=None, penalty_per_char=0.0005):
    correct = gsm8k.compute_score(solution_str, ground_truth)
    penalty = penalty_per_char * len(solution_str)
    # Extra keys become metrics: reward/correct/mean, reward/length/mean.
    return {"score": correct - penalty, "correct": correct, "length": len(solution_str)}
