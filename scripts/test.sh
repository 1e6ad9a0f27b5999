#!/usr/bin/env bash
# Set up the environment (idempotent) and run hflow's test suite.
#   scripts/test.sh [pytest options]          the whole suite, in two parts: first every test not marked
#                                             `alone`, two at a time (pytest-xdist, one test file per
#                                             worker: most tests spend much of their time starting
#                                             processes, Ray and engines, so two share the 2 cores well);
#                                             then the `alone` tests one by one (pyproject.toml says which)
#   scripts/test.sh PATH... [pytest options]  just those tests, one at a time, e.g.
#                                             scripts/test.sh tests/test_protocol.py -k repeat
# HFLOW_TEST_WORKERS=N sets the first part's workers (default 2; 0 runs it in one process).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
python="${HFLOW_VENV:-.venv}/bin/python"

for arg in "$@"; do
  if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then
    exec "$python" -m pytest "$@"
  fi
done

workers=${HFLOW_TEST_WORKERS:-2}
parallel=()
[[ "$workers" != 0 ]] && parallel=(-n "$workers" --dist loadfile)
set +e
"$python" -m pytest "${parallel[@]}" -m "not gpu and not alone" "$@" tests
first=$?
"$python" -m pytest -m "not gpu and alone" "$@" tests
second=$?
set -e
# pytest's exit code 5 means "no tests collected": the suite failed only if both parts found nothing.
if [[ $first == 5 && $second == 5 ]]; then exit 5; fi
for status in $first $second; do
  if [[ $status != 0 && $status != 5 ]]; then exit "$status"; fi
done
exit 0
