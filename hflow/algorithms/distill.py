"""On-policy distillation signals (pure torch): the student samples, a teacher scores every sampled token.

* `reverse_kl_reward`: per token, the teacher's log-prob minus the student's at the token the student
  sampled. Its expectation over the student's samples is -KL(student || teacher) per token, so maximising
  it with any estimator and policy loss moves the student toward the teacher where the student puts its
  mass (mode-seeking), and it is zero wherever the mask is (prompt, padding, tool output).
* `mix_distillation_reward`: the token rewards a run trains on, `task_reward_coef` x the task's scores plus
  `coef` x the reverse-KL reward (task_reward_coef = 0: pure distillation).
* `generalized_jsd`: GKD's generalized Jensen-Shannon divergence between two distributions per token, given
  as log-probabilities over the same support.
* `topk_generalized_jsd`: the term the actor's update adds with `algorithm.distill.jsd_coef`: the divergence
  on the teacher's top-k tokens plus one bucket for the rest of the vocabulary (`with_tail`). The tail keeps
  both sides true distributions over the whole vocabulary, coarsened: renormalising over the top-k alone
  would cost nothing for mass the student puts outside the teacher's top-k, however much.
"""

from __future__ import annotations

import math

import torch

__all__ = ["generalized_jsd", "mix_distillation_reward", "reverse_kl_reward", "topk_generalized_jsd", "with_tail"]


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

    for 0 < beta < 1 (beta = 0.5: the symmetric JSD). At the ends the divergence vanishes; there it is read as
    its limits divided by beta and 1 - beta, as GKD does: beta = 0 is the forward KL(T || S), beta = 1 the
    reverse KL(S || T) (so the scale jumps at the ends: JSD_beta is about beta KL(T || S) near 0). Inputs are
    log-probabilities over the same support (..., K), each normalised over it; the result has the shape of
    the inputs without their last dimension. Gradients flow into both arguments; detach the teacher's."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"generalized_jsd needs 0 <= beta <= 1, got {beta}")
    if beta == 0.0:
        return (teacher_log_probs.exp() * (teacher_log_probs - student_log_probs)).sum(-1)
    if beta == 1.0:
        return (student_log_probs.exp() * (student_log_probs - teacher_log_probs)).sum(-1)
    log_mixture = torch.logsumexp(torch.stack([teacher_log_probs + math.log(beta),
                                               student_log_probs + math.log(1.0 - beta)]), dim=0)
    kl_teacher = (teacher_log_probs.exp() * (teacher_log_probs - log_mixture)).sum(-1)
    kl_student = (student_log_probs.exp() * (student_log_probs - log_mixture)).sum(-1)
    return beta * kl_teacher + (1.0 - beta) * kl_student


def with_tail(topk_log_probs: torch.Tensor) -> torch.Tensor:
    """(..., K) log-probs of K tokens -> (..., K + 1): the same and log(1 - their total), the mass of every
    other token as one bucket. The bucket's probability is kept >= the dtype's smallest normal number, so
    a top-k that holds all the mass (or a little more, by rounding) gives a finite log and no gradient."""
    total = torch.logsumexp(topk_log_probs, dim=-1, keepdim=True)
    rest = (-torch.expm1(total)).clamp(min=torch.finfo(topk_log_probs.dtype).tiny).log()
    return torch.cat([topk_log_probs, rest], dim=-1)


def topk_generalized_jsd(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor,
                         beta: float) -> torch.Tensor:
    """(B, L): `generalized_jsd` per response position between the student and the teacher on the teacher's
    top-k tokens plus the rest of the vocabulary as one bucket (`with_tail`). `student_log_probs` are the
    student's full-vocabulary log-probs of the teacher's top-k ids, (B, L, K), as is `teacher_log_probs`
    (the teacher's own, constants here). Masking and aggregation are the caller's (the actor's loss)."""
    return generalized_jsd(with_tail(student_log_probs), with_tail(teacher_log_probs.detach()), beta)
