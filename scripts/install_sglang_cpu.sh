#!/usr/bin/env bash
# Optional: SGLang 0.5.23 on CPU, in its own venv (default .venv-sglang/ at the repo root).
#
# sglang pins CUDA builds (torch 2.14.1, flashinfer, sgl-kernel, ...), so this installs the
# local CPU torch 2.13.0, sglang itself without dependencies, the pure-Python dependencies its
# server imports, and import-only stand-ins for `sgl_kernel` (no CPU build on PyPI) and
# `torchvision` (PyPI's builds break beside the CPU torch). Text models with
# SGLANG_USE_CPU_ENGINE=1 --device cpu --attention-backend torch_native never call either.
# megatron_rl.rollout.sglang_engine finds it at $MEGATRON_RL_SGLANG_PYTHON or .venv-sglang.
# Idempotent; ~2-3 min and ~3 GB when run from scratch.
set -euo pipefail

SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$REPO/.venv-sglang}"
PY="$VENV/bin/python"
CHECK="import sglang.launch_server, sglang.srt.entrypoints.http_server, sglang.srt.managers.scheduler, sglang.srt.model_executor.model_runner, sglang.srt.models.qwen2, sglang.srt.models.llama"

if [ -x "$PY" ] && SGLANG_USE_CPU_ENGINE=1 "$PY" -c "$CHECK" >/dev/null 2>&1 \
    && "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('sglang') != '$SGLANG_VERSION')"; then
    echo "sglang $SGLANG_VERSION already installed in $VENV"
    exit 0
fi

[ -x "$PY" ] || "${PYTHON:-python3.11}" -m venv "$VENV"
echo '*' > "$VENV/.gitignore"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q --no-deps "sglang==$SGLANG_VERSION"
"$PY" -m pip install -q torch==2.13.0 aiohttp fastapi "uvicorn>=0.51" uvloop pydantic orjson \
    "pyzmq>=25.1.2" msgspec requests psutil setproctitle "transformers==5.19.0" numpy einops \
    pybase64 python-multipart "prometheus-client>=0.20.0" partial_json_parser interegular \
    packaging sentencepiece tiktoken safetensors huggingface_hub pillow scipy xxhash zstandard \
    watchfiles distro python-dateutil regex tqdm "openai==2.8.0" "xgrammar==0.2.7" \
    "llguidance<2.0.0,>=1.7.6" "compressed-tensors==0.18.0" "apache-tvm-ffi==0.1.11" gguf \
    blobfile==3.0.0 ninja ipython dill jsonschema soundfile
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
for pkg in sgl_kernel torchvision; do
    mkdir -p "$SITE/$pkg"
    cat > "$SITE/$pkg/__init__.py" <<PYEOF
"""Import-only stand-in for $pkg (written by megatron-rl scripts/install_sglang_cpu.sh).

Every module and attribute under $pkg imports; calling anything raises. sglang's CPU path for
text models (torch_native attention) never calls it."""
import importlib.abc, importlib.machinery, sys, types

__version__ = "0.0.0+stub"


class _Missing:
    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        return _Missing(f"{self._name}.{attr}")

    def __call__(self, *a, **k):
        raise RuntimeError(f"{self._name} is an import-only stand-in on this machine")

    def __mro_entries__(self, bases):
        return (object,)


class _StubModule(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.startswith("$pkg."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _StubModule(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())


def __getattr__(attr):
    if attr.startswith("__"):
        raise AttributeError(attr)
    return _Missing(f"$pkg.{attr}")
PYEOF
done
SGLANG_USE_CPU_ENGINE=1 "$PY" -c "$CHECK" && echo "sglang $SGLANG_VERSION ready in $VENV"
