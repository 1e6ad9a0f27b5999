#!/usr/bin/env bash
# DAPO (clip-higher, dynamic sampling, token-level loss, soft overlong punishment, no KL) with
# Qwen2.5-7B on DAPO-Math-style data on one node of 8 GPUs.
#   TRAIN_FILES=~/data/dapo-math-17k.parquet VAL_FILES=~/data/aime-2024.parquet MODEL=~/models/Qwen2.5-7B \
#     bash examples/dapo/run_dapo_8gpu.sh [more key=value overrides]
# The parquet files follow the data schema of examples/data_preprocess/gsm8k.py (prompt, data_source,
# reward_model.ground_truth). Their data_source must have a built-in scorer (e.g. lighteval/MATH for boxed
# answers), or set REWARD_FN to a Python file defining compute_score (DAPO's own "Answer:" format).
# 512 prompts x 16 samples per step (dynamic sampling draws more prompts until 512 informative groups
# remain), mini-batches of 32 prompts; responses up to 20480 tokens, the last 4096 penalised.
set -euo pipefail
TRAIN_FILES=${TRAIN_FILES:?set TRAIN_FILES to the training parquet}
VAL_FILES=${VAL_FILES:?set VAL_FILES to the validation parquet}
MODEL=${MODEL:-$HOME/models/Qwen2.5-7B}
REWARD_FN=${REWARD_FN:-}

reward_args=()
if [[ -n "$REWARD_FN" ]]; then
  reward_args=(custom_reward_function.path="$REWARD_FN")
fi

python3 -m hflow.trainer.main_ppo \
  algorithm.adv_estimator=grpo \
  algorithm.use_kl_in_reward=false \
  algorithm.filter_groups.enable=true \
  algorithm.filter_groups.metric=score \
  algorithm.filter_groups.max_num_gen_batches=10 \
  reward_model.overlong_buffer.enable=true \
  reward_model.overlong_buffer.len=4096 \
  reward_model.overlong_buffer.penalty_factor=1.0 \
  data.train_files="$TRAIN_FILES" \
  data.val_files="$VAL_FILES" \
  data.train_batch_size=512 \
  data.max_prompt_length=2048 \
  data.max_response_length=20480 \
  actor_rollout_ref.model.path="$MODEL" \
  actor_rollout_ref.model.enable_gradient_checkpointing=true \
  actor_rollout_ref.actor.optim.lr=1e-6 \
  actor_rollout_ref.actor.optim.weight_decay=0.1 \
  actor_rollout_ref.actor.ppo_mini_batch_size=32 \
  actor_rollout_ref.actor.use_dynamic_bsz=true \
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu=22528 \
  actor_rollout_ref.actor.clip_ratio_low=0.2 \
  actor_rollout_ref.actor.clip_ratio_high=0.28 \
  actor_rollout_ref.actor.loss_agg_mode=token-mean \
  actor_rollout_ref.actor.use_kl_loss=false \
  actor_rollout_ref.actor.entropy_coeff=0 \
  actor_rollout_ref.actor.grad_clip=1.0 \
  actor_rollout_ref.actor.fsdp_config.param_offload=true \
  actor_rollout_ref.actor.fsdp_config.optimizer_offload=true \
  actor_rollout_ref.rollout.name=vllm \
  actor_rollout_ref.rollout.n=16 \
  actor_rollout_ref.rollout.temperature=1.0 \
  actor_rollout_ref.rollout.top_p=1.0 \
  actor_rollout_ref.rollout.tensor_model_parallel_size=4 \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.8 \
  actor_rollout_ref.rollout.val_kwargs.do_sample=true \
  actor_rollout_ref.rollout.val_kwargs.temperature=1.0 \
  actor_rollout_ref.rollout.val_kwargs.top_p=0.7 \
  actor_rollout_ref.rollout.val_kwargs.n=1 \
  trainer.n_gpus_per_node=8 \
  trainer.nnodes=1 \
  trainer.logger=[console,jsonl,tensorboard] \
  trainer.project_name=hflow_dapo \
  trainer.experiment_name=qwen2_5_7b_dapo \
  trainer.save_freq=10 \
  trainer.test_freq=5 \
  trainer.total_epochs=1 "${reward_args[@]}" "$@"
