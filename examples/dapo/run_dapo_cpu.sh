#!/usr/bin/env bash
# DAPO's recipe on the built-in arithmetic task (no data or model to fetch): a couple of minutes on 2 CPU cores.
#   bash examples/dapo/run_dapo_cpu.sh [more key=value overrides]
# Responses are at most 8 tokens (the answer is 2-3); the overlong buffer penalises those past 4.
# Sets up hflow's environment first (scripts/train.sh), so it runs on a fresh clone.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

bash "$ROOT/scripts/train.sh" \
  algorithm.adv_estimator=grpo \
  algorithm.use_kl_in_reward=false \
  algorithm.filter_groups.enable=true \
  algorithm.filter_groups.metric=score \
  algorithm.filter_groups.max_num_gen_batches=10 \
  reward_model.overlong_buffer.enable=true \
  reward_model.overlong_buffer.len=4 \
  reward_model.overlong_buffer.penalty_factor=1.0 \
  actor_rollout_ref.actor.clip_ratio_low=0.2 \
  actor_rollout_ref.actor.clip_ratio_high=0.28 \
  actor_rollout_ref.actor.loss_agg_mode=token-mean \
  actor_rollout_ref.actor.use_kl_loss=false \
  trainer.experiment_name=dapo_cpu \
  trainer.total_training_steps=10 \
  trainer.test_freq=2 "$@"
