"""KL estimators (`algorithm.kl_penalty`, `actor.kl_loss_type`) and the KL coefficient's controllers
(`algorithm.kl_ctrl`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

# ``log pi - log pi_old`` is clamped to this range before ``exp`` so that one stale token cannot
# overflow the importance ratio (exp(20) ~ 5e8 is still finite in fp32 and bf16).
LOG_RATIO_CLAMP = 20.0

_KL_ALIASES = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}
# Names `kl_penalty` accepts (`algorithm.kl_penalty`, `actor.kl_loss_type`), each also with a trailing '+'.
KL_PENALTY_NAMES = tuple(_KL_ALIASES)


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman 2020, "Approximating KL
    divergence"), with delta = logprob - ref_logprob:

    * `kl` / `k1`: delta (unbiased, high variance, can be negative);
    * `abs`: |delta|;
    * `mse` / `k2`: delta^2 / 2 (biased, low variance);
    * `low_var_kl` / `k3`: exp(-delta) + delta - 1 >= 0 (unbiased, low variance); -delta is clamped
      to [-20, 20] before exp and the result to [-10, 10] for stability.

    A trailing `+` (e.g. `k3+`) gives the straight-through variant: the value of the named
    estimator with the gradient of k2, delta * grad(logprob), whose expectation is the gradient of the
    KL when it is used as a loss (k1's and k3's own gradients are not).
    """
    straight_through = kl_penalty.endswith("+")
    name = _KL_ALIASES.get(kl_penalty.removesuffix("+"))
    if name is None:
        known = ", ".join(sorted(_KL_ALIASES) + [k + "+" for k in sorted(_KL_ALIASES)])
        raise ValueError(f"Unknown kl_penalty {kl_penalty!r}; known estimators: {known}")

    delta = logprob - ref_logprob
    if name == "k1":
        kl = delta
    elif name == "abs":
        kl = delta.abs()
    elif name == "k2":
        kl = 0.5 * delta.square()
    else:
        neg_delta = torch.clamp(-delta, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        kl = torch.clamp(torch.exp(neg_delta) - neg_delta - 1, min=-10.0, max=10.0)

    if straight_through:
        k2 = 0.5 * delta.square()
        kl = k2 + (kl - k2).detach()
    return kl


class FixedKLController:
    """Constant KL coefficient."""

    def __init__(self, kl_coef: float) -> None:
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (kept so both controllers share one interface)."""


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, sec. 2.2): proportional control of the KL towards
    `target_kl`, value <- value * (1 + clip(KL / target - 1, -0.2, 0.2) * n_steps / horizon)."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if horizon <= 0:
            raise ValueError(f"adaptive KL controller needs horizon > 0, got {horizon}")
        self.value = init_kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move the coefficient after `n_steps` samples whose mean KL was `current_kl`."""
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon


def get_kl_controller(kl_ctrl_config: Mapping[str, Any] | Any) -> FixedKLController | AdaptiveKLController:
    """Build the controller of `algorithm.kl_ctrl`: `type` is `fixed` (uses `kl_coef`) or `adaptive`
    (uses `kl_coef`, `target_kl`, `horizon`). The defaults live in the config schema, not here."""

    def value(key: str) -> Any:
        return kl_ctrl_config[key] if isinstance(kl_ctrl_config, Mapping) else getattr(kl_ctrl_config, key)

    ctrl_type = value("type")
    if ctrl_type == "fixed":
        return FixedKLController(kl_coef=value("kl_coef"))
    if ctrl_type == "adaptive":
        return AdaptiveKLController(
            init_kl_coef=value("kl_coef"), target_kl=value("target_kl"), horizon=value("horizon"))
    raise ValueError(f"Unknown algorithm.kl_ctrl.type {ctrl_type!r}; known types: fixed, adaptive")
