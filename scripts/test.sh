#!/usr/bin/env bash
# Set up the environment and run the test suite (the README's test command; CI runs this).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not distributed"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@" tests
