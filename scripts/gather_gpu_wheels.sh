#!/usr/bin/env bash
# Gather, on a machine with PyPI, the wheels that scripts/gpu_check.sh installs on an air-gapped
# GPU machine (Python 3.12, x86-64 Linux, with CUDA torch, transformers, accelerate, pyarrow,
# pandas, einops, pyyaml, pytest... already there: /work/.library/device/KINDS.md).
#
#   bash scripts/gather_gpu_wheels.sh [DIR]      # DIR defaults to .whl (git-ignored)
#
# Carried: megatron-core and TRL with the pure-Python packages they need that the GPU machine
# lacks, one version each, 64 MiB at most in all (checked: the script fails when over, when a
# package has two versions, or when a wheel needs a package that is neither carried nor on the
# GPU machine: tools/gpu_summary.py check-wheels).
# Decisions:
# - datasets 4.8.5, not the 5.2.0 of the CPU TRL venv: TRL's GRPOTrainer imports `datasets` at
#   module level, so it must travel (0.5 MB, with dill and multiprocess); 5.x needs
#   pyarrow >= 24 while 4.8.5 needs >= 21, the same floor as TRL, so the machine's own pyarrow
#   (45 MB as a wheel) is used and not carried.
# - reasoning-gym is not carried: three of its pinned dependencies (cellpylib, pycosat, zss) have
#   no wheels. Nothing in the GPU kit needs it (tools/bench_vs_trl.py makes its own prompts when
#   it is missing); data preparation stays on the CPU machine.
# - math-verify (+ latex2sympy2_extended, antlr4 runtime, 0.4 MB) is carried so that the "math"
#   reward task imports there.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-.whl}"
PYTHON="${PYTHON:-python3}"
WHEELS=(
    megatron-core==0.16.1
    trl==1.16.0
    datasets==4.8.5 dill==0.4.0 multiprocess==0.70.18
    math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64
           manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
platform_args=()
for p in "${PLATFORMS[@]}"; do platform_args+=(--platform "$p"); done
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platform_args[@]}" -d "$tmp" "${WHEELS[@]}"
mkdir -p "$DIR"
rm -f "$DIR"/*.whl            # exactly the listed versions: two versions stop the install
mv "$tmp"/*.whl "$DIR"/
echo "wheels in $DIR:"
"$PYTHON" tools/gpu_summary.py check-wheels "$DIR"
# What travels to a lent GPU machine is the working tree plus the carried folder, 64 MiB at most.
if git rev-parse --git-dir >/dev/null 2>&1; then
    tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
    wheels=$(du -cb "$DIR"/*.whl | tail -1 | cut -f1)
    echo "working tree ${tree} B + wheels ${wheels} B = $(( (tree + wheels) / 1048576 )) MiB"
    if (( tree + wheels > 64 * 1048576 )); then
        echo "WARNING: over 64 MiB: the device tool would refuse to carry it" >&2
    fi
fi
