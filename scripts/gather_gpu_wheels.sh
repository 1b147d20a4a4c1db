#!/usr/bin/env bash
# Gather, on a machine with PyPI, the wheels that scripts/gpu_check.sh installs on an air-gapped
# GPU machine (Python 3.12, x86-64 Linux, with CUDA torch, transformers, accelerate, pyarrow,
# pandas, einops, pyyaml, pytest... already there: /work/.library/device/KINDS.md).
#
#   bash scripts/gather_gpu_wheels.sh [DIR]      # DIR defaults to .whl (git-ignored)
#
# Carried: the pins of scripts/gpu_wheels.txt, megatron-core and TRL with the pure-Python
# packages they need that the GPU machine lacks, one version each, 64 MiB at most in all
# (tools/gpu_summary.py check-wheels --pins: the script fails when over, when the folder is not
# exactly the pins, or when a wheel's Requires-Python or a requirement is not met by a carried
# wheel or by the GPU machine's own packages, scripts/gpu_machine_packages.txt; requirements on
# machine packages whose version is not recorded there are listed, and the kit's install step
# checks them on the machine). The wheels' declared requirements are written to
# scripts/gpu_wheels_metadata.json, which the CPU tests check offline
# (tests/scripts/test_gpu_wheels.py): commit it when it changes.
# Decisions:
# - datasets 4.8.5, not the 5.2.0 of the CPU TRL venv: TRL's GRPOTrainer imports `datasets` at
#   module level, so it must travel (0.5 MB, with dill and multiprocess); 5.x needs
#   pyarrow >= 24 while 4.8.5 needs >= 21, the same floor as TRL, so the machine's own pyarrow
#   (45 MB as a wheel) is used and not carried.
# - fsspec 2026.2.0 is carried: datasets 4.8.5 needs fsspec <= 2026.2.0 and the machine has
#   2026.7.0 (read there 2026-11-26); the carried one comes first on PYTHONPATH.
# - reasoning-gym is not carried: three of its pinned dependencies (cellpylib, pycosat, zss) have
#   no wheels. Nothing in the GPU kit needs it (tools/bench_vs_trl.py makes its own prompts when
#   it is missing); data preparation stays on the CPU machine.
# - math-verify (+ latex2sympy2_extended, antlr4 runtime, 0.4 MB) is carried so that the "math"
#   reward task imports there.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-.whl}"
PYTHON="${PYTHON:-python3}"
mapfile -t WHEELS < <("$PYTHON" tools/gpu_summary.py pins)   # scripts/gpu_wheels.txt
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
"$PYTHON" tools/gpu_summary.py check-wheels "$DIR" --pins --write-metadata
# What travels to a lent GPU machine is the working tree plus the carried paths (the wheels, and
# the CUDA extension a first call built: scripts/gpu_check.sh's header), 64 MiB at most.
if git rev-parse --git-dir >/dev/null 2>&1; then
    tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
    wheels=$(du -cb "$DIR"/*.whl | tail -1 | cut -f1)
    ext=$(du -cb megatron_rl/_C.cpython-312-*.so 2>/dev/null | tail -1 | cut -f1)
    ext=${ext:-0}
    echo "working tree ${tree} B + wheels ${wheels} B + cp312 extension ${ext} B" \
         "= $(( (tree + wheels + ext) / 1048576 )) MiB"
    if (( tree + wheels + ext > 64 * 1048576 )); then
        echo "WARNING: over 64 MiB: the device tool would refuse to carry it" >&2
    fi
fi
