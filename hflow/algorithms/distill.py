"""On-policy distillation signals (pure torch): the student samples, a teacher scores every sampled token.

* `reverse_kl_reward`: per token, the teacher's log-prob minus the student's at the token the student
  sampled. Its expectation over the student's samples is -KL(student || teacher) per token, so maximising
  it with any estimator and policy loss moves the student toward the teacher where the student puts its
  mass (mode-seeking), and it is zero wherever the mask is (prompt, padding, tool output).
* `mix_distillation_reward`: the token rewards a run trains on, `task_reward_coef` x the task's scores plus
  `coef` x the reverse-KL reward (task_reward_coef = 0: pure distillation).
* `generalized_jsd`: GKD's generalized Jensen-Shannon divergence between two distributions per token, given
  as log-probabilities over the same support (the whole vocabulary, or the teacher's top-k renormalised).
"""

from __future__ import annotations

import math

import torch

__all__ = ["generalized_jsd", "mix_distillation_reward", "reverse_kl_reward"]


def reverse_kl_reward(teacher_log_prob: torch.Tensor, student_log_prob: torch.Tensor,
                      response_mask: torch.Tensor) -> torch.Tensor:
    """(B, L): log pi_teacher(y_t) - log pi_student(y_t) at each sampled token y_t, 0 where the mask is 0."""
    return (teacher_log_prob - student_log_prob) * response_mask


def mix_distillation_reward(scores: torch.Tensor, teacher_log_prob: torch.Tensor, student_log_prob: torch.Tensor,
                            response_mask: torch.Tensor, coef: float,
                            task_reward_coef: float) -> tuple[torch.Tensor, dict[str, float]]:
    """(token rewards (B, L), metrics): task_reward_coef x scores + coef x `reverse_kl_reward`.

    Metrics: `distill/reverse_kl` (the mean over sampled tokens of log pi_student - log pi_teacher, the
    one-sample estimate of KL(student || teacher) per token), `distill/teacher_log_prob` (the teacher's mean
    log-prob of the student's tokens) and `distill/reward` (the mean distillation reward per response)."""
    mask = response_mask.to(scores.dtype)
    signal = reverse_kl_reward(teacher_log_prob, student_log_prob, mask)
    tokens = mask.sum().clamp(min=1)
    metrics = {
        "distill/reverse_kl": (-signal.sum() / tokens).item(),
        "distill/teacher_log_prob": ((teacher_log_prob * mask).sum() / tokens).item(),
        "distill/reward": (coef * signal.sum(-1)).mean().item(),
    }
    return task_reward_coef * scores + coef * signal, metrics


def generalized_jsd(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-token generalized JSD (GKD, Agarwal et al. 2024) over the last dimension (the support):

        JSD_beta(T || S) = beta KL(T || M) + (1 - beta) KL(S || M),   M = beta T + (1 - beta) S,

    for 0 < beta < 1 (beta = 0.5: the symmetric JSD). Inputs are log-probabilities over the same support
    (..., K), each normalised over it; the result has the shape of the inputs without their last dimension.
    Gradients flow into both arguments; detach the teacher's."""
    if not 0.0 < beta < 1.0:
        raise ValueError(f"generalized_jsd needs 0 < beta < 1, got {beta}")
    log_mixture = torch.logsumexp(torch.stack([teacher_log_probs + math.log(beta),
                                               student_log_probs + math.log(1.0 - beta)]), dim=0)
    kl_teacher = (teacher_log_probs.exp() * (teacher_log_probs - log_mixture)).sum(-1)
    kl_student = (student_log_probs.exp() * (student_log_probs - log_mixture)).sum(-1)
    return beta * kl_teacher + (1.0 - beta) * kl_student
