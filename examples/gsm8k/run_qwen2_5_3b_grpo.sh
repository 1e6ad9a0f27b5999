#!/usr/bin/env bash
# GRPO on GSM8K with Qwen2.5-3B-Instruct on one node of 8 GPUs.
#   1. python examples/data_preprocess/gsm8k.py --from_hub --local_dir ~/data/gsm8k
#   2. huggingface-cli download Qwen/Qwen2.5-3B-Instruct --local-dir ~/models/Qwen2.5-3B-Instruct
#   3. bash examples/gsm8k/run_qwen2_5_3b_grpo.sh [more key=value overrides]
# 1024 prompts x 5 samples per step; 4 optimizer steps per step (mini-batch 256 prompts); KL to the
# reference as a loss term (GRPO style), none in the reward.
set -euo pipefail
DATA=${DATA:-$HOME/data/gsm8k}
MODEL=${MODEL:-$HOME/models/Qwen2.5-3B-Instruct}

python3 -m hflow.trainer.main_ppo \
  algorithm.adv_estimator=grpo \
  data.train_files="$DATA/train.parquet" \
  data.val_files="$DATA/test.parquet" \
  data.train_batch_size=1024 \
  data.max_prompt_length=512 \
  data.max_response_length=1024 \
  actor_rollout_ref.model.path="$MODEL" \
  actor_rollout_ref.model.enable_gradient_checkpointing=true \
  actor_rollout_ref.actor.optim.lr=1e-6 \
  actor_rollout_ref.actor.ppo_mini_batch_size=256 \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 \
  actor_rollout_ref.actor.use_kl_loss=true \
  actor_rollout_ref.actor.kl_loss_coef=0.001 \
  actor_rollout_ref.actor.kl_loss_type=low_var_kl \
  actor_rollout_ref.actor.entropy_coeff=0 \
  actor_rollout_ref.rollout.name=vllm \
  actor_rollout_ref.rollout.n=5 \
  actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 \
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32 \
  algorithm.use_kl_in_reward=false \
  trainer.n_gpus_per_node=8 \
  trainer.nnodes=1 \
  trainer.logger=[console,jsonl,tensorboard] \
  trainer.project_name=hflow_gsm8k \
  trainer.experiment_name=qwen2_5_3b_grpo \
  trainer.save_freq=20 \
  trainer.test_freq=5 \
  trainer.total_epochs=15 "$@"
