#!/usr/bin/env bash
# The install steps of the megatron-rl image (Dockerfile), shared by its two variants:
#   GPU (default): BASE_IMAGE = NGC PyTorch; its CUDA torch / TransformerEngine / NCCL are kept
#                  as they are, and the CUDA kernels must build.
#   CPU:           BASE_IMAGE = any Debian/Ubuntu with `python` + `pip` installing into the
#                  image's Python (scripts/build_image.sh makes one with debootstrap); the base
#                  has no torch, so the CPU build of requirements-cpu.txt's torch pin goes in.
# The variant is decided by the base, not by a flag: a base that has torch keeps it.
#
#   bash scripts/docker_install.sh servers   # rollout servers, each in its own venv
#   bash scripts/docker_install.sh deps      # build tools, torch (CPU variant), trainer deps
#   bash scripts/docker_install.sh package   # this package + its C++ (and CUDA) extension
#   bash scripts/docker_install.sh finish    # .venv view for the repo scripts, import check
#
# Settings (Dockerfile build args, passed as environment variables):
#   INSTALL_VLLM / INSTALL_SGLANG   1 install, 0 skip, resolve: only check that the pin resolves
#                                   (pip --dry-run; used to check the GPU steps without a GPU)
#   VLLM_VERSION / SGLANG_VERSION   the server pins
#   TORCH_FIND_LINKS / TORCH_INDEX_URL   where the CPU variant finds torch==<pin>+cpu
#   TORCH_CUDA_ARCH_LIST / MAX_JOBS the CUDA extension build
# Runs from the repository root (the Dockerfile's WORKDIR, /opt/megatron-rl).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
KEEP=/etc/megatron-rl-keep.txt      # the base's own torch & co., frozen as pip constraints

say() { echo "[docker_install] $*"; }
pin() {  # the version requirements-cpu.txt pins for package $1
    sed -n "s/^$1==\([^ #]*\).*/\1/p" requirements-cpu.txt
}

# --- servers ----------------------------------------------------------------------------------
# vLLM and SGLang wheels pin their own CUDA torch build; installed into the image's Python they
# would replace the base's torch (and break TransformerEngine). In a venv they cannot, and the
# trainer only talks to them over HTTP (it launches `$MEGATRON_RL_VLLM_PYTHON -m vllm...`), so
# nothing of theirs needs to import beside megatron-core. The base's PIP_CONSTRAINT (NGC pins its
# torch build there) is cleared for these installs only.
server_venv() {  # name, mode, pip requirement, module
    local name=$1 mode=$2 req=$3 mod=$4
    case "$mode" in
    0 | "") say "$name: skipped" ;;
    1)
        "$PY" -m venv "/opt/venv-$name"
        PIP_CONSTRAINT="" "/opt/venv-$name/bin/pip" install "$req"
        "/opt/venv-$name/bin/python" -c "import $mod; print('$mod', $mod.__version__)"
        ;;
    resolve)
        # What `1` would install, without installing it (wheel metadata only, no CUDA download).
        local venv
        venv=$(mktemp -d -t "venv-$name-XXXX")
        "$PY" -m venv "$venv"
        PIP_CONSTRAINT="" "$venv/bin/pip" install -q --upgrade pip
        PIP_CONSTRAINT="" "$venv/bin/pip" install --dry-run --ignore-installed --report "$venv/report.json" \
            -q "$req"
        "$venv/bin/python" - "$venv/report.json" "$name" <<'EOF'
import json, sys
items = json.load(open(sys.argv[1]))["install"]
pins = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in items}
print(f"[docker_install] {sys.argv[2]}: resolves to {len(pins)} packages, e.g. "
      + ", ".join(f"{k}=={pins[k]}" for k in ("vllm", "sglang", "torch", "transformers") if k in pins))
EOF
        rm -rf "$venv"
        ;;
    *) echo "unknown install mode for $name: '$mode' (0, 1 or resolve)" >&2; exit 2 ;;
    esac
}

# --- deps -------------------------------------------------------------------------------------
build_tools() {  # a C++ compiler and Python.h for the extension (NGC has both)
    local inc
    inc=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
    if command -v g++ >/dev/null && [ -f "$inc/Python.h" ]; then
        return
    fi
    say "installing g++ and the Python headers (apt)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends g++ python3-dev >/dev/null
    apt-get clean
    rm -rf /var/lib/apt/lists/*
}

cpu_torch() {  # the CPU variant: the base has no torch
    local spec args=()
    spec="torch==$(pin torch)+cpu"   # '+cpu' never matches PyPI's multi-GB CUDA build
    [ -n "${TORCH_FIND_LINKS:-}" ] && args+=(--find-links "$TORCH_FIND_LINKS")
    [ -n "${TORCH_INDEX_URL:-}" ] && args+=(--extra-index-url "$TORCH_INDEX_URL")
    say "no torch in the base: installing $spec ${args[*]}"
    PIP_CONSTRAINT="" "$PY" -m pip install "${args[@]}" "$spec"
}

deps() {
    build_tools
    if ! "$PY" -c 'import torch' 2>/dev/null; then
        cpu_torch
    fi
    # Freeze the base's torch / triton / TransformerEngine / NVIDIA libraries (or the CPU torch
    # just installed) as constraints, so that any dependency asking for another torch fails the
    # build instead of silently replacing it.
    "$PY" -m pip list --format=freeze 2>/dev/null \
        | grep -iE '^(torch|triton|transformer[-_]engine|nvidia-|numpy|packaging)' > "$KEEP"
    say "kept from the base: $(tr '\n' ' ' < "$KEEP" | cut -c1-300)"
    # megatron-core goes in with --no-deps: its only requirements (torch, numpy, packaging) are
    # in the image, and pip can reject NGC's pre-release torch version string (2.x.0a0+...)
    # against `torch>=2.6`.
    PIP_CONSTRAINT="$KEEP" "$PY" -m pip install --no-deps "megatron-core==$(pin megatron-core)"
    # The rest: requirements-cpu.txt's pins (one list for the CPU dev env and both images),
    # less torch / megatron-core and whatever the base already provides (NGC's numpy).
    local reqs
    reqs=$(mktemp --suffix .txt)
    "$PY" - "$KEEP" requirements-cpu.txt > "$reqs" <<'EOF'
import re, sys
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
keep = {norm(l.split("==")[0]) for l in open(sys.argv[1]) if "==" in l}
for line in open(sys.argv[2]):
    line = line.split("#")[0].strip()
    name = norm(re.split(r"[\s=<>!~;\[]", line)[0]) if line else ""
    if line and name not in keep | {"torch", "megatron-core"}:
        print(line)
EOF
    say "installing: $(tr '\n' ' ' < "$reqs")"
    PIP_CONSTRAINT="$KEEP" "$PY" -m pip install -r "$reqs"
    rm -f "$reqs"
    # PyPI's torchvision/torchaudio are CUDA-linked and break imports beside a CPU torch.
    if "$PY" -c 'import torch, sys; sys.exit(torch.version.cuda is not None)'; then
        "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    fi
}

# --- package ----------------------------------------------------------------------------------
package() {
    # --no-build-isolation: compile against the image's torch; --no-deps: everything is in.
    # --use-pep517: an older pip (Debian bookworm's 23.0) would otherwise take the legacy
    # `setup.py develop` path, which setuptools >= 80 turns into an isolated build without torch.
    # setup.py builds the CUDA kernels when nvcc and a CUDA torch are present (no GPU is needed
    # at build time: the target architectures come from TORCH_CUDA_ARCH_LIST).
    "$PY" -m pip install --no-cache-dir --no-build-isolation --use-pep517 --no-deps -e .
    ls megatron_rl/_C*.so
    "$PY" - <<'EOF'
import torch
import megatron_rl._C as C
cuda = hasattr(C, "logprob_partials_cuda")
print(f"[docker_install] megatron_rl._C: CPU kernels ({C.cpu_isa()})"
      + (", CUDA kernels" if cuda else "") + f"; torch {torch.__version__}, CUDA {torch.version.cuda}")
# A CUDA torch must come with the CUDA kernels (nvcc missing would silently drop them).
assert cuda or torch.version.cuda is None, "CUDA torch, but the extension has no CUDA kernels"
EOF
}

# --- finish -----------------------------------------------------------------------------------
finish() {
    # The repo's scripts (setup.sh, quickstart.sh, test.sh) run from .venv and install
    # requirements-cpu.txt into it unless its stamp matches. In the image .venv is a view of the
    # image's Python (system site-packages) with that stamp, so `bash scripts/quickstart.sh` and
    # `bash scripts/test.sh` run with the image's torch instead of installing their own (which
    # would be PyPI's CUDA build). The stamp is computed as in scripts/setup.sh.
    rm -rf .venv
    "$PY" -m venv --system-site-packages --without-pip .venv
    sha256sum requirements-cpu.txt setup.py | sha256sum | cut -c1-16 > .venv/.requirements-cpu.sha
    # Import check without a GPU (the build has none): CUDA libraries load lazily.
    .venv/bin/python -c "import torch, megatron_rl._C, megatron.core, megatron_rl.train; \
print('megatron-rl ok | torch', torch.__version__, '| megatron-core', megatron.core.__version__)"
}

case "${1:-}" in
servers)
    server_venv vllm "${INSTALL_VLLM:-0}" "vllm==${VLLM_VERSION:-0.32.0}" vllm
    server_venv sglang "${INSTALL_SGLANG:-0}" "sglang==${SGLANG_VERSION:-0.5.23}" sglang
    ;;
deps) deps ;;
package) package ;;
finish) finish ;;
*) echo "usage: $0 {servers|deps|package|finish}" >&2; exit 2 ;;
esac
