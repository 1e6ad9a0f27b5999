"""`trainer.health`: the health watch's section (typed defaults; comments in `config/ppo_trainer.yaml`).
Its rules are `hflow.trainer.ppo.health.check_health_config`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class HealthConfig:
    """The health watch (trainer.health): detectors on each step's metrics; on a trigger the trainer
    restores the last healthy state and applies `remedy`."""

    enable: bool = False
    window: int = 20  # steps of history for the gradient-norm z-score
    grad_norm_zscore: Optional[float] = 6.0  # trigger above mean + z * std of the window's grad norms
    entropy_min: Optional[float] = None  # trigger when actor/entropy falls below
    entropy_max: Optional[float] = None  # trigger when actor/entropy rises above (a policy turned to noise)
    ppo_kl_max: Optional[float] = None  # trigger when |actor/ppo_kl| exceeds
    rollout_probs_diff_max: Optional[float] = None  # trigger when training/rollout_probs_diff_max exceeds
    max_length_frac: Optional[float] = None  # trigger when this share of responses ends at the length limit
    zero_adv_group_frac: Optional[float] = None  # trigger when this share of groups has zero advantage
    remedy: str = "skip"  # skip | lr_scale | tighten_clip | stop
    lr_scale: float = 0.5  # remedy lr_scale: multiply the learning rate by this on each rollback
    clip_scale: float = 0.5  # remedy tighten_clip: multiply clip_ratio (low, high) by this on each rollback
    max_rollbacks: int = 3  # stop (health_report.json) at the next trigger after this many rollbacks in a row
    snapshot: str = "memory"  # memory: keep the last healthy state in host memory | checkpoint: the last saved one
    inject: list = field(default_factory=list)  # fault injection to test the watch: [{step, kind, value}]
