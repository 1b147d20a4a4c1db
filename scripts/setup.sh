#!/usr/bin/env bash
# Create (or reuse) the pinned CPU development environment in .venv and install megatron-rl
# into it, with the C++ CPU extension from csrc/. Idempotent: a second run only re-checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.requirements-cpu.sha
want=$(sha256sum requirements-cpu.txt setup.py | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -r requirements-cpu.txt
  # PyPI's torchvision/torchaudio are CUDA-linked and break imports beside the CPU torch.
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  .venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .
  echo "$want" > "$stamp"
fi
# The agent's Python tool runs each call in a bubblewrap sandbox (megatron_rl/agent/sandbox.py).
if ! command -v bwrap >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null 2>&1 \
      || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null; }; } \
      || echo "setup.sh: apt-get could not install bubblewrap; the sandbox tests will skip" >&2
  else
    echo "setup.sh: bubblewrap (bwrap) is missing and needs root to install" \
         "(apt-get install bubblewrap); the sandbox tests will skip" >&2
  fi
fi
.venv/bin/python -c "import megatron_rl, megatron.core, torch; print('megatron-rl', megatron_rl.__version__, '| torch', torch.__version__, '| megatron-core', megatron.core.__version__)"
