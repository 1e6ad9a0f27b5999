#!/usr/bin/env bash
# The classic RLHF pipeline on the built-in task, end to end on 2 CPU cores (about 5 minutes):
#
#   bash examples/rlhf_pipeline/run.sh OUT_DIR [SEED]
#
#   1. SFT      the built-in model on demonstrations (main_sft)             -> OUT_DIR/sft/huggingface
#   2. RM       a reward model from the SFT model, on preference pairs      -> OUT_DIR/rm/huggingface
#               labelled by a hidden rule (main_rm)
#   3. PPO      the SFT policy against the learned reward model (main_ppo): GAE with a critic that starts
#               from the reward model, KL penalty in the reward, reward normalisation -> OUT_DIR/ppo/...
#   4. summary  greedy answers to held-out questions scored by the hidden rule (never trained on) and by
#               the reward model, before and after PPO -> OUT_DIR/summary.json
#
# Sets up its own environment (scripts/setup.sh). Extra settings: edit the stage commands below; every key
# is documented in config/{sft,rm,ppo}_trainer.yaml.
set -euo pipefail
if [[ $# -lt 1 ]]; then
  echo "usage: bash examples/rlhf_pipeline/run.sh OUT_DIR [SEED]" >&2
  exit 2
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="$(mkdir -p "$1" && cd "$1" && pwd)"
SEED="${2:-1}"
cd "$ROOT"
bash scripts/setup.sh >/dev/null
PY="${HFLOW_VENV:-$ROOT/.venv}/bin/python"
DATA="$("$PY" -c 'from hflow.tasks.rlhf_task import ensure_rlhf_task_data as d; print(d().root)')"
COMMON=(trainer.n_gpus_per_node=2 trainer.logger=[console,jsonl] trainer.seed="$SEED")
STARTED=$SECONDS

echo "== 1/3 SFT"
"$PY" -m hflow.trainer.main_sft "${COMMON[@]}" data.seed="$SEED" \
  trainer.default_local_dir="$OUT/sft" trainer.log_dir="$OUT/logs/sft" trainer.resume_mode=disable

echo "== 2/3 reward model"
"$PY" -m hflow.trainer.main_rm "${COMMON[@]}" data.seed="$SEED" \
  model.path="$OUT/sft/huggingface" data.train_files="$DATA/rm_train.parquet" data.val_files="$DATA/rm_val.parquet" \
  data.max_length=64 data.micro_batch_size_per_gpu=16 optim.lr=1e-3 optim.lr_warmup_steps=5 optim.warmup_style=cosine \
  trainer.total_epochs=2 trainer.test_freq=10 \
  trainer.default_local_dir="$OUT/rm" trainer.log_dir="$OUT/logs/rm" trainer.resume_mode=disable

echo "== 3/3 PPO against the reward model"
PPO_STEPS=20
"$PY" -m hflow.trainer.main_ppo "${COMMON[@]}" data.seed="$SEED" actor_rollout_ref.rollout.seed="$SEED" \
  actor_rollout_ref.model.path="$OUT/sft/huggingface" \
  data.train_files="$DATA/ppo_train.parquet" data.val_files="$DATA/ppo_val.parquet" \
  data.max_prompt_length=32 data.max_response_length=16 data.train_batch_size=32 \
  reward_model.enable=true reward_model.model.path="$OUT/rm/huggingface" reward_model.normalize.enable=true \
  critic.model.path="$OUT/rm/huggingface" \
  algorithm.adv_estimator=gae algorithm.use_kl_in_reward=true algorithm.kl_ctrl.kl_coef=0.05 \
  actor_rollout_ref.rollout.n=4 actor_rollout_ref.actor.ppo_mini_batch_size=16 \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32 actor_rollout_ref.actor.optim.lr=2e-4 critic.optim.lr=1e-3 \
  actor_rollout_ref.actor.checkpoint.contents=[hf_model] trainer.save_freq=$PPO_STEPS \
  trainer.total_training_steps=$PPO_STEPS trainer.test_freq=5 \
  trainer.default_local_dir="$OUT/ppo" trainer.log_dir="$OUT/logs/ppo" trainer.resume_mode=disable

echo "== summary"
"$PY" examples/rlhf_pipeline/summarize.py "$OUT" --ppo-policy "$OUT/ppo/global_step_$PPO_STEPS/actor/huggingface" \
  --seconds $((SECONDS - STARTED))
