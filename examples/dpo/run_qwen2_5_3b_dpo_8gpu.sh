#!/usr/bin/env bash
# DPO of Qwen2.5-3B-Instruct on UltraFeedback's preference pairs, on one node of 8 GPUs (never run by the
# project: no GPU node was available; the same command runs on the built-in task in the test suite).
#
#   huggingface-cli download HuggingFaceH4/ultrafeedback_binarized --repo-type dataset --local-dir ~/data/ultrafeedback
#   huggingface-cli download Qwen/Qwen2.5-3B-Instruct --local-dir ~/models/Qwen2.5-3B-Instruct
#   bash examples/dpo/run_qwen2_5_3b_dpo_8gpu.sh [key=value ...]
#
# The parquet files are read as they are: `prompt` (text), `chosen` and `rejected` (the conversation, ending
# with the reply; the prompt they repeat is not counted twice). Every GPU holds a shard of the policy and of
# the frozen reference (FSDP2); 64 pairs per step, 4 per micro-batch per GPU. The result,
# checkpoints/hflow_dpo/qwen2_5_3b_dpo/huggingface, is a folder main_ppo loads as
# actor_rollout_ref.model.path. A row whose two replies are identical stops the run before any model loads,
# with the rows named: drop them from the file first.
set -euo pipefail
DATA=${DATA:-$HOME/data/ultrafeedback/data}
MODEL=${MODEL:-$HOME/models/Qwen2.5-3B-Instruct}

python3 -m hflow.trainer.main_dpo \
  data.train_files="$DATA/train_prefs-00000-of-00001.parquet" \
  data.val_files="$DATA/test_prefs-00000-of-00001.parquet" \
  data.max_length=1024 \
  data.truncation=left \
  data.train_batch_size=64 \
  data.micro_batch_size_per_gpu=4 \
  data.val_batch_size=512 \
  model.path="$MODEL" \
  model.enable_gradient_checkpointing=true \
  dpo.beta=0.1 \
  dpo.loss_type=sigmoid \
  optim.lr=5e-7 \
  optim.lr_warmup_steps_ratio=0.1 \
  optim.warmup_style=cosine \
  trainer.n_gpus_per_node=8 \
  trainer.nnodes=1 \
  trainer.logger=[console,jsonl,tensorboard] \
  trainer.project_name=hflow_dpo \
  trainer.experiment_name=qwen2_5_3b_dpo \
  trainer.total_epochs=1 \
  trainer.test_freq=200 \
  trainer.save_freq=200 "$@"
