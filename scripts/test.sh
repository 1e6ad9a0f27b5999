#!/usr/bin/env bash
# Set up the environment (idempotent) and run hflow's test suite (docs/testing.md says how it is organised).
#   scripts/test.sh [pytest options]          the whole suite, in two parts: first every test not marked
#                                             `alone`, two at a time (pytest-xdist, one test file per
#                                             worker: most tests spend much of their time starting
#                                             processes, Ray and engines, so two share the 2 cores well);
#                                             then the `alone` tests one by one (pyproject.toml says which)
#   scripts/test.sh --fast [...]              the fast tier only: the same two parts without the tests
#                                             marked `slow` (learning runs, long integration runs)
#   scripts/test.sh PATH... [pytest options]  just those tests, one at a time, e.g.
#                                             scripts/test.sh tests/test_protocol.py -k repeat
#                                             (with --fast, those of them in the fast tier)
# HFLOW_TEST_WORKERS=N sets the first part's workers (default 2; 0 runs it in one process).
# HFLOW_TEST_RECORD=DIR writes a duration record there: one junit XML per part (every test's seconds and
# tier) and run.json (commit, tier, load); `scripts/suite_time.py DIR` turns it into tables.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
python="${HFLOW_VENV:-.venv}/bin/python"

args=()
tier=""
for arg in "$@"; do
  if [[ "$arg" == --fast ]]; then tier=" and not slow"; else args+=("$arg"); fi
done

record=()
record_dir=${HFLOW_TEST_RECORD:-}
if [[ -n "$record_dir" ]]; then
  mkdir -p "$record_dir"
  rm -f "$record_dir"/*.xml "$record_dir"/end.json
  dirty=false; [[ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]] && dirty=true
  printf '{"commit": "%s", "dirty": %s, "tier": "%s", "started": "%s", "load_at_start": "%s", "cpus": %s}\n' \
    "$(git rev-parse --short HEAD 2>/dev/null)" "$dirty" "$([[ -n "$tier" ]] && echo fast || echo whole)" "$(date -u '+%Y-%m-%d %H:%M:%S UTC')" \
    "$(cut -d' ' -f1-3 /proc/loadavg)" "$(nproc)" > "$record_dir/run.json"
fi
# junit XML of one part, if a record is kept
part_record() { [[ -n "$record_dir" ]] && record=("--junitxml=$record_dir/$1.xml") || record=(); }
end_record() {
  [[ -z "$record_dir" ]] || printf '{"ended": "%s", "load_at_end": "%s"}\n' "$(date -u '+%Y-%m-%d %H:%M:%S UTC')" \
    "$(cut -d' ' -f1-3 /proc/loadavg)" > "$record_dir/end.json"
}

for arg in "${args[@]}"; do
  if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then
    part_record paths
    set +e
    "$python" -m pytest -m "not gpu$tier" "${record[@]}" "${args[@]}"
    status=$?
    end_record
    exit $status
  fi
done

workers=${HFLOW_TEST_WORKERS:-2}
parallel=()
[[ "$workers" != 0 ]] && parallel=(-n "$workers" --dist loadfile)
set +e
part_record parallel
"$python" -m pytest "${parallel[@]}" -m "not gpu and not alone$tier" "${record[@]}" "${args[@]}" tests
first=$?
part_record alone
"$python" -m pytest -m "not gpu and alone$tier" "${record[@]}" "${args[@]}" tests
second=$?
set -e
end_record
# pytest's exit code 5 means "no tests collected": the suite failed only if both parts found nothing.
if [[ $first == 5 && $second == 5 ]]; then exit 5; fi
for status in $first $second; do
  if [[ $status != 0 && $status != 5 ]]; then exit "$status"; fi
done
exit 0
