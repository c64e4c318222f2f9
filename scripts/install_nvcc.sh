#!/usr/bin/env bash
# Installs nvcc of CUDA 13.0 from NVIDIA's pip wheels (no system toolkit needed), which is what
# crates/ninfer-kernels/build.rs uses to compile kernels/*.cu when the `cuda` feature is on.
#
# Usage: scripts/install_nvcc.sh [VENV_DIR]
#   VENV_DIR given: installs into that virtual environment (created if missing).
#   Otherwise: installs into the environment of $PYTHON (default python3).
# build.rs looks for nvcc in the site-packages of python3 and of $NINFER_NVCC_PYTHON, so point
# NINFER_NVCC_PYTHON at the venv's python (printed below) when it is not the python3 on PATH.
set -euo pipefail

PACKAGES=(
    "nvidia-cuda-nvcc==13.0.88"
    "nvidia-nvvm==13.0.88"
    "nvidia-cuda-crt==13.0.88"
    "nvidia-cuda-runtime==13.0.96"
    "nvidia-cuda-cccl==13.0.85"
)

if [ $# -ge 1 ]; then
    venv=$1
    if [ ! -x "$venv/bin/python" ]; then
        python3 -m venv "$venv"
    fi
    py="$venv/bin/python"
else
    py=${PYTHON:-python3}
fi

"$py" -m pip install --upgrade "${PACKAGES[@]}"

nvcc=$("$py" -c 'import os, sysconfig; print(os.path.join(sysconfig.get_paths()["purelib"], "nvidia", "cu13", "bin", "nvcc"))')
if [ ! -x "$nvcc" ]; then
    echo "error: nvcc not found at $nvcc after installing" >&2
    exit 1
fi
"$nvcc" --version | tail -n 2
echo
echo "nvcc installed at $nvcc"
echo "build with:  NINFER_NVCC_PYTHON=$py cargo build --features cuda"
echo "        or:  NVCC=$nvcc cargo build --features cuda"
