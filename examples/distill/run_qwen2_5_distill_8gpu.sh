#!/usr/bin/env bash
# On-policy distillation on one node of 8 GPUs: Qwen2.5-1.5B-Instruct (the student) samples GSM8K answers,
# Qwen2.5-7B-Instruct (the teacher, same tokenizer) scores every sampled token, and GRPO maximises the
# per-token reward  coef x (log pi_teacher - log pi_student)  (+ task_reward_coef x the GSM8K score).
#   TRAIN_FILES=~/data/gsm8k/train.parquet VAL_FILES=~/data/gsm8k/test.parquet \
#   STUDENT=~/models/Qwen2.5-1.5B-Instruct TEACHER=~/models/Qwen2.5-7B-Instruct \
#     bash examples/distill/run_qwen2_5_distill_8gpu.sh [more key=value overrides]
# Data: examples/data_preprocess/gsm8k.py. TASK_REWARD=0 (the default) is pure distillation; 1.0 adds the
# task's score. JSD_COEF > 0 adds GKD's generalized JSD (beta JSD_BETA) between the student and the teacher on
# the teacher's TOPK most likely tokens per position (plus one bucket for the rest) to the actor's loss;
# REVERSE_KL=0 with it leaves the JSD alone (GKD on the student's own samples). The teacher sits beside the actor on every GPU (FSDP2-sharded over 8, bf16) and is offloaded
# to host memory between its once-per-step passes; preflight stops a teacher whose tokenizer differs.
set -euo pipefail
TRAIN_FILES=${TRAIN_FILES:?set TRAIN_FILES to the training parquet}
VAL_FILES=${VAL_FILES:?set VAL_FILES to the validation parquet}
STUDENT=${STUDENT:-$HOME/models/Qwen2.5-1.5B-Instruct}
TEACHER=${TEACHER:-$HOME/models/Qwen2.5-7B-Instruct}
TASK_REWARD=${TASK_REWARD:-0.0}
REVERSE_KL=${REVERSE_KL:-1.0}
JSD_COEF=${JSD_COEF:-0.0}
JSD_BETA=${JSD_BETA:-0.5}
TOPK=${TOPK:-16}

python3 -m hflow.trainer.main_ppo \
  algorithm.adv_estimator=grpo \
  algorithm.distill.coef="$REVERSE_KL" \
  algorithm.distill.task_reward_coef="$TASK_REWARD" \
  algorithm.distill.jsd_coef="$JSD_COEF" \
  algorithm.distill.jsd_beta="$JSD_BETA" \
  teacher.model.path="$TEACHER" \
  teacher.topk="$TOPK" \
  teacher.log_prob_micro_batch_size_per_gpu=16 \
  teacher.fsdp_config.param_offload=true \
  data.train_files="$TRAIN_FILES" \
  data.val_files="$VAL_FILES" \
  data.train_batch_size=256 \
  data.max_prompt_length=512 \
  data.max_response_length=1024 \
  actor_rollout_ref.model.path="$STUDENT" \
  actor_rollout_ref.model.use_remove_padding=true \
  actor_rollout_ref.model.enable_gradient_checkpointing=true \
  actor_rollout_ref.actor.optim.lr=1e-6 \
  actor_rollout_ref.actor.ppo_mini_batch_size=64 \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 \
  actor_rollout_ref.actor.use_kl_loss=false \
  actor_rollout_ref.rollout.name=vllm \
  actor_rollout_ref.rollout.n=4 \
  actor_rollout_ref.rollout.temperature=1.0 \
  actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.5 \
  trainer.n_gpus_per_node=8 \
  trainer.nnodes=1 \
  trainer.logger=[console,jsonl] \
  trainer.project_name=hflow_distill \
  trainer.experiment_name=qwen2_5_1_5b_from_7b \
  trainer.save_freq=20 \
  trainer.test_freq=5 \
  trainer.total_epochs=2 "$@"
