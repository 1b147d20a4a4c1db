#!/usr/bin/env bash
# The README's main job: set up the pinned CPU environment, then run the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python tools/cpu_demo.py "$@"
