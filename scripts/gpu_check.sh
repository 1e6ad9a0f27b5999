#!/usr/bin/env bash
# What only a GPU can show, in one command, on a machine with an NVIDIA GPU (e.g. a lent single-GPU
# machine that has torch, triton and transformers but neither Ray nor vLLM, and no internet):
#   1. exits at once, non-zero, when no CUDA device is found;
#   2. installs hflow (`pip install --no-deps -e .`) and the few small packages this Python lacks from
#      .gpu_wheels/ (filled beforehand, where there is internet, by scripts/gpu_wheels.sh), offline,
#      into the environment of that Python, whose own torch it uses;
#   3. runs the tests marked `gpu` (pytest -m gpu);
#   4. runs bench/actor_speed.py --workload gsm8k (a GRPO step's training side on GSM8K-like lengths, arm by
#      arm: the CUDA defaults, FSDP2 forced, compile, Liger, the plain loop; written to
#      <results>/actor_speed_gsm8k_<gpu>/) and bench/actor_speed.py (hflow's actor against a plain-torch loop,
#      arm by arm: ~4 min on an H100), which writes <results>/actor_speed_<gpu>/actor_speed.md and .json after
#      every arm, then
#      bench/gpu_check.py parts a, b, d, which write <results>/gpu_check.md (device, versions, learning on the
#      built-in task, log-prob parity, log-prob/entropy memory) and fail if a part fails. The speed table
#      comes first: it is what a lent GPU is for, and a run cut short by the device's limit keeps it.
# Usage: scripts/gpu_check.sh [bench/gpu_check.py options, e.g. --parts a,c]
#        PYTHON=/path/to/python3 (default python3: the interpreter with the machine's CUDA torch)
#        RESULTS=folder (default bench/results; e.g. the device tool's $OUT, so the files come back)
#        ACTOR_SPEED_BUDGET_S=N (start no speed arm after N seconds; default: no limit)
# A liger-kernel wheel in .gpu_wheels/ (scripts/gpu_wheels.sh fetches one) is installed when the machine
# lacks the package, so the use_liger arms run.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python=${PYTHON:-python3}
wheels=.gpu_wheels
results=${RESULTS:-bench/results}

fail() { echo "gpu_check: $*" >&2; exit 1; }

# 1. A CUDA device that this Python's torch can use: checked before anything is installed.
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q "GPU"; then
  fail "no CUDA device found (nvidia-smi lists no NVIDIA GPU); run this on a machine with one"
fi
if ! info=$("$python" -c 'import torch; assert torch.cuda.is_available(); print("torch", torch.__version__, "CUDA", torch.version.cuda, "on", torch.cuda.get_device_name(0))' 2>/dev/null); then
  torch_info=$("$python" -c 'import torch; print("torch", torch.__version__, "built for CUDA", torch.version.cuda)' 2>&1 | tail -n 1)
  fail "no CUDA device found by $python ($torch_info; driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1)): a CPU-only torch, or a driver older than torch's CUDA build"
fi
echo "gpu_check: $info" >&2
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1

# 2. What this Python lacks, from the local wheel folder (module:distribution).
needed=(hydra:hydra-core omegaconf:omegaconf antlr4:antlr4-python3-runtime tensordict:tensordict pyvers:pyvers
        cloudpickle:cloudpickle yaml:PyYAML pandas:pandas pyarrow:pyarrow matplotlib:matplotlib
        safetensors:safetensors tokenizers:tokenizers tqdm:tqdm pytest:pytest pytest_timeout:pytest-timeout
        pluggy:pluggy iniconfig:iniconfig psutil:psutil)
missing=()
for pair in "${needed[@]}"; do
  "$python" -c "import ${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair#*:}")
done
pip() { "$python" -m pip --disable-pip-version-check -q "$@"; }
# Optional: Liger-Kernel (Triton; needs the machine's triton), only if its wheel was carried.
if ! "$python" -c "import liger_kernel" >/dev/null 2>&1 && ls "$wheels"/liger_kernel-*.whl >/dev/null 2>&1; then
  missing+=(liger-kernel)
fi
if [[ ${#missing[@]} -gt 0 ]]; then
  echo "gpu_check: installing from $wheels/: ${missing[*]}" >&2
  [[ -d $wheels ]] || fail "$wheels/ is missing: run scripts/gpu_wheels.sh on a machine with internet and bring the folder along"
  pip install --no-index --find-links "$wheels" --no-deps "${missing[@]}" \
    || fail "could not install ${missing[*]} from $wheels/ (scripts/gpu_wheels.sh fills it; pandas, pyarrow and matplotlib only with GPU_WHEELS_EXTRA='pandas pyarrow matplotlib' scripts/gpu_wheels.sh <this Python's version>)"
fi
if ! "$python" -c 'import hflow, sys; sys.exit(0 if hflow.__file__.startswith(sys.argv[1]) else 1)' "$PWD" >/dev/null 2>&1; then
  echo "gpu_check: pip install --no-deps -e . (offline)" >&2
  # Build isolation takes setuptools and wheel from the folder; without them, the installed setuptools.
  pip install --no-index --find-links "$wheels" --no-deps -e . >/dev/null 2>&1 \
    || pip install --no-index --no-build-isolation --no-deps -e . >/dev/null 2>&1 \
    || { echo "gpu_check: could not install hflow; using it from the checkout (PYTHONPATH)" >&2
         export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"; }
fi

# 3. The tests marked `gpu`.
mkdir -p "$results"
tests_log=$(mktemp)
"$python" -m pytest -m gpu -p no:cacheprovider -q -rfE tests 2>&1 | tee "$tests_log"
tests_rc=${PIPESTATUS[0]}
tests_summary=$(grep -E "(passed|failed|error|skipped|deselected|no tests ran)" "$tests_log" | tail -n 1 | tr -d '=' | sed 's/^ *//; s/ *$//')
[[ $tests_rc == 5 ]] && tests_summary="no tests marked gpu were collected"
rm -f "$tests_log"

# 4. The speed benchmark (the actor against a plain loop, arm by arm), written to <results>/actor_speed_<GPU>/,
#    then parts a, b, d of bench/gpu_check.py (part c's speed table is replaced by the benchmark).
#    Exit status: non-zero if either failed.
gpu=$("$python" -c 'import torch; print((torch.cuda.get_device_name(0).replace("NVIDIA", "").split() or ["gpu"])[0].lower())' 2>/dev/null || echo gpu)
budget=()
[[ -n ${ACTOR_SPEED_BUDGET_S:-} ]] && budget=(--budget-s "$ACTOR_SPEED_BUDGET_S")
# The GRPO step's training side on GSM8K-like lengths first (issue 49's probe of the CUDA defaults, ~6 min on
# an H200), then the fixed-shape arms.
"$python" bench/actor_speed.py --workload gsm8k --out "$results/actor_speed_gsm8k_${gpu}" "${budget[@]}"
gsm8k_rc=$?
"$python" bench/actor_speed.py --out "$results/actor_speed_${gpu}" "${budget[@]}"
speed_rc=$?
(( gsm8k_rc == 0 )) || speed_rc=$gsm8k_rc
parts=(--parts a,b,d)
[[ " $* " == *" --parts "* ]] && parts=()
"$python" bench/gpu_check.py "${parts[@]}" --out "$results/gpu_check.md" --tests-rc "$tests_rc" \
  --tests-summary "${tests_summary:-exit status $tests_rc}" "$@"
check_rc=$?
(( check_rc == 0 && speed_rc == 0 ))
