"""The health watch (`trainer.health`): each step's metrics against detectors of a collapsing run.

A step passes when no detector fires; the state it started from is then the last healthy state. When a
detector fires, the trainer restores that state exactly (the actor's and critic's shards, optimizer and
scheduler, from host memory or from the last checkpoint a healthy step followed), applies the remedy
(`skip`: the batches since are dropped; `lr_scale`, `tighten_clip`: also a smaller learning rate or a
tighter PPO clip from now on; `stop`) and goes on with the next batch. After `max_rollbacks` rollbacks in
a row the next trigger stops the run. Every trigger is written to `<trainer.log_dir>/health_report.json`
with the metrics of the steps around it.

Detectors (each off when its limit is null, except the non-finite check):
- non_finite: any `actor/*` or `critic/*` metric (losses, gradient norms, entropy, scores) is NaN or inf;
- grad_norm_spike: `actor/grad_norm` above mean + z x std of the last `window` healthy steps (from the
  fifth; the spread counts as at least 5 % of the mean, so a very steady run does not trip on noise);
- entropy_collapse: `actor/entropy` below `entropy_min`;
- entropy_blowup: `actor/entropy` above `entropy_max` (a policy turned to noise);
- ppo_kl: |`actor/ppo_kl`| above `ppo_kl_max`;
- rollout_probs_diff: `training/rollout_probs_diff_max` above `rollout_probs_diff_max`;
- length_pinned: `response_length/clip_ratio` (responses cut at the length limit) at or above `max_length_frac`;
- zero_advantage: `training/zero_adv_group_frac` (prompt groups whose advantages are all zero) at or above
  `zero_adv_group_frac`.
"""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from hflow.config_schema import (
    ConfigError,
    ConfigErrors,
    check_fraction,
    check_lower_upper,
    check_non_negative,
    check_positive_number,
    check_scale,
)
from hflow.trainer.ppo.faults import FAULTS
from hflow.utils.errors import UserError

REMEDIES = ("skip", "lr_scale", "tighten_clip", "stop")
SNAPSHOTS = ("memory", "checkpoint")
MIN_HISTORY = 5  # healthy steps before the gradient-norm z-score is trusted
MIN_SPREAD = 0.05  # the z-score's std is at least this share of the mean


class UnhealthyRun(UserError):
    """The health watch stopped the run (remedy `stop`, or more than `max_rollbacks` in a row)."""


@dataclass
class Trigger:
    step: int
    detector: str
    key: str
    value: float
    limit: float | None

    def describe(self) -> str:
        limit = "" if self.limit is None else f" (limit {self.limit:.6g})"
        return f"health watch: step {self.step}: {self.detector}: {self.key} = {self.value:.6g}{limit}"


def check_health_config(config) -> None:
    """The watch's rules, checked before any worker starts: names, every limit in its range (all of their
    errors together), the fault injections, and what the watch needs of the run."""
    health, trainer = config.trainer.health, config.trainer
    errors = ConfigErrors()
    with errors.catch():
        if health.remedy not in REMEDIES:
            raise ConfigError(f"trainer.health.remedy={health.remedy!r}: use one of {', '.join(REMEDIES)}")
    with errors.catch():
        if health.snapshot not in SNAPSHOTS:
            raise ConfigError(f"trainer.health.snapshot={health.snapshot!r}: use one of {', '.join(SNAPSHOTS)}")
    with errors.catch():
        if int(health.window) < 1 or int(health.max_rollbacks) < 0:
            raise ConfigError("trainer.health.window must be >= 1 and trainer.health.max_rollbacks >= 0")
    key = "trainer.health"
    errors.run(check_positive_number, health.grad_norm_zscore, f"{key}.grad_norm_zscore",
               "a number of standard deviations; null: off", null_ok=True)
    errors.run(check_entropy_min, health.entropy_min, config)
    errors.run(check_positive_number, health.entropy_max, f"{key}.entropy_max", "nats of mean token entropy; "
               "null: off", null_ok=True)
    if health.entropy_min is not None and health.entropy_max is not None:  # a band the entropy can stay in
        errors.run(check_lower_upper, health.entropy_min, health.entropy_max, f"{key}.entropy_min",
                   f"{key}.entropy_max")
    errors.run(check_positive_number, health.ppo_kl_max, f"{key}.ppo_kl_max", "null: off", null_ok=True)
    errors.run(check_fraction, health.rollout_probs_diff_max, f"{key}.rollout_probs_diff_max",
               "a difference of probabilities; null: off", null_ok=True, zero_ok=False)
    for share in ("max_length_frac", "zero_adv_group_frac"):  # a share of responses / groups; 0 fires every step
        errors.run(check_fraction, health[share], f"{key}.{share}", "a share of the batch; null: off",
                   null_ok=True, zero_ok=False)
    errors.run(check_scale, health.lr_scale, f"{key}.lr_scale",
               "remedy lr_scale multiplies the learning rate by it at each rollback", at_most_one=True)
    errors.run(check_scale, health.clip_scale, f"{key}.clip_scale",
               "remedy tighten_clip multiplies the PPO clip ratios by it at each rollback", at_most_one=True)
    for i, fault in enumerate(health.inject or []):
        errors.run(_check_fault, i, fault)
    if health.enable:
        with errors.catch():
            if health.snapshot == "checkpoint" and int(trainer.save_freq) <= 0:
                raise ConfigError("trainer.health.snapshot=checkpoint restores the last saved checkpoint: set "
                                  "trainer.save_freq > 0, or use trainer.health.snapshot=memory")
    errors.raise_any()


def _check_fault(i: int, fault) -> None:
    where = f"trainer.health.inject[{i}]"
    if not hasattr(fault, "get") or fault.get("kind") not in FAULTS:
        raise ConfigError(f"{where}={fault}: give {{step: N, kind: {'|'.join(FAULTS)}, value: ...}}")
    if not isinstance(fault.get("step"), int) or fault["step"] < 1:
        raise ConfigError(f"{where}.step must be a training step >= 1, got {fault.get('step')!r}")
    if fault["kind"] != "nan_logits" and not isinstance(fault.get("value"), (int, float)):
        raise ConfigError(f"{where}.value: {fault['kind']} needs a number (lr_scale: the factor; reward: the score)")
    if not isinstance(fault.get("steps", 1), int) or fault.get("steps", 1) < 1:
        raise ConfigError(f"{where}.steps: how many steps the fault lasts, an integer >= 1")


def check_entropy_min(entropy_min, config) -> None:
    """`trainer.health.entropy_min`: >= 0 (or null), and below the largest mean token entropy the policy can
    have, ln(vocab_size) nats (read from the model's config.json where it is readable): at or above it the
    detector fires at every step."""
    key = "trainer.health.entropy_min"
    check_non_negative(entropy_min, key, "nats of mean token entropy; null: off", null_ok=True)
    if entropy_min is None:
        return
    vocab = _vocab_size(config)
    if vocab and float(entropy_min) >= math.log(vocab):
        raise ConfigError(
            f"{key}={entropy_min} can never be reached from below: the mean token entropy of a model with "
            f"vocab_size {vocab} is at most ln({vocab}) = {math.log(vocab):.2f} nats, so the watch would fire at "
            f"every step; give a value below that (healthy runs sit well under it, e.g. 0.05) or null")


def _vocab_size(config) -> int | None:
    """The policy's vocab_size from its config.json, or None where that is not readable (the model's own
    check reports it)."""
    path = config.actor_rollout_ref.model.path
    if path is None:
        return None
    try:
        model_config = json.loads((Path(str(path)).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    vocab = model_config.get("vocab_size") or (model_config.get("text_config") or {}).get("vocab_size")
    return int(vocab) if isinstance(vocab, int) and vocab > 1 else None


def zero_advantage_group_frac(advantages: torch.Tensor, response_mask: torch.Tensor, uids: np.ndarray) -> float:
    """The share of prompt groups (`uid`) whose samples all have zero advantage: they teach nothing."""
    per_sample = (advantages.abs() * response_mask).amax(-1).float().cpu().numpy()
    _, group = np.unique(uids, return_inverse=True)
    group_max = np.zeros(group.max() + 1)
    np.maximum.at(group_max, group, per_sample)
    return float((group_max < 1e-8).mean())


class HealthWatch:
    def __init__(self, cfg, log_dir: str | Path):
        self.cfg = cfg
        self.report_path = Path(log_dir) / "health_report.json"
        self.grad_norms: deque[float] = deque(maxlen=int(cfg.window))  # of healthy steps
        self.recent: deque[dict] = deque(maxlen=int(cfg.window))  # every step's metrics, for the report
        self.triggers: list[Trigger] = []
        self.rollbacks = 0
        self.rollbacks_in_a_row = 0
        self.lr_factor = 1.0
        self.clip_factor = 1.0

    # ---- detectors

    def check(self, step: int, metrics: dict[str, float]) -> Trigger | None:
        cfg = self.cfg
        for key, value in metrics.items():
            if key.startswith(("actor/", "critic/")) and isinstance(value, (int, float)) and not math.isfinite(value):
                return Trigger(step, "non_finite", key, float(value), None)
        grad_norm = metrics.get("actor/grad_norm")
        if cfg.grad_norm_zscore is not None and grad_norm is not None and len(self.grad_norms) >= MIN_HISTORY:
            mean = float(np.mean(self.grad_norms))
            spread = max(float(np.std(self.grad_norms)), MIN_SPREAD * abs(mean))
            limit = mean + float(cfg.grad_norm_zscore) * spread
            if grad_norm > limit:
                return Trigger(step, "grad_norm_spike", "actor/grad_norm", grad_norm, limit)
        below = [("entropy_collapse", "actor/entropy", cfg.entropy_min)]
        above = [("entropy_blowup", "actor/entropy", cfg.entropy_max), ("ppo_kl", "actor/ppo_kl", cfg.ppo_kl_max),
                 ("rollout_probs_diff", "training/rollout_probs_diff_max", cfg.rollout_probs_diff_max)]
        at_least = [("length_pinned", "response_length/clip_ratio", cfg.max_length_frac),
                    ("zero_advantage", "training/zero_adv_group_frac", cfg.zero_adv_group_frac)]
        for name, key, limit in below:
            if limit is not None and key in metrics and metrics[key] < float(limit):
                return Trigger(step, name, key, metrics[key], float(limit))
        for name, key, limit in above:
            if limit is not None and key in metrics and abs(metrics[key]) > float(limit):
                return Trigger(step, name, key, metrics[key], float(limit))
        for name, key, limit in at_least:
            if limit is not None and key in metrics and metrics[key] >= float(limit):
                return Trigger(step, name, key, metrics[key], float(limit))
        return None

    # ---- bookkeeping

    def passed(self, step: int, metrics: dict[str, float]) -> None:
        self.recent.append({"step": step, **metrics})
        if metrics.get("actor/grad_norm") is not None:
            self.grad_norms.append(float(metrics["actor/grad_norm"]))
        self.rollbacks_in_a_row = 0

    def failed(self, trigger: Trigger, metrics: dict[str, float]) -> None:
        self.recent.append({"step": trigger.step, "health/trigger": trigger.detector, **metrics})
        self.triggers.append(trigger)

    def must_stop(self) -> bool:
        return self.cfg.remedy == "stop" or self.rollbacks_in_a_row >= int(self.cfg.max_rollbacks)

    def rolled_back(self) -> None:
        """Count the rollback and tighten the remedy's factors (they compound over rollbacks)."""
        self.rollbacks += 1
        self.rollbacks_in_a_row += 1
        if self.cfg.remedy == "lr_scale":
            self.lr_factor *= float(self.cfg.lr_scale)
        elif self.cfg.remedy == "tighten_clip":
            self.clip_factor *= float(self.cfg.clip_scale)

    def metrics(self, triggered: bool) -> dict[str, float]:
        return {"health/triggered": float(triggered), "health/rollbacks": float(self.rollbacks),
                "health/lr_factor": self.lr_factor, "health/clip_factor": self.clip_factor}

    def write_report(self, stopped: bool) -> Path:
        """health_report.json: every trigger, what was done, and the metrics of the recent steps."""
        report = {"stopped": stopped, "rollbacks": self.rollbacks, "remedy": self.cfg.remedy,
                  "lr_factor": self.lr_factor, "clip_factor": self.clip_factor,
                  "triggers": [{k: _jsonable(v) for k, v in asdict(t).items()} for t in self.triggers],
                  "recent_steps": [{k: _jsonable(v) for k, v in m.items()} for m in self.recent]}
        self.report_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.report_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1))
        tmp.replace(self.report_path)
        return self.report_path

    def state_dict(self) -> dict:
        return {"lr_factor": self.lr_factor, "clip_factor": self.clip_factor, "rollbacks": self.rollbacks}

    def load_state_dict(self, state: dict) -> None:
        self.lr_factor, self.clip_factor = float(state["lr_factor"]), float(state["clip_factor"])
        self.rollbacks = int(state["rollbacks"])


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN
    return value
