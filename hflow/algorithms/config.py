"""`algorithm`: the advantage estimator, the KL in the reward, the old log-probs' source, DAPO's group
filter, the distillation reward's weights (typed defaults; comments in `config/ppo_trainer.yaml`), the names the algorithms know, and the
section's own check."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from hflow.algorithms import core_algos
from hflow.config_schema import ConfigError, ConfigErrors, check_choice, check_fraction, check_non_negative, check_positive, check_positive_number

LOSS_AGG_MODES = tuple(mode.value for mode in core_algos.LossAggMode)
KL_TYPES = core_algos.KL_PENALTY_NAMES  # each also with a trailing '+' (straight-through gradient)
KL_CONTROLLERS = ("fixed", "adaptive")
# Estimators that compare the samples of one prompt: they need rollout.n >= 2.
GROUP_ESTIMATORS = ("grpo", "grpo_passk", "rloo", "opo", "reinforce_plus_plus_baseline", "gdpo")
# What the step/turn rewards of multi-turn episodes (tools, environments, simulated users) do.
TURN_REWARD_MODES = ("ignore", "token", "turn_return")


@dataclass
class KLControlConfig:
    type: str = "fixed"
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


@dataclass
class FilterGroupsConfig:
    enable: bool = False  # DAPO dynamic sampling: drop prompt groups whose samples all score the same
    metric: str = "score"  # score (sequence score) or a per-sample key the reward function returns (e.g. acc)
    max_num_gen_batches: int = 10  # generation batches per step before giving up; 0 = no limit


@dataclass
class DistillConfig:
    coef: float = 0.0  # weight of the per-token reverse-KL reward (teacher - student log-prob); > 0 needs a teacher
    task_reward_coef: float = 1.0  # weight of the task's reward beside it; 0 = pure distillation
    jsd_coef: float = 0.0  # weight of GKD's generalized JSD to the teacher's top-k in the actor's loss; > 0 needs a teacher
    jsd_beta: float = 0.5  # its beta in [0, 1]: 0 = forward KL(teacher || student), 1 = reverse KL(student || teacher)


@dataclass
class RolloutMaskConfig:
    token_low: Optional[float] = None  # IcePop: a token whose ratio pi_old / pi_rollout is below gets weight 0
    token_high: Optional[float] = None  # ... or above
    sequence_low: Optional[float] = None  # a response whose geometric-mean ratio is below gets weight 0
    sequence_high: Optional[float] = None  # ... or above


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "gae"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_rollout_log_probs: bool = False
    reuse_update_log_probs: Optional[bool] = None  # None = wherever it is exact (reuses_update_log_probs)
    rollout_check_freq: int = 10  # with reused log-probs: the separate pass (and its checks) every N steps
    rollout_is: Optional[str] = None  # token | sequence: truncated IS weights pi_old / pi_rollout on the pg loss
    rollout_is_threshold: float = 2.0  # C, the truncation of those weights
    rollout_mask: RolloutMaskConfig = field(default_factory=RolloutMaskConfig)
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    reward_clip: Optional[float] = None  # clip each sequence's score to [-c, c] before the KL penalty
    stop_token: Optional[str] = None  # the reward sees each response cut after this (one-token) text
    missing_stop_penalty: Optional[float] = None  # the score of a response without stop_token
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)


    reward_weights: Any = None  # GDPO: {name: weight} of the reward function's dict keys ('score' = its score); null = off
    turn_rewards: str = "ignore"  # ignore | token (added on their turn's last token) | turn_return (GRPO on turn returns)
    turn_gamma: float = 1.0  # turn_return: the discount per turn


def check_adv_estimator(algo) -> None:
    known = [e.value for e in core_algos.AdvantageEstimator]
    if algo.adv_estimator not in known:
        raise ConfigError(f"algorithm.adv_estimator={algo.adv_estimator!r} is unknown; choose from {known}")


def check_kl_in_reward(algo) -> None:
    if not algo.use_kl_in_reward:
        return
    errors = ConfigErrors()
    errors.run(check_choice, algo.kl_penalty.removesuffix("+"), KL_TYPES, "algorithm.kl_penalty")
    errors.run(check_choice, algo.kl_ctrl.type, KL_CONTROLLERS, "algorithm.kl_ctrl.type")
    errors.run(check_non_negative, algo.kl_ctrl.kl_coef, "algorithm.kl_ctrl.kl_coef")
    if algo.kl_ctrl.type == "adaptive":
        errors.run(check_positive_number, algo.kl_ctrl.target_kl, "algorithm.kl_ctrl.target_kl")
        errors.run(check_positive, algo.kl_ctrl.horizon, "algorithm.kl_ctrl.horizon")
    errors.raise_any()


def check_discount(algo) -> None:
    """`algorithm.gamma` and `.lam`: GAE's discount and trace decay, each in [0, 1]."""
    errors = ConfigErrors()
    errors.run(check_fraction, algo.gamma, "algorithm.gamma", "the discount per token")
    errors.run(check_fraction, algo.lam, "algorithm.lam", "GAE's lambda")
    errors.raise_any()


def check_old_log_probs(algo) -> None:
    """Where the old log-probs come from: at most one replacement of the separate pass, and its frequency."""
    if algo.reuse_update_log_probs and algo.use_rollout_log_probs:
        raise ConfigError("algorithm.reuse_update_log_probs and algorithm.use_rollout_log_probs both replace the "
                          "old log-prob pass; set only one of them")
    if int(algo.rollout_check_freq) < 0:
        raise ConfigError(f"algorithm.rollout_check_freq={algo.rollout_check_freq}: give N >= 1 (the separate old-log-prob "
                          "pass every N steps when the update reuses its own) or 0 (never)")


def check_reward_clip(algo) -> None:
    """`algorithm.reward_clip` and `.missing_stop_penalty` (the stop token itself is checked against the
    policy tokenizer, by the trainer's preflight)."""
    if algo.reward_clip is not None and not float(algo.reward_clip) > 0:
        raise ConfigError(f"algorithm.reward_clip must be a positive number (or null: no clipping), got {algo.reward_clip}")
    if algo.missing_stop_penalty is not None and algo.stop_token is None:
        raise ConfigError("algorithm.missing_stop_penalty scores the responses without algorithm.stop_token, which is "
                          "null; set algorithm.stop_token too, or algorithm.missing_stop_penalty=null")


def check_distill_coefs(algo) -> None:
    """`algorithm.distill`: the weights >= 0, beta in [0, 1], something to learn from, and no ReMax baseline
    under a reward the baseline does not contain (the teacher itself: `check_teacher`)."""
    distill = algo.distill
    errors = ConfigErrors()
    errors.run(check_non_negative, distill.coef, "algorithm.distill.coef", "0: no distillation reward")
    errors.run(check_non_negative, distill.task_reward_coef, "algorithm.distill.task_reward_coef",
               "0: pure distillation")
    errors.run(check_non_negative, distill.jsd_coef, "algorithm.distill.jsd_coef", "0: no JSD term")
    errors.run(check_fraction, distill.jsd_beta, "algorithm.distill.jsd_beta",
               "0: forward KL(teacher || student), 1: reverse KL(student || teacher)")
    errors.raise_any()
    if float(distill.coef) == 0 and float(distill.task_reward_coef) == 0 and float(distill.jsd_coef) == 0:
        raise ConfigError("algorithm.distill.coef=0, algorithm.distill.jsd_coef=0 and "
                          "algorithm.distill.task_reward_coef=0 leave no reward to learn from and no teacher to "
                          "follow; set algorithm.distill.coef or jsd_coef > 0 (with teacher.model.path) or "
                          "task_reward_coef > 0")
    # ReMax's baseline is the task score of each prompt's greedy response, which is never distilled (the
    # teacher scores the sampled responses only) nor weighted: returns and baseline would be on other scales.
    mixed = float(distill.coef) > 0 or (float(distill.jsd_coef) > 0 and float(distill.task_reward_coef) != 1)
    if algo.adv_estimator == "remax" and mixed:
        raise ConfigError(
            f"algorithm.adv_estimator=remax subtracts the task score of each prompt's greedy response, but the "
            f"reward trained on is task_reward_coef x score + coef x the distillation reward (algorithm.distill.coef="
            f"{float(distill.coef):g}, task_reward_coef={float(distill.task_reward_coef):g}), which that baseline "
            "does not contain: the advantages would be biased by the distillation reward. Use adv_estimator=grpo, "
            "rloo or gae with distillation, or distill with algorithm.distill.jsd_coef alone (coef=0, "
            "task_reward_coef=1)")


def check_reward_weights(algo) -> None:
    """`algorithm.reward_weights` exactly with `adv_estimator=gdpo`: a mapping of names to finite weights, not
    all 0 (that the reward function returns each name: the reward probe). GDPO builds the advantage from these
    rewards alone, so a KL penalty in the reward would be ignored: refused."""
    weights, gdpo = algo.get("reward_weights"), algo.adv_estimator == "gdpo"
    if weights is None:
        if gdpo:
            raise ConfigError("algorithm.adv_estimator=gdpo normalizes several named rewards, but "
                              "algorithm.reward_weights is null; give them, e.g. algorithm.reward_weights="
                              "'{correct: 1.0, format: 0.5}' (keys of the dict your reward function returns)")
        return
    if not gdpo:
        raise ConfigError(f"algorithm.reward_weights is set but algorithm.adv_estimator={algo.adv_estimator}; the "
                          "weights are read by adv_estimator=gdpo only (set it), or set reward_weights=null")
    if not hasattr(weights, "items") or len(weights) == 0:
        raise ConfigError(f"algorithm.reward_weights={weights!r} must map reward names to weights, e.g. "
                          "'{correct: 1.0, format: 0.5}'")
    errors = ConfigErrors()
    for name, weight in weights.items():
        with errors.catch():
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
                raise ConfigError(f"algorithm.reward_weights.{name}={weight!r} must be a finite number (the weight "
                                  "of that reward's group-normalized advantage)")
    errors.raise_any()
    if all(float(w) == 0 for w in weights.values()):
        raise ConfigError("algorithm.reward_weights are all 0: no reward to learn from; give one a weight != 0")
    if algo.use_kl_in_reward:
        raise ConfigError("algorithm.adv_estimator=gdpo builds the advantage from algorithm.reward_weights' rewards, "
                          "not from the KL-penalised token rewards; use actor_rollout_ref.actor.use_kl_loss=true "
                          "instead of algorithm.use_kl_in_reward")
    # the other rewards that live only in the token-level rewards, which gdpo does not read
    distill_coef = float(algo.distill.coef or 0.0)
    if distill_coef > 0:
        raise ConfigError(f"algorithm.adv_estimator=gdpo does not read the token-level rewards, so the distillation "
                          f"reward (algorithm.distill.coef={distill_coef:g}) would be ignored; set distill.coef=0 "
                          "(distill.jsd_coef works: it is in the actor's loss) or use adv_estimator=grpo")
    if algo.turn_rewards != "ignore":
        raise ConfigError(f"algorithm.adv_estimator=gdpo does not read the token-level rewards, so "
                          f"algorithm.turn_rewards={algo.turn_rewards} would be ignored; set turn_rewards=ignore")


def check_turn_rewards(algo) -> None:
    """`algorithm.turn_rewards`: a known mode, `turn_return` only with GRPO (the estimator it replaces),
    `turn_gamma` in [0, 1]."""
    check_choice(algo.turn_rewards, TURN_REWARD_MODES, "algorithm.turn_rewards")
    check_fraction(algo.turn_gamma, "algorithm.turn_gamma", "the discount per turn")
    if algo.turn_rewards == "turn_return" and algo.adv_estimator != "grpo":
        raise ConfigError(f"algorithm.turn_rewards=turn_return computes GRPO's advantages on turn-level returns, but "
                          f"algorithm.adv_estimator={algo.adv_estimator}; use adv_estimator=grpo, or "
                          "turn_rewards=token (the rewards on their turn's last token, which gae and the outcome "
                          "estimators read)")


def rollout_mask_bands(algo) -> tuple[tuple[Optional[float], Optional[float]], tuple[Optional[float], Optional[float]]]:
    """(token band, sequence band) of `algorithm.rollout_mask`, each (low, high) with None for an open side."""
    mask = algo.rollout_mask
    low_high = [None if mask.get(key) is None else float(mask.get(key))
                for key in ("token_low", "token_high", "sequence_low", "sequence_high")]
    return (low_high[0], low_high[1]), (low_high[2], low_high[3])


def rollout_mask_on(algo) -> bool:
    """Whether `algorithm.rollout_mask` sets any bound."""
    return any(b is not None for band in rollout_mask_bands(algo) for b in band)


def check_rollout_mask(algo) -> None:
    """`algorithm.rollout_mask`: each bound null or > 0, low < high, and a band around 1 (one that leaves 1
    out would reject exactly the samples on which the sampler and the trainer agree)."""
    errors = ConfigErrors()
    mask = algo.rollout_mask
    for level in ("token", "sequence"):
        low_key, high_key = f"{level}_low", f"{level}_high"
        low, high = mask.get(low_key), mask.get(high_key)
        ok = errors.run(check_positive_number, low, f"algorithm.rollout_mask.{low_key}", null_ok=True)
        ok &= errors.run(check_positive_number, high, f"algorithm.rollout_mask.{high_key}", null_ok=True)
        if not ok:
            continue
        with errors.catch():
            if low is not None and high is not None and not float(low) < float(high):
                raise ConfigError(f"algorithm.rollout_mask.{low_key}={low} must be < algorithm.rollout_mask.{high_key}"
                                  f"={high}: the band of ratios pi_old / pi_rollout kept in the loss")
            if low is not None and float(low) > 1:
                raise ConfigError(f"algorithm.rollout_mask.{low_key}={low} is above 1, so it would mask the samples the "
                                  "sampler and trainer agree on (ratio 1); give a lower bound <= 1 (IcePop: 0.5)")
            if high is not None and float(high) < 1:
                raise ConfigError(f"algorithm.rollout_mask.{high_key}={high} is below 1, so it would mask the samples "
                                  "the sampler and trainer agree on (ratio 1); give an upper bound >= 1 (IcePop: 2)")
    errors.raise_any()
