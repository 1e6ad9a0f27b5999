#!/usr/bin/env bash
# The GRPO-iteration benchmark from a fresh clone, in one command: sets up hflow's environment
# (idempotent), then runs bench/grpo_step.py, which installs TRL into bench/.venv-trl and converts
# SmolLM2-135M on first use. Arguments go to grpo_step.py, e.g.
#   bash bench/grpo_step.sh --workloads builtin --systems hflow,minimal
# Run it on an otherwise idle machine: with other processes on the cores, OpenMP threads that spin
# while waiting make multi-threaded runs (minimal loop, TRL, hflow-1w) several times slower.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec "${HFLOW_VENV:-.venv}/bin/python" bench/grpo_step.py "$@"
