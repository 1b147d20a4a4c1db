#!/usr/bin/env bash
# The README's main job: set up the pinned CPU environment, then run the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# two threads where there are two cores (the tiny model's warm-up runs 1.6x faster than on one)
n=$(nproc); export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( n < 2 ? n : 2 ))}
exec .venv/bin/python tools/cpu_demo.py "$@"
