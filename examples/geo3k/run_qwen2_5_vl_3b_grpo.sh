#!/usr/bin/env bash
# GRPO on Geometry3K (a diagram and a question per prompt) with Qwen2.5-VL-3B-Instruct on one node of 8 GPUs.
#   1. python examples/data_preprocess/geo3k.py --from_hub --local_dir ~/data/geo3k
#   2. huggingface-cli download Qwen/Qwen2.5-VL-3B-Instruct --local-dir ~/models/Qwen2.5-VL-3B-Instruct
#   3. bash examples/geo3k/run_qwen2_5_vl_3b_grpo.sh [more key=value overrides]
# 512 prompts x 5 samples per step, 4 optimizer steps per step; the vision encoder frozen (the language model
# learns to reason over what it sees); KL to the reference as a loss term. Images are sampled with the HF
# rollout, the tested path; actor_rollout_ref.rollout.name=vllm sends them as multi_modal_data but has not yet
# run on a GPU (README, "Images"). Image tokens count in the prompt length (a 448x448 diagram is 256 of them).
set -euo pipefail
DATA=${DATA:-$HOME/data/geo3k}
MODEL=${MODEL:-$HOME/models/Qwen2.5-VL-3B-Instruct}

python3 -m hflow.trainer.main_ppo \
  algorithm.adv_estimator=grpo \
  data.train_files="$DATA/train.parquet" \
  data.val_files="$DATA/test.parquet" \
  data.image_key=images \
  data.train_batch_size=512 \
  data.max_prompt_length=1024 \
  data.max_response_length=1024 \
  data.filter_overlong_prompts=true \
  actor_rollout_ref.model.path="$MODEL" \
  actor_rollout_ref.model.enable_gradient_checkpointing=true \
  actor_rollout_ref.actor.freeze_vision_tower=true \
  actor_rollout_ref.actor.optim.lr=1e-6 \
  actor_rollout_ref.actor.ppo_mini_batch_size=128 \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
  actor_rollout_ref.actor.use_kl_loss=true \
  actor_rollout_ref.actor.kl_loss_coef=0.01 \
  actor_rollout_ref.actor.kl_loss_type=low_var_kl \
  actor_rollout_ref.actor.entropy_coeff=0 \
  actor_rollout_ref.rollout.name=hf \
  actor_rollout_ref.rollout.n=5 \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 \
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16 \
  algorithm.use_kl_in_reward=false \
  trainer.n_gpus_per_node=8 \
  trainer.nnodes=1 \
  trainer.logger=[console,jsonl,tensorboard] \
  trainer.project_name=hflow_geo3k \
  trainer.experiment_name=qwen2_5_vl_3b_grpo \
  trainer.save_freq=20 \
  trainer.test_freq=5 \
  trainer.total_epochs=15 "$@"
