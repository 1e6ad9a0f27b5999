#!/usr/bin/env bash
# The classic RLHF pipeline on the built-in task, end to end on 2 CPU cores (about 5 minutes):
#
#   bash examples/rlhf_pipeline/run.sh OUT_DIR [SEED]
#
#   1. SFT      the built-in model on demonstrations (main_sft)             -> OUT_DIR/sft/huggingface
#   2. RM       a reward model from the SFT model, on preference pairs      -> OUT_DIR/rm/huggingface
#               labelled by a hidden preference: right number first, then the house style (main_rm)
#   3. PPO      the SFT policy against the learned reward model (main_ppo): GAE with a critic that starts
#               from the reward model, KL penalty in the reward, reward normalisation -> OUT_DIR/ppo/...
#   4. summary  greedy answers to held-out questions before and after PPO: exact-correct rate, house-style
#               share, hidden score (never trained on) and reward-model score; the reward model's accuracy
#               on held-out pairs per kind; a reward-hacking flag -> OUT_DIR/summary.json
#
# Sets up its own environment (scripts/setup.sh). Lengths, for a shorter run (the test suite's) or a
# longer one: RLHF_SFT_EPOCHS, RLHF_RM_EPOCHS, RLHF_PPO_STEPS; every other key is documented in
# config/{sft,rm,ppo}_trainer.yaml (edit the stage commands below).
set -euo pipefail
if [[ $# -lt 1 ]]; then
  echo "usage: bash examples/rlhf_pipeline/run.sh OUT_DIR [SEED]" >&2
  exit 2
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="$(mkdir -p "$1" && cd "$1" && pwd)"
SEED="${2:-1}"
SFT_EPOCHS="${RLHF_SFT_EPOCHS:-12}"
RM_EPOCHS="${RLHF_RM_EPOCHS:-4}"
PPO_STEPS="${RLHF_PPO_STEPS:-20}"
cd "$ROOT"
bash scripts/setup.sh >/dev/null
PY="${HFLOW_VENV:-$ROOT/.venv}/bin/python"
DATA="$("$PY" -c 'from hflow.tasks.rlhf_task import ensure_rlhf_task_data as d; print(d().root)')"
# RLHF_PLACEMENT_ARGS replaces the two Ray workers (e.g. "trainer.backend=local trainer.n_gpus_per_node=1",
# one process, as the test suite runs it); RLHF_PPO_ARGS adds keys to the PPO stage (e.g. rollout.name=hf).
read -r -a PLACEMENT <<<"${RLHF_PLACEMENT_ARGS:-trainer.n_gpus_per_node=2}"
read -r -a PPO_EXTRA <<<"${RLHF_PPO_ARGS:-}"
COMMON=("${PLACEMENT[@]}" trainer.logger=[console,jsonl] trainer.seed="$SEED")
STARTED=$SECONDS

echo "== 1/3 SFT"
"$PY" -m hflow.trainer.main_sft "${COMMON[@]}" data.seed="$SEED" trainer.total_epochs="$SFT_EPOCHS" \
  trainer.default_local_dir="$OUT/sft" trainer.log_dir="$OUT/logs/sft" trainer.resume_mode=disable

echo "== 2/3 reward model"
"$PY" -m hflow.trainer.main_rm "${COMMON[@]}" data.seed="$SEED" \
  model.path="$OUT/sft/huggingface" data.train_files="$DATA/rm_train.parquet" data.val_files="$DATA/rm_val.parquet" \
  data.max_length=64 data.micro_batch_size_per_gpu=16 optim.lr=1e-3 optim.lr_warmup_steps=10 optim.warmup_style=cosine \
  trainer.total_epochs="$RM_EPOCHS" trainer.test_freq=50 \
  trainer.default_local_dir="$OUT/rm" trainer.log_dir="$OUT/logs/rm" trainer.resume_mode=disable

echo "== 3/3 PPO against the reward model"
"$PY" -m hflow.trainer.main_ppo "${COMMON[@]}" data.seed="$SEED" actor_rollout_ref.rollout.seed="$SEED" \
  actor_rollout_ref.model.path="$OUT/sft/huggingface" \
  data.train_files="$DATA/ppo_train.parquet" data.val_files="$DATA/ppo_val.parquet" \
  data.max_prompt_length=32 data.max_response_length=16 data.train_batch_size=32 \
  reward_model.enable=true reward_model.model.path="$OUT/rm/huggingface" reward_model.normalize.enable=true \
  critic.model.path="$OUT/rm/huggingface" \
  algorithm.adv_estimator=gae algorithm.use_kl_in_reward=true algorithm.kl_ctrl.kl_coef=0.05 \
  actor_rollout_ref.rollout.n=4 actor_rollout_ref.actor.ppo_mini_batch_size=16 \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32 actor_rollout_ref.actor.optim.lr=2e-4 critic.optim.lr=1e-3 \
  actor_rollout_ref.actor.checkpoint.contents=[hf_model] trainer.save_freq="$PPO_STEPS" \
  trainer.total_training_steps="$PPO_STEPS" trainer.test_freq=5 \
  trainer.default_local_dir="$OUT/ppo" trainer.log_dir="$OUT/logs/ppo" trainer.resume_mode=disable \
  "${PPO_EXTRA[@]}"

echo "== summary"
"$PY" examples/rlhf_pipeline/summarize.py "$OUT" --ppo-policy "$OUT/ppo/global_step_$PPO_STEPS/actor/huggingface" \
  --option seed="$SEED" --option sft_epochs="$SFT_EPOCHS" --option rm_epochs="$RM_EPOCHS" \
  --option ppo_steps="$PPO_STEPS" --option seconds=$((SECONDS - STARTED))
