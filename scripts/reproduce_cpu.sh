#!/usr/bin/env bash
# The full CPU reproduction of the paper's Table 1 at toy scale (issue 8): the exact toy study,
# then the tiny char-level model (tools/cpu_demo.py's base model) swept over
#   {none, k1:reward, k1:loss, k1:reward+loss, k3:reward, k3:loss, k3:reward+loss}
#   x beta {0.05, 0.1, 0.3, 1} x seeds {1, 2, 3} x {on-policy, off-policy (4 PPO minibatches)}
#   + the async slice (--async-level 2: none, k1:reward, k3:loss, k1:reward + seq-is),
# 100 RL steps each, 162 runs. Results: docs/results.md (generated block), docs/figures/.
#
# Expected duration: ~9 h on a 2-core CPU shared with other jobs (measured: a 40-step
# run took ~55-75 s here, plus ~20 s of evaluation and process start per run); less
# on an idle machine (and with newer local-engine speedups). The sweep is resumable: rerun the same command after an
# interruption and finished runs are skipped.
#
#   bash scripts/reproduce_cpu.sh [extra tools/reproduce.py flags, e.g. --seeds 1 --regimes on]
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ]; then source .venv/bin/activate; fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec nice -n 19 python tools/reproduce.py --out outputs/reproduce \
    --betas 0.05 0.1 0.3 1 --seeds 1 2 3 --regimes on off --async-levels 2 \
    --steps 100 --eval-interval 10 "$@"
