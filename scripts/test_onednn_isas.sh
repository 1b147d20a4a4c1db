#!/usr/bin/env bash
# The tests that measure CPU allocations, again under each oneDNN code path this CPU can run
# (CI runs this after scripts/test.sh). oneDNN picks its kernels, and so its scratchpad sizes, by
# the CPU's instruction set; ONEDNN_MAX_CPU_ISA only lowers it, so each value the CPU supports
# runs here: AVX2 (no oneDNN for bf16 matmuls), AVX512_CORE (gemm:jit:bf16), AVX512_CORE_BF16
# (brgemm), AVX512_CORE_AMX (brgemm on AMX tiles). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
has() { for f in "$@"; do [[ $flags == *" $f "* ]] || return 1; done; }
isas=()
has avx2 && isas+=(AVX2)
has avx512f avx512bw avx512vl avx512dq && isas+=(AVX512_CORE)
has avx512f avx512bw avx512vl avx512dq avx512_bf16 && isas+=(AVX512_CORE_BF16)
has avx512f avx512bw avx512vl avx512dq amx_tile amx_bf16 && isas+=(AVX512_CORE_AMX)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
for isa in "${isas[@]}"; do
  echo "== memory tests, ONEDNN_MAX_CPU_ISA=$isa"
  ONEDNN_MAX_CPU_ISA=$isa .venv/bin/python -m pytest -q -p no:cacheprovider -n 0 \
    tests/ops/test_lm_head.py -k "peak or workspace" "$@"
done
