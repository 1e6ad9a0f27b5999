#!/usr/bin/env bash
# Multi-turn GRPO on GSM8K with Qwen2.5-3B-Instruct calling a sandboxed Python tool, on one node of 8 GPUs.
#   1. python examples/data_preprocess/gsm8k.py --from_hub --tools python --local_dir ~/data/gsm8k_python
#   2. huggingface-cli download Qwen/Qwen2.5-3B-Instruct --local-dir ~/models/Qwen2.5-3B-Instruct
#   3. bash examples/agent/run_qwen2_5_3b_gsm8k_python.sh [more key=value overrides]
# Qwen2.5 writes tool calls in the Hermes format (<tool_call>{"name": "python", "arguments": {...}}</tool_call>)
# and its chat template renders the tool schema into the system prompt. Each episode is at most 4 assistant
# turns within 2048 response tokens (tool results count towards them and get no loss); the reward judges
# the final answer after "####".
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DATA=${DATA:-$HOME/data/gsm8k_python}
MODEL=${MODEL:-$HOME/models/Qwen2.5-3B-Instruct}

python3 -m hflow.trainer.main_ppo \
  algorithm.adv_estimator=grpo \
  data.train_files="$DATA/train.parquet" \
  data.val_files="$DATA/test.parquet" \
  data.train_batch_size=256 \
  data.max_prompt_length=1024 \
  data.max_response_length=2048 \
  actor_rollout_ref.model.path="$MODEL" \
  actor_rollout_ref.model.enable_gradient_checkpointing=true \
  actor_rollout_ref.actor.optim.lr=1e-6 \
  actor_rollout_ref.actor.ppo_mini_batch_size=64 \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
  actor_rollout_ref.actor.use_kl_loss=true \
  actor_rollout_ref.actor.kl_loss_coef=0.001 \
  actor_rollout_ref.actor.kl_loss_type=low_var_kl \
  actor_rollout_ref.rollout.name=vllm \
  actor_rollout_ref.rollout.n=8 \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.5 \
  actor_rollout_ref.rollout.multi_turn.enable=true \
  actor_rollout_ref.rollout.multi_turn.format=hermes \
  actor_rollout_ref.rollout.multi_turn.tool_config_path="$HERE/python_tool.yaml" \
  actor_rollout_ref.rollout.multi_turn.max_assistant_turns=4 \
  actor_rollout_ref.rollout.multi_turn.max_tool_response_length=1000 \
  actor_rollout_ref.rollout.multi_turn.tool_timeout_s=20 \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 \
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16 \
  algorithm.use_kl_in_reward=false \
  trainer.n_gpus_per_node=8 \
  trainer.nnodes=1 \
  trainer.logger=[console,jsonl,tensorboard] \
  trainer.project_name=hflow_agent \
  trainer.experiment_name=qwen2_5_3b_gsm8k_python \
  trainer.rollout_data_dir=rollouts \
  trainer.save_freq=20 \
  trainer.test_freq=5 \
  trainer.total_epochs=5 "$@"
