#!/usr/bin/env bash
# Optional: NVIDIA's CUDA 13.0 compiler from PyPI wheels, into .nvcc/ (no GPU, no driver needed).
#
# The CPU test tier uses it to compile csrc/*.cu for the Docker image's GPU architectures
# (tests/ops/test_cuda_build.py), so a CUDA kernel that no longer compiles fails CI on a machine
# without a GPU. nvcc, the CUDA runtime headers, the crt headers, cicc (nvvm) and CCCL come as
# five wheels (~105 MB download, ~270 MB installed). A system nvcc on PATH is used instead when
# present. Idempotent; MEGATRON_RL_SKIP_NVCC=1 in scripts/test.sh skips it.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${1:-$REPO/.nvcc}"
WHEELS=(
    nvidia-cuda-nvcc==13.0.88
    nvidia-cuda-crt==13.0.88
    nvidia-nvvm==13.0.88
    nvidia-cuda-runtime==13.0.96
    nvidia-cuda-cccl==13.0.85
)
want=$(printf '%s\n' "${WHEELS[@]}" | sha256sum | cut -c1-16)
if [ -x "$DEST/nvidia/cu13/bin/nvcc" ] && [ "$(cat "$DEST/.stamp" 2>/dev/null)" = "$want" ]; then
    echo "nvcc already installed in $DEST"
    exit 0
fi
rm -rf "$DEST"
"$REPO/.venv/bin/python" -m pip install -q --no-deps --target "$DEST" "${WHEELS[@]}"
echo '*' > "$DEST/.gitignore"
echo "$want" > "$DEST/.stamp"
"$DEST/nvidia/cu13/bin/nvcc" --version | tail -1
