#!/usr/bin/env bash
# The full CPU reproduction of the paper's Table 1 at toy scale: the exact toy study,
# then the tiny char-level model (tools/cpu_demo.py's base model) swept over
#   {none, k1:reward, k1:loss, k1:reward+loss, k3:reward, k3:loss, k3:reward+loss}
#   x beta {0.05, 0.1, 0.3, 1} x seeds {1, 2, 3} x {on-policy, off-policy (4 PPO minibatches)}
#   + the async slice (--async-level 2, beta 1: none, k1:reward, k3:loss, k1:reward + seq-is),
# 40 RL steps each (what docs/results.md reports), 162 runs. Results: docs/results.md (generated
# block), docs/figures/. Longer runs: add --steps 100 (and a fresh --out: a finished 40-step run
# is not extended).
#
# Expected duration: ~75 s per run on one core of the 2-core dev machine (training, evals every
# 10 steps, the OOD eval), i.e. ~3.4 h for the grid on one core; two invocations on disjoint
# subsets (e.g. --regimes on / --regimes off --async-levels) with separate --report files, then
# one --report-only, use both cores. The sweep is resumable: rerun the same command after an
# interruption and finished runs are skipped.
#
#   bash scripts/reproduce_cpu.sh [extra tools/reproduce.py flags, e.g. --seeds 1 --regimes on]
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ]; then source .venv/bin/activate; fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec nice -n 19 python tools/reproduce.py --out outputs/reproduce \
    --betas 0.05 0.1 0.3 1 --seeds 1 2 3 --regimes on off --async-levels 2 --async-betas 1 \
    --steps 40 --eval-interval 10 "$@"
