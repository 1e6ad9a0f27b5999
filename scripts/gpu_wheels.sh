#!/usr/bin/env bash
# Fill .gpu_wheels/ (git-ignored) with the few small wheels that scripts/gpu_check.sh installs on a GPU
# machine whose Python has torch, triton, transformers, numpy, pandas, pyarrow and pytest but not the
# rest of hflow's needs, and that cannot reach a package index. Run it here (with internet), then carry
# .gpu_wheels/ to that machine with the checkout.
#
#   scripts/gpu_wheels.sh [PYTHON_VERSION ...]     default: 3.10 3.11 3.12 (the GPU image's is unknown)
#   GPU_WHEELS_EXTRA="pandas pyarrow matplotlib" scripts/gpu_wheels.sh 3.12
#                                                  also carry these (compiled: tens of MB per Python)
#
# The versions are the CPU stack's (what CI tests). Pure-Python wheels serve every Python version; the
# compiled ones (PyYAML, safetensors, tokenizers, psutil, the extras) are fetched per version. The list
# holds every package gpu_check.sh installs when the machine lacks it (tests/bench/test_gpu_check.py
# checks that), except the large compiled extras (pandas, pyarrow, matplotlib), which the GPU image has.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

dest=.gpu_wheels
versions=("$@")
[[ ${#versions[@]} -gt 0 ]] || versions=(3.10 3.11 3.12)
python=${PYTHON:-python3}
[[ -x .venv/bin/python ]] && python=.venv/bin/python

# module name = what gpu_check.sh tries to import; distribution==version = what it installs if that fails
packages=(
  "hydra-core==1.3.8"
  "omegaconf==2.3.1"
  "tensordict==0.15.3"
  "pyvers==0.2.3"        # tensordict's
  "cloudpickle==3.1.2"   # tensordict's
  "pytest==9.2.0"
  "pytest-timeout==2.4.0"
  "pluggy==1.7.0"        # pytest's
  "iniconfig==2.3.1"     # pytest's
  "setuptools==78.1.1"   # build backend of `pip install -e .` (offline build isolation)
  "wheel==0.48.0"
  "packaging==26.3"      # wheel's
  "PyYAML==6.0.4"        # compiled, one per Python version: what gpu_check.sh installs when missing
  "safetensors==0.8.0"
  "tokenizers==0.23.3"
  "tqdm==4.70.1"
  "psutil==7.2.2"
  "liger-kernel==0.8.5"  # optional: gpu_check.sh installs it so the use_liger arms of bench/actor_speed.py run
)
read -r -a extra <<< "${GPU_WHEELS_EXTRA:-}"

pip() {
  "$python" -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "^WARNING: Location 'file:" >&2)
}

mkdir -p "$dest"
for version in "${versions[@]}"; do
  echo "gpu_wheels: wheels for Python $version ..." >&2
  pip download --only-binary :all: --no-deps --dest "$dest" --python-version "$version" --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    "${packages[@]}" "${extra[@]}"
done
# antlr4-python3-runtime 4.9.3 (what hydra-core 1.3 and omegaconf 2.3 require) exists only as a source
# package; its wheel is pure Python, so build it once here.
if ! ls "$dest"/antlr4_python3_runtime-4.9.3-*.whl >/dev/null 2>&1; then
  echo "gpu_wheels: building antlr4-python3-runtime 4.9.3 (source only on PyPI) ..." >&2
  pip wheel --no-deps --wheel-dir "$dest" "antlr4-python3-runtime==4.9.3"
fi

size_kib=$(du -sk "$dest" | cut -f1)
echo "gpu_wheels: $dest holds $(ls "$dest" | wc -l) wheels, $((size_kib / 1024)) MiB:" >&2
ls -1 "$dest" >&2
if (( size_kib > 40 * 1024 )); then
  echo "gpu_wheels: warning: over 40 MiB; the device tool carries at most 64 MiB with the checkout" >&2
fi
