#!/usr/bin/env bash
# PPO with a critic (GAE) on GSM8K with Qwen2.5-3B-Instruct on one node of 8 GPUs.
# Data and model as in run_qwen2_5_3b_grpo.sh. The critic starts from the same weights with a value head
# and shares each GPU's process with the actor, rollout and reference (colocated roles).
set -euo pipefail
DATA=${DATA:-$HOME/data/gsm8k}
MODEL=${MODEL:-$HOME/models/Qwen2.5-3B-Instruct}

python3 -m hflow.trainer.main_ppo \
  algorithm.adv_estimator=gae \
  algorithm.gamma=1.0 \
  algorithm.lam=1.0 \
  data.train_files="$DATA/train.parquet" \
  data.val_files="$DATA/test.parquet" \
  data.train_batch_size=1024 \
  data.max_prompt_length=512 \
  data.max_response_length=512 \
  actor_rollout_ref.model.path="$MODEL" \
  actor_rollout_ref.model.enable_gradient_checkpointing=true \
  actor_rollout_ref.actor.optim.lr=1e-6 \
  actor_rollout_ref.actor.ppo_mini_batch_size=256 \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 \
  actor_rollout_ref.rollout.n=1 \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.5 \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 \
  critic.model.path="$MODEL" \
  critic.model.enable_gradient_checkpointing=true \
  critic.optim.lr=1e-5 \
  critic.ppo_micro_batch_size_per_gpu=16 \
  algorithm.use_kl_in_reward=true \
  algorithm.kl_ctrl.kl_coef=0.001 \
  trainer.critic_warmup=0 \
  trainer.n_gpus_per_node=8 \
  trainer.nnodes=1 \
  trainer.logger=[console,jsonl,tensorboard] \
  trainer.project_name=hflow_gsm8k \
  trainer.experiment_name=qwen2_5_3b_ppo \
  trainer.save_freq=20 \
  trainer.test_freq=5 \
  trainer.total_epochs=15 "$@"
