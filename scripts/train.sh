#!/usr/bin/env bash
# Set up the environment (idempotent) and train: every argument is a Hydra override, e.g.
#   scripts/train.sh algorithm.adv_estimator=grpo
# With no data or model given, it trains the built-in small model on the built-in arithmetic task.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec "${HFLOW_VENV:-.venv}/bin/python" -m hflow.trainer.main_ppo "$@"
