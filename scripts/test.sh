#!/usr/bin/env bash
# Set up the environment (idempotent) and run hflow's test suite. Extra arguments go to pytest,
# e.g. scripts/test.sh tests/test_protocol.py -k repeat
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec "${HFLOW_VENV:-.venv}/bin/python" -m pytest "${@:-tests}"
