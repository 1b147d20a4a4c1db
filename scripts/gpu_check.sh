#!/usr/bin/env bash
# The one-command GPU verification kit: on a bare single-GPU Linux machine with a CUDA
# PyTorch, nvcc and no network, install the carried wheels, build the CUDA extension, run the
# gpu test tier and the CPU-tier tests that matter on the device, run the GPU benchmarks, and
# write OUT_DIR/summary.json and OUT_DIR/summary.md. Aims at < 20 min on one H100.
#
#   bash scripts/gather_gpu_wheels.sh                 # here, with PyPI: wheels into .whl/
#   bash scripts/gpu_check.sh OUT_DIR [--wheels DIR] [--skip-bench] [--only STEP,...] [--dry-run]
#
# Steps (each with its own timeout; pytest with 4 workers and 300 s per test where pytest-xdist
# and pytest-timeout are installed; a failed step does not stop the later ones; steps that would
# start after GPU_CHECK_BUDGET s, default 1500, are skipped; the exit status is 0 only when every
# step passed, no test failed and CUDA was available):
#   install          pip install --no-index --no-deps --target $SITE DIR/*.whl (the machine's
#                    torch, transformers... are untouched; $SITE goes on PYTHONPATH)
#   build            python setup.py build_ext --inplace: megatron_rl/_C with the CUDA kernels
#                    (the build that `pip install --no-build-isolation -e .` runs, without
#                    writing into the machine's site-packages); fails unless "cuda" is built
#   env              OUT_DIR/env.json: device, driver, torch / CUDA / nvcc, package versions
#   gpu-tests        pytest -m gpu tests (tests/gpu and the gpu-marked tests elsewhere)
#   cpu-tier-on-gpu  CPU-tier test files that run the package's own device choice, run again
#                    with CUDA visible: they build Policy / LocalEngine / train() through the
#                    public APIs from host inputs, so the same tests exercise the GPU path (see
#                    CPU_TIER_ON_GPU below; tests that feed host tensors straight into a module
#                    are not listed: they would fail for the test's reason, not the code's)
#   bench-kernel     tools/bench_logprob_kl.py --device cuda at N=32768, V=152064 and 4096 x 32000
#   bench-exact-kl   the same with --exact: --kl-estimator exact's op against the K1 path
#   bench-lm-head    tools/bench_lm_head.py --device cuda: the fused LM-head op (hidden states in)
#                    against the logits path and megatron-core at Qwen2.5-0.5B's head, bf16,
#                    N = 16384 and 65536, with the exact KL
#   bench-train-phase  tools/bench_train_phase.py: one RL step's training phase, packed + fused
#                    LM head vs padded + logits, Qwen2.5-0.5B (24 layers, bf16), responses up
#                    to 4096 tokens
#   bench-rl         tools/bench_vs_trl.py --device cuda: Qwen2.5-0.5B-shaped RL steps vs TRL
#   bench-weight-sync  tools/bench_weight_sync.py --engines process: s/GB of a 1 GB model's sync
#   summary          tools/gpu_summary.py write OUT_DIR
# --only runs install, build, env and the listed steps (for machines that limit one command's
# time: keep OUT_DIR outside any folder that is emptied between commands; records accumulate).
# build takes seconds when megatron_rl/_C already has the CUDA kernels (e.g. a carried .so).
# Environment: GPU_CHECK_MAX_STEP caps every step's time limit (s), GPU_CHECK_TEST_TIMEOUT is
# pytest's per-test limit (default 300), TORCH_CUDA_ARCH_LIST defaults to this GPU's arch.
# Through a device tool that limits a command to 10 minutes and returns few files (e.g. the
# lent H100: device README): carry .whl/, one heavy step per call, OUT_DIR outside $OUT and
# tarred there. The first call builds (~2 min with one arch):
#   GPU_CHECK_MAX_STEP=400 bash scripts/gpu_check.sh /tmp/gc --only gpu-tests; \
#   tar czf $OUT/gc.tgz -C /tmp gc; tar czf $OUT/so.tgz megatron_rl/_C*.so
# unpack so.tgz here and carry the .so too: later calls skip the build (GPU_CHECK_MAX_STEP=520),
# --only cpu-tier-on-gpu, then bench-kernel,bench-exact-kl, then bench-rl, bench-weight-sync.
# --dry-run (any machine, no CUDA call): wheels present, one version each, dependencies covered
# and installable into a temporary target for CPython 3.12; the extension's sources and
# setup.py; pytest collects the gpu tier and the CPU-tier files; the benchmarks import and
# parse their arguments (the kernel benchmark runs one tiny CPU case); the summary is written.
set -uo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO"

usage() { sed -n '2,43p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
OUT="" WHEELS="$REPO/.whl" DRY=0 SKIP_BENCH=0 ONLY=""
while (($#)); do
    case "$1" in
        --wheels) WHEELS="$2"; shift 2 ;;
        --dry-run) DRY=1; shift ;;
        --skip-bench) SKIP_BENCH=1; shift ;;
        --only) ONLY=",$2,"; shift 2 ;;
        -h|--help) usage ;;
        -*) echo "unknown option $1" >&2; usage ;;
        *) [ -z "$OUT" ] || usage; OUT="$1"; shift ;;
    esac
done
[ -n "$OUT" ] || usage
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"
WHEELS="$(cd "$WHEELS" 2>/dev/null && pwd || echo "$WHEELS")"
SITE="${GPU_CHECK_SITE:-/tmp/megatron_rl_gpu_site}"   # the carried packages
WORK="${GPU_CHECK_WORK:-/tmp/megatron_rl_gpu_work}"   # large scratch (benchmark models)
PYTHON="${PYTHON:-python3}"
BUDGET="${GPU_CHECK_BUDGET:-1500}"
if ! "$PYTHON" -c "import torch" 2>/dev/null && [ -x "$REPO/.venv/bin/python" ]; then
    PYTHON="$REPO/.venv/bin/python"                   # a development checkout without torch
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false MAX_JOBS="${MAX_JOBS:-$(nproc)}"
# one compile worker per process (every training subprocess compiles megatron's fusions), and
# the CPU oracles of 4 pytest workers sharing the machine's cores
export TORCHINDUCTOR_COMPILE_THREADS="${TORCHINDUCTOR_COMPILE_THREADS:-1}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
MAX_STEP="${GPU_CHECK_MAX_STEP:-}"
if ((DRY)); then
    export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
# CPU-tier tests that run again on the device (see cpu-tier-on-gpu above)
CPU_TIER_ON_GPU=(tests/unit/rollout/test_local_engine.py tests/unit/models/test_decode.py
                 tests/unit/test_hostsync_budgets.py tests/unit/test_compat.py
                 tests/e2e/test_train.py)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64
           manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)
T0=$(date +%s)
if [ -z "$ONLY" ]; then  # a fresh report (--only adds to the one in OUT_DIR)
    rm -f "$OUT"/steps.jsonl "$OUT"/env.json "$OUT"/junit_*.xml "$OUT"/bench_*.json "$OUT"/*.log
fi

selected() {  # selected NAME: whether --only (if given) asks for this step
    case "$1" in install|build|env|dry-*) return 0 ;; esac
    [ -z "$ONLY" ] || [[ "$ONLY" == *",$1,"* ]]
}
# step NAME TIMEOUT_S CMD...: run CMD under a timeout, log to OUT/NAME.log, record the outcome
step() {
    local name="$1" limit="$2"; shift 2
    selected "$name" || return 0
    if [ -n "$MAX_STEP" ] && (( limit > MAX_STEP )); then limit="$MAX_STEP"; fi
    local log="$OUT/$name.log" start end rc
    if (( $(date +%s) - T0 >= BUDGET )); then
        skip "$name" "not started: ${BUDGET} s budget spent (GPU_CHECK_BUDGET)"; return 0
    fi
    echo "== [$name] (limit ${limit}s, $(( $(date +%s) - T0 ))s elapsed): $*"
    start=$(date +%s.%N)
    timeout -k 15 "$limit" "$@" >"$log" 2>&1
    rc=$?
    end=$(date +%s.%N)
    tail -n 4 "$log" | sed 's/^/   | /'
    "$PYTHON" tools/gpu_summary.py record "$OUT" --name "$name" --rc "$rc" --timeout "$limit" \
        --seconds "$(awk "BEGIN {print $end - $start}")" --log "$log"
}
skip() {  # skip NAME REASON
    selected "$1" || return 0
    "$PYTHON" tools/gpu_summary.py record "$OUT" --name "$1" --rc=-1 --seconds 0 --note="$2"
}

if ((DRY)); then
    tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
    platform_args=(); for p in "${PLATFORMS[@]}"; do platform_args+=(--platform "$p"); done
    echo "dry run with $PYTHON; a real run does, in order:"
    echo "  install: $PYTHON -m pip install --no-index --no-deps --target $SITE $WHEELS/*.whl"
    echo "  build:   $PYTHON setup.py build_ext --inplace (MAX_JOBS=$MAX_JOBS), check 'cuda' built"
    echo "  env, gpu-tests: $PYTHON -m pytest -m gpu tests --junitxml $OUT/junit_gpu.xml"
    echo "  cpu-tier-on-gpu: $PYTHON -m pytest ${CPU_TIER_ON_GPU[*]}"
    echo "  bench-kernel, bench-exact-kl, bench-rl, summary (OUT_DIR $OUT, scratch $WORK)"
    step dry-wheels 300 bash -c "ls '$WHEELS'/*.whl >/dev/null && \
        '$PYTHON' tools/gpu_summary.py check-wheels '$WHEELS' && \
        '$PYTHON' -m pip install -q --no-index --no-deps --no-compile --target '$tmp/site' \
            --python-version 3.12 --implementation cp --only-binary=:all: ${platform_args[*]} \
            '$WHEELS'/*.whl && echo installed into a temporary target: \$(ls '$tmp/site')"
    step dry-extension 120 bash -c "ls csrc/*.cu csrc/*.cpp && '$PYTHON' setup.py --name && \
        '$PYTHON' -c 'import shutil, torch; print(\"nvcc:\", shutil.which(\"nvcc\"), \
\"| torch CUDA:\", torch.version.cuda, \"| a real run needs both to build the CUDA kernels\")'"
    step dry-gpu-tests 600 bash -c "'$PYTHON' -m pytest --collect-only -q -m gpu tests \
        -p no:cacheprovider | tee '$tmp/collected' | tail -n 3 && \
        grep -q '^tests/gpu/' '$tmp/collected' && \
        echo gpu tests under tests/gpu: \$(grep -c '^tests/gpu/' '$tmp/collected')"
    step dry-cpu-tier-on-gpu 300 "$PYTHON" -m pytest --collect-only -q -p no:cacheprovider \
        -m "not server and not network" "${CPU_TIER_ON_GPU[@]}"
    step dry-bench-kernel 300 "$PYTHON" tools/bench_logprob_kl.py --shapes 64x1000 --reps 1 \
        --json "$OUT/bench_logprob_kl.json"
    step dry-bench-lm-head 300 "$PYTHON" tools/bench_lm_head.py --tokens 64 --hidden 32 \
        --vocab 1000 --dtypes bf16 --reps 1 --exact --json "$OUT/bench_lm_head.json"
    step dry-bench-train-phase 300 "$PYTHON" tools/bench_train_phase.py --dry-run \
        --num-layers 24 --bf16 --max-response 4096 --num-sequences 64 --micro-batch-size 2
    step dry-bench-rl 300 "$PYTHON" tools/bench_vs_trl.py --device cuda --dry-run \
        --out "$WORK/bench_vs_trl"
    step dry-bench-weight-sync 300 "$PYTHON" tools/bench_weight_sync.py --engines process \
        --target-gb 0.02 --repeats 1 --json "$OUT/weight_sync.json"
    step dry-env 60 "$PYTHON" tools/gpu_summary.py env "$OUT"
else
    # where the plugins are installed (they are on the lent H100/H200 image): 300 s per test, so
    # that one hang does not cost the step's junit report; 4 pytest workers sharing the GPU
    PYTEST_OPTS=()
    "$PYTHON" -c "import pytest_timeout" 2>/dev/null && \
        PYTEST_OPTS+=(--timeout "${GPU_CHECK_TEST_TIMEOUT:-300}")
    "$PYTHON" -c "import xdist" 2>/dev/null && PYTEST_OPTS+=(-n 4)
    step install 120 bash -c "ls '$WHEELS'/*.whl >/dev/null && mkdir -p '$SITE' && \
        '$PYTHON' -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target '$SITE' '$WHEELS'/*.whl && \
        '$PYTHON' -c 'import megatron.core, trl, datasets, math_verify, torch; \
print(\"megatron-core\", megatron.core.__version__, \"trl\", trl.__version__, \
\"torch\", torch.__version__, \"cuda\", torch.cuda.is_available())'"
    # this GPU's architecture only, unless TORCH_CUDA_ARCH_LIST says otherwise
    : "${TORCH_CUDA_ARCH_LIST:=$("$PYTHON" -c 'import torch; print("%d.%d" % \
torch.cuda.get_device_capability())' 2>/dev/null)}"
    export TORCH_CUDA_ARCH_LIST
    has_cuda_kernels="from megatron_rl.ops import extension_backends as e; b = e(); print(b); \
assert 'cuda' in b, 'megatron_rl._C was built without the CUDA kernels'"
    # an import error of the built module (e.g. an undefined symbol) is shown as it is
    step build 600 bash -c "if '$PYTHON' -c \"$has_cuda_kernels\" 2>/dev/null; then \
        echo 'megatron_rl._C already has the CUDA kernels: not rebuilt'; else \
        command -v nvcc && echo TORCH_CUDA_ARCH_LIST=\$TORCH_CUDA_ARCH_LIST && \
        '$PYTHON' setup.py build_ext --inplace && '$PYTHON' -c 'import torch, megatron_rl._C' && \
        '$PYTHON' -c \"$has_cuda_kernels\"; fi"
    step env 60 "$PYTHON" tools/gpu_summary.py env "$OUT" --require-cuda
    step gpu-tests 720 "$PYTHON" -m pytest -m gpu tests -p no:cacheprovider -q -rs \
        "${PYTEST_OPTS[@]}" --junitxml "$OUT/junit_gpu.xml"
    step cpu-tier-on-gpu 480 "$PYTHON" -m pytest -p no:cacheprovider -q -rs "${PYTEST_OPTS[@]}" \
        -m "not server and not network" --junitxml "$OUT/junit_cpu_tier_on_gpu.xml" \
        "${CPU_TIER_ON_GPU[@]}"
    if ((SKIP_BENCH)); then
        skip bench-kernel "--skip-bench"; skip bench-exact-kl "--skip-bench"
        skip bench-lm-head "--skip-bench"; skip bench-train-phase "--skip-bench"
        skip bench-rl "--skip-bench"
        skip bench-weight-sync "--skip-bench"
    else
        step bench-kernel 300 "$PYTHON" tools/bench_logprob_kl.py --device cuda \
            --shapes 32768x152064 4096x32000 --json "$OUT/bench_logprob_kl.json"
        step bench-exact-kl 300 "$PYTHON" tools/bench_logprob_kl.py --device cuda --exact \
            --shapes 32768x152064 4096x32000 --json "$OUT/bench_exact_kl.json"
        step bench-lm-head 400 "$PYTHON" tools/bench_lm_head.py --device cuda \
            --tokens 16384 65536 --dtypes bf16 --exact --json "$OUT/bench_lm_head.json"
        step bench-train-phase 600 "$PYTHON" tools/bench_train_phase.py --bf16 --num-layers 24 \
            --max-response 1024 4096 --num-sequences 64 --micro-batch-size 2 \
            --kl k3:loss exact:reward+loss --json "$OUT/bench_train_phase.json"
        step bench-rl 600 "$PYTHON" tools/bench_vs_trl.py --device cuda \
            --out "$WORK/bench_vs_trl" --json "$OUT/bench_vs_trl.json"
        step bench-weight-sync 300 "$PYTHON" tools/bench_weight_sync.py --engines process \
            --target-gb 1 --repeats 3 --work "$WORK/weight_sync" --json "$OUT/weight_sync.json"
    fi
fi
"$PYTHON" tools/gpu_summary.py write "$OUT"
rc=$?
echo "== done in $(( $(date +%s) - T0 )) s (goal for a real run: < 1200 s on one H100)"
cat "$OUT/summary.md"
"$PYTHON" -c "import json, sys; sys.exit(0 if json.load(open('$OUT/summary.json'))['ok'] else 1)" \
    && exit "$rc"
exit 1
