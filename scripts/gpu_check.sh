#!/usr/bin/env bash
# The one-command GPU verification kit: on a bare single-GPU Linux machine with a CUDA PyTorch,
# nvcc and no network, install the carried wheels, build the CUDA extension, run the gpu test
# tier and the CPU-tier tests that matter on the device, run the GPU benchmarks, and write
# OUT_DIR/summary.json and OUT_DIR/summary.md. Ordered for a lent machine's 15 minutes: what
# the training phase's speed rests on first (the packed attention equivalence tests, then the
# training-phase benchmark with MFU), then the rest; about 20 min for all steps on one H100.
#
#   bash scripts/gather_gpu_wheels.sh                 # here, with PyPI: wheels into .whl/
#   bash scripts/gpu_check.sh OUT_DIR [--wheels DIR] [--only STEP,...] [--skip-bench]
#       [--pack DEST] [--step NAME=COMMAND]... [--no-setup] [--dry-run]
#
# Steps (a failed step does not stop the later ones; the exit status is 0 only when every step
# passed, no test failed and CUDA was available):
#   install          pip install --no-index --no-deps --target $SITE DIR/*.whl (the machine's
#                    torch, transformers... are untouched; $SITE goes on PYTHONPATH), then
#                    tools/gpu_summary.py check-installed: every carried wheel's requirements
#                    against the versions installed there (scripts/gpu_machine_packages.txt
#                    records what is known of them beforehand)
#   build            python setup.py build_ext --inplace: megatron_rl/_C with the CUDA kernels
#                    (the build that `pip install --no-build-isolation -e .` runs, without
#                    writing into the machine's site-packages); fails unless "cuda" is built;
#                    seconds when megatron_rl/_C already has the CUDA kernels (a carried .so);
#                    then setup.py egg_info: the package's metadata in the checkout (on
#                    PYTHONPATH), so that `python -m megatron_rl.cli` finds its commands
#   env              OUT_DIR/env.json: device, driver, torch / CUDA / nvcc, package versions
#   packed-attention pytest -m gpu on the packed attention equivalence tests
#                    (PACKED_ATTENTION_TESTS: tests/gpu/test_*varlen*.py and
#                    test_*packed_attention*.py): the CUDA path's one attention call per layer
#                    for a packed row against the per-sequence loop, outputs and gradients in
#                    bf16, and the packed step's host syncs and launches
#   bench-train-phase  tools/bench_train_phase.py: one RL step's training phase, packed + fused
#                    LM head vs padded + logits, Qwen2.5-1.5B then Qwen2.5-0.5B (bf16, all their
#                    layers), 64 long-tailed sequences with responses up to 4096 tokens, K3 in
#                    the loss, one untimed step first (a first step on a GPU pays one-time costs,
#                    e.g. torch.compile's), each worker allowed all of the GPU's memory: s/step,
#                    tokens/s, model FLOPs and MFU against the GPU's dense bf16 peak; its JSON
#                    is rewritten after each configuration, so a cut step keeps what it measured
#   gpu-tests        pytest -m gpu tests (tests/gpu and the gpu-marked tests elsewhere; not the
#                    packed attention tests when packed-attention ran in the same command)
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
#   bench-rl         tools/bench_vs_trl.py --device cuda: Qwen2.5-0.5B-shaped RL steps vs TRL
#   bench-weight-sync  tools/bench_weight_sync.py --engines process: s/GB of a 1 GB model's sync
#   summary          tools/gpu_summary.py write OUT_DIR (also when the kit is stopped: below)
# --only STEP,...: install, build, env and the listed steps (--no-setup: not the first three,
# for a later command on the same machine, where $SITE and the built extension still are);
# records accumulate in OUT_DIR (without --only it starts afresh). --step NAME=COMMAND: one
# more step after the others, COMMAND run by bash with the kit's environment ($PYTHON, the
# carried packages on PYTHONPATH), e.g. --only none --step 'lm-head=$PYTHON -m pytest -x
# tests/gpu/test_gpu_lm_head.py'. --dry-run (any machine, no CUDA call): wheels present, one
# version each, requirements met (scripts/gpu_machine_packages.txt) and installable into a
# temporary target for CPython 3.12; the extension's sources and setup.py; pytest collects the
# packed attention tests, the gpu tier and the CPU-tier files; the benchmarks import and parse
# their arguments (the training phase's plans its batches and FLOPs); --only selects among
# these dry-* steps as among the real ones; it prints the order of a real run first.
#
# Time (a lent machine stops a command at 10 minutes): the whole command ends within
# GPU_CHECK_TIME_LIMIT s (default 600; 0: no limit). Every step is cut at that limit minus
# GPU_CHECK_RESERVE s (default 45: the summary, the archive and the 15 s a step that ignores
# its interrupt gets before it is killed); a step is interrupted (SIGINT: pytest still writes
# its junit report) at its own limit, and one with less than 5 s left is not started. pytest
# steps get a per-test timeout of min(GPU_CHECK_TEST_TIMEOUT (300), a third of the step's
# limit) and a session timeout that ends them before the step's limit (pytest-timeout's
# --timeout and --session-timeout, where installed; 4 xdist workers where pytest-xdist is).
# If the kit itself gets SIGTERM or SIGINT (a machine's own limit), it records the running step
# as interrupted and the steps not reached as skipped, writes the summary and packs, then
# stops the running step.
#
# --pack DEST (e.g. the device tool's $OUT, which returns at most 8 files, 16 MiB each): at
# the end, or when the kit is stopped, DEST/gpu_check.tgz (all of OUT_DIR, logs cut to their
# last 2 MiB if needed), DEST/summary.md, DEST/summary.json and, when this command built the
# extension, DEST/extension.tgz (megatron_rl/_C.cpython-312-x86_64-linux-gnu.so, stripped).
#
# Recipe for the lent H100 / H200 (device README: one command <= 600 s, 15 min of device time a
# session counting the fresh machine's ~1-2 min start and 30 s warm after each call, 64 MiB
# carried). The default order: install, build, env, packed-attention, bench-train-phase,
# gpu-tests, cpu-tier-on-gpu, bench-kernel, bench-exact-kl, bench-lm-head, bench-rl,
# bench-weight-sync. Times seen on an H200 (2026-11-26): install 18 s, build 55 s (seconds with
# a carried .so), gpu tier 169 s, CPU-tier files on the GPU 260 s, kernel + exact-KL + LM-head
# benchmarks 86 s, a training-phase worker ~25 s plus its steps.
#   1 timeout_s 600, carrying .whl: GPU_CHECK_TIME_LIMIT=570 bash scripts/gpu_check.sh /tmp/gc \
#        --pack $OUT
#     If only one call is possible, this is it, and it gets: the build; the packed attention
#     equivalence tests (6 tests, about a minute with CUDA's start); the training-phase
#     benchmark with tokens/s and MFU, both paths at Qwen2.5-1.5B, then at 0.5B (estimated
#     3-5 minutes; cut at its limit, it keeps the configurations finished before); then as
#     much of the gpu tier as the remaining minutes allow (cut at the limit, its junit report
#     written); every step not started is recorded as skipped, and the summary and the
#     archive are written either way.
#   2 at once, while the machine is warm (30 s), timeout_s = the session's device time left
#        - 30 s: GPU_CHECK_TIME_LIMIT=<timeout_s - 20> GPU_CHECK_RESERVE=25 bash \
#        scripts/gpu_check.sh /tmp/gc2 --pack $OUT --no-setup --only <the steps call 1 cut or
#        skipped, e.g. gpu-tests,cpu-tier-on-gpu>
#   here: python tools/gpu_summary.py merge gpu_results <call 1, 2>/gpu_check.tgz
# A step its call's time limit cut or skipped says so in the summary; run it in a later
# session's call (--only NAME) and merge that archive too. bench-rl (RL steps vs TRL, minutes)
# needs a call of its own. Without a per-command limit: GPU_CHECK_TIME_LIMIT=0 runs everything.
# Environment: GPU_CHECK_TIME_LIMIT, GPU_CHECK_RESERVE, GPU_CHECK_TEST_TIMEOUT (above),
# GPU_CHECK_SITE / GPU_CHECK_WORK (the carried packages / benchmark scratch, under /tmp),
# PYTHON (default python3, the interpreter with torch), TORCH_CUDA_ARCH_LIST (default: this
# GPU's architecture).
set -uo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO"

usage() { awk 'NR > 1 { if (!/^#/) exit; sub(/^# ?/, ""); print }' "$0"; exit 2; }
OUT="" WHEELS="$REPO/.whl" DRY=0 SKIP_BENCH=0 ONLY="" PACK="" SETUP=1 EXTRA=()
while (($#)); do
    case "$1" in
        --wheels|--only|--pack|--step) [ $# -ge 2 ] || { echo "$1 needs a value" >&2; usage; } ;;
    esac
    case "$1" in
        --wheels) WHEELS="$2"; shift 2 ;;
        --dry-run) DRY=1; shift ;;
        --skip-bench) SKIP_BENCH=1; shift ;;
        --only) ONLY=",$2,"; shift 2 ;;
        --pack) PACK="$2"; shift 2 ;;
        --no-setup) SETUP=0; shift ;;
        --step)
            if [[ ! "$2" =~ ^[A-Za-z0-9_.-]+=. ]]; then
                echo "--step needs NAME=COMMAND, NAME of letters, digits, '.', '_', '-': $2" >&2
                usage
            fi
            EXTRA+=("$2"); shift 2 ;;
        -h|--help) usage ;;
        -*) echo "unknown option $1" >&2; usage ;;
        *) [ -z "$OUT" ] || usage; OUT="$1"; shift ;;
    esac
done
[ -n "$OUT" ] || usage
T0=$(date +%s)
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"
WHEELS="$(cd "$WHEELS" 2>/dev/null && pwd || echo "$WHEELS")"
if [ -n "$PACK" ]; then
    mkdir -p "$PACK" && PACK="$(cd "$PACK" && pwd)"
    if [[ "$OUT/" == "$PACK/"* ]]; then  # the archive would hold itself, DEST too many files
        echo "--pack $PACK: OUT_DIR $OUT must lie outside it (e.g. /tmp/gc)" >&2; exit 2
    fi
fi
SITE="${GPU_CHECK_SITE:-/tmp/megatron_rl_gpu_site}"   # the carried packages
WORK="${GPU_CHECK_WORK:-/tmp/megatron_rl_gpu_work}"   # large scratch (benchmark models)
PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c "import torch" 2>/dev/null && [ -x "$REPO/.venv/bin/python" ]; then
    PYTHON="$REPO/.venv/bin/python"                   # a development checkout without torch
fi
TIME_LIMIT="${GPU_CHECK_TIME_LIMIT:-600}"
RESERVE="${GPU_CHECK_RESERVE:-45}"
TEST_TIMEOUT="${GPU_CHECK_TEST_TIMEOUT:-300}"
export PYTHON PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false MAX_JOBS="${MAX_JOBS:-$(nproc)}"
# one compile worker per process (every training subprocess compiles megatron's fusions), and
# the CPU oracles of 4 pytest workers sharing the machine's cores
export TORCHINDUCTOR_COMPILE_THREADS="${TORCHINDUCTOR_COMPILE_THREADS:-1}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
if ((DRY)); then
    export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
# CPU-tier tests that run again on the device (see cpu-tier-on-gpu above)
CPU_TIER_ON_GPU=(tests/unit/rollout/test_local_engine.py tests/unit/models/test_decode.py
                 tests/unit/test_hostsync_budgets.py tests/unit/test_compat.py
                 tests/e2e/test_train.py)
# the packed attention equivalence tests, the first thing a call checks after the build; a
# selection by name where no such file exists
PACKED_ATTENTION_TESTS=()
for f in tests/gpu/test_*varlen*.py tests/gpu/test_*packed_attention*.py; do
    [ -e "$f" ] && PACKED_ATTENTION_TESTS+=("$f")
done
GPU_TESTS_IGNORE=()  # gpu-tests leaves out what packed-attention ran in the same command
for f in "${PACKED_ATTENTION_TESTS[@]}"; do GPU_TESTS_IGNORE+=("--ignore=$f"); done
((${#PACKED_ATTENTION_TESTS[@]})) || PACKED_ATTENTION_TESTS=(tests/gpu -k "varlen or packed_attention")
# the training-phase benchmark (tools/bench_train_phase.py), its GPU sizes
BENCH_TRAIN_PHASE=(tools/bench_train_phase.py --bf16 --model qwen2.5-1.5b qwen2.5-0.5b
                   --max-response 4096 --num-sequences 64 --micro-batch-size 2 --warmup 1
                   --kl k3:loss)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64
           manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)
SETUP_STEPS=",install,build,env,dry-wheels,dry-extension,dry-env,"
# the order of a real run (--dry-run prints it)
REAL_PLAN=(install build env packed-attention bench-train-phase gpu-tests cpu-tier-on-gpu
           bench-kernel bench-exact-kl bench-lm-head bench-rl bench-weight-sync)
if ((DRY)); then
    PLAN=(dry-wheels dry-extension dry-packed-attention dry-bench-train-phase dry-gpu-tests
          dry-cpu-tier-on-gpu dry-bench-kernel dry-bench-lm-head dry-bench-rl
          dry-bench-weight-sync dry-env)
else
    PLAN=("${REAL_PLAN[@]}")
fi
for e in "${EXTRA[@]}"; do PLAN+=("${e%%=*}"); done
if [ -z "$ONLY" ]; then  # a fresh report (--only adds to the one in OUT_DIR)
    rm -f "$OUT"/steps.jsonl "$OUT"/env.json "$OUT"/junit_*.xml "$OUT"/bench_*.json \
        "$OUT"/weight_sync.json "$OUT"/*.log "$OUT"/summary.json "$OUT"/summary.md
fi
TMP="$(mktemp -d)"
touch "$TMP/started"   # the extension packed is one this command built (newer than this)

selected() {  # selected NAME: whether this run does step NAME
    if [[ "$SETUP_STEPS" == *",$1,"* ]]; then return $((1 - SETUP)); fi
    local e
    for e in "${EXTRA[@]}"; do [ "${e%%=*}" != "$1" ] || return 0; done
    [ -z "$ONLY" ] || [[ "$ONLY" == *",${1#dry-},"* ]]
}
record() {  # record NAME RC SECONDS LIMIT LOG NOTE
    "$PYTHON" tools/gpu_summary.py record "$OUT" --name "$1" --rc="$2" --seconds "$3" \
        --timeout "$4" --log "$5" --note="$6"
}
skip() {  # skip NAME REASON
    selected "$1" || return 0
    record "$1" -1 0 0 "" "$2"
    DONE+="$1,"
}
CURRENT="" CURRENT_START=0 STEP_PID="" DONE="," NOMINAL=0 LIMIT=0 TEST_TO=0 SESSION_TO=0
plan() {  # plan NAME NOMINAL_S: LIMIT, TEST_TO, SESSION_TO for the step, or a skip record
    local elapsed=$(( $(date +%s) - T0 ))
    NOMINAL="$2" LIMIT=0 TEST_TO=0 SESSION_TO=0
    read -r LIMIT TEST_TO SESSION_TO < <("$PYTHON" tools/gpu_summary.py plan-step "$2" \
        --elapsed "$elapsed" --time-limit "$TIME_LIMIT" --reserve "$RESERVE" \
        --test-timeout "$TEST_TIMEOUT")
    if [ "${LIMIT:-0}" -gt 0 ] 2>/dev/null; then return 0; fi
    skip "$1" "not started: ${elapsed} s of the command's ${TIME_LIMIT} s gone, ${RESERVE} s kept \
for the summary (GPU_CHECK_TIME_LIMIT, GPU_CHECK_RESERVE)"
    return 1
}
# run NAME CMD...: CMD under `timeout` (SIGINT at LIMIT, SIGKILL 15 s later), in the background
# so that a signal to the kit is handled at once; logged to OUT/NAME.log and recorded
run() {
    local name="$1"; shift
    local log="$OUT/$name.log" rc end note=""
    echo "== [$name] (limit ${LIMIT}s, $(( $(date +%s) - T0 ))s elapsed): $*"
    CURRENT="$name" CURRENT_START=$(date +%s.%N)
    timeout -s INT -k 15 "$LIMIT" "$@" >"$log" 2>&1 </dev/null &
    STEP_PID=$!
    wait "$STEP_PID"
    rc=$?
    end=$(date +%s.%N)
    CURRENT="" STEP_PID=""
    tail -n 4 "$log" | sed 's/^/   | /'
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        note="cut at its limit of ${LIMIT} s"
        if [ "$LIMIT" -lt "$NOMINAL" ]; then
            note+=" (its own is ${NOMINAL} s: the command's time limit, GPU_CHECK_TIME_LIMIT)"
        fi
    fi
    record "$name" "$rc" "$(awk "BEGIN {print $end - $CURRENT_START}")" "$LIMIT" "$log" "$note"
    DONE+="$name,"
}
step() {  # step NAME NOMINAL_S CMD...
    local name="$1" nominal="$2"; shift 2
    selected "$name" || return 0
    plan "$name" "$nominal" || return 0
    run "$name" "$@"
}
HAVE_TIMEOUT=0 HAVE_SESSION_TIMEOUT=0 HAVE_XDIST=0
if ! ((DRY)); then  # the plugins are on the lent H100 / H200 image
    "$PYTHON" -c "import pytest_timeout" 2>/dev/null && HAVE_TIMEOUT=1
    "$PYTHON" -c "import pytest_timeout as p; assert hasattr(p, 'SESSION_TIMEOUT_KEY')" \
        2>/dev/null && HAVE_SESSION_TIMEOUT=1
    "$PYTHON" -c "import xdist" 2>/dev/null && HAVE_XDIST=1
fi
pytest_step() {  # pytest_step NAME NOMINAL_S PYTEST_ARGS...: with the per-test and session limits
    local name="$1" nominal="$2"; shift 2
    selected "$name" || return 0
    plan "$name" "$nominal" || return 0
    local opts=()
    ((HAVE_TIMEOUT)) && opts+=(--timeout "$TEST_TO")
    ((HAVE_SESSION_TIMEOUT)) && opts+=(--session-timeout "$SESSION_TO")
    # PYTEST_WORKERS: xdist workers (4; 0 for a step of a few tests, which would pay 4 CUDA
    # initialisations for nothing)
    ((HAVE_XDIST)) && [ "${PYTEST_WORKERS:-4}" -gt 0 ] && opts+=(-n "${PYTEST_WORKERS:-4}")
    run "$name" "$PYTHON" -m pytest -p no:cacheprovider -q -rs "${opts[@]}" "$@"
}

FINISHED=0
finish() {  # the summary, and the archive with --pack
    "$PYTHON" tools/gpu_summary.py write "$OUT"
    [ -n "$PACK" ] || return 0
    local so ext=()
    so=$(find "$REPO/megatron_rl" -maxdepth 1 -name "_C.cpython-*.so" -newer "$TMP/started" \
        2>/dev/null | head -n 1)
    [ -z "$so" ] || ext=(--extension "$so")
    "$PYTHON" tools/gpu_summary.py pack "$OUT" "$PACK" "${ext[@]}"
}
on_signal() {  # on_signal SIG CODE: the kit was told to stop
    local sig="$1" code="$2" name
    trap '' TERM INT
    echo "== stopped by SIG$sig after $(( $(date +%s) - T0 )) s"
    if [ -n "$CURRENT" ]; then
        record "$CURRENT" "$code" "$(awk "BEGIN {print $(date +%s.%N) - $CURRENT_START}")" \
            "$LIMIT" "$OUT/$CURRENT.log" "the kit was stopped by SIG$sig during this step \
($(( $(date +%s) - T0 )) s into the command)"
        DONE+="$CURRENT,"
    fi
    for name in "${PLAN[@]}"; do
        if selected "$name" && [[ "$DONE" != *",$name,"* ]]; then
            record "$name" -1 0 0 "" "not reached: the kit was stopped by SIG$sig"
        fi
    done
    finish   # first, while the machine may still be waiting to kill us
    FINISHED=1
    if [ -n "$STEP_PID" ]; then  # then the step: interrupted, so that pytest writes its report
        kill -INT "$STEP_PID" 2>/dev/null
        for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$STEP_PID" 2>/dev/null || break; sleep 0.5; done
        kill -KILL -- "-$STEP_PID" 2>/dev/null
        finish   # again, with what the interrupted step wrote
    fi
    exit "$code"
}
on_exit() {
    ((FINISHED)) || finish
    rm -rf "$TMP"
}
trap 'on_signal TERM 143' TERM
trap 'on_signal INT 130' INT
trap on_exit EXIT

if ((DRY)); then
    platform_args=(); for p in "${PLATFORMS[@]}"; do platform_args+=(--platform "$p"); done
    echo "dry run with $PYTHON; a real run does, in order:"
    echo "order: ${REAL_PLAN[*]}"
    echo "  install: $PYTHON -m pip install --no-index --no-deps --target $SITE $WHEELS/*.whl"
    echo "  build:   $PYTHON setup.py build_ext --inplace (MAX_JOBS=$MAX_JOBS), check 'cuda' built"
    echo "  env, packed-attention: $PYTHON -m pytest -m gpu ${PACKED_ATTENTION_TESTS[*]}"
    echo "  bench-train-phase: $PYTHON ${BENCH_TRAIN_PHASE[*]}"
    echo "  gpu-tests: $PYTHON -m pytest -m gpu tests ${GPU_TESTS_IGNORE[*]}"
    echo "  cpu-tier-on-gpu: $PYTHON -m pytest ${CPU_TIER_ON_GPU[*]}"
    echo "  bench-kernel, bench-exact-kl, bench-lm-head, bench-rl, bench-weight-sync, summary"
    echo "  (OUT_DIR $OUT, scratch $WORK)"
    step dry-wheels 300 bash -c "ls '$WHEELS'/*.whl >/dev/null && \
        '$PYTHON' tools/gpu_summary.py check-wheels '$WHEELS' --pins && \
        '$PYTHON' -m pip install -q --no-index --no-deps --no-compile --target '$TMP/site' \
            --python-version 3.12 --implementation cp --only-binary=:all: ${platform_args[*]} \
            '$WHEELS'/*.whl && echo installed into a temporary target: \$(ls '$TMP/site')"
    step dry-extension 120 bash -c "ls csrc/*.cu csrc/*.cpp && '$PYTHON' setup.py --name && \
        '$PYTHON' -c 'import shutil, torch; print(\"nvcc:\", shutil.which(\"nvcc\"), \
\"| torch CUDA:\", torch.version.cuda, \"| a real run needs both to build the CUDA kernels\")'"
    step dry-packed-attention 300 bash -c "'$PYTHON' -m pytest --collect-only -q -m gpu \
        -p no:cacheprovider ${PACKED_ATTENTION_TESTS[*]@Q} | tee '$TMP/packed' | tail -n 3 && \
        grep -q '^tests/gpu/' '$TMP/packed' && \
        echo packed attention tests: \$(grep -c '^tests/gpu/' '$TMP/packed')"
    step dry-bench-train-phase 300 "$PYTHON" "${BENCH_TRAIN_PHASE[@]}" --dry-run
    step dry-gpu-tests 600 bash -c "'$PYTHON' -m pytest --collect-only -q -m gpu tests \
        -p no:cacheprovider | tee '$TMP/collected' | tail -n 3 && \
        grep -q '^tests/gpu/' '$TMP/collected' && \
        echo gpu tests under tests/gpu: \$(grep -c '^tests/gpu/' '$TMP/collected')"
    step dry-cpu-tier-on-gpu 300 "$PYTHON" -m pytest --collect-only -q -p no:cacheprovider \
        -m "not server and not network" "${CPU_TIER_ON_GPU[@]}"
    step dry-bench-kernel 300 "$PYTHON" tools/bench_logprob_kl.py --shapes 64x1000 --reps 1 \
        --json "$OUT/bench_logprob_kl.json"
    step dry-bench-lm-head 300 "$PYTHON" tools/bench_lm_head.py --tokens 64 --hidden 32 \
        --vocab 1000 --dtypes bf16 --reps 1 --exact --json "$OUT/bench_lm_head.json"
    step dry-bench-rl 300 "$PYTHON" tools/bench_vs_trl.py --device cuda --dry-run \
        --out "$WORK/bench_vs_trl"
    step dry-bench-weight-sync 300 "$PYTHON" tools/bench_weight_sync.py --engines process \
        --target-gb 0.02 --repeats 1 --json "$OUT/weight_sync.json"
    step dry-env 60 "$PYTHON" tools/gpu_summary.py env "$OUT"
else
    step install 180 bash -c "ls '$WHEELS'/*.whl >/dev/null && mkdir -p '$SITE' && \
        '$PYTHON' -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target '$SITE' '$WHEELS'/*.whl && \
        '$PYTHON' -c 'import megatron.core, trl, datasets, math_verify, torch; \
print(\"megatron-core\", megatron.core.__version__, \"trl\", trl.__version__, \
\"torch\", torch.__version__, \"cuda\", torch.cuda.is_available())' && \
        '$PYTHON' tools/gpu_summary.py check-installed '$WHEELS'"
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
        '$PYTHON' -c \"$has_cuda_kernels\"; fi && \
        '$PYTHON' setup.py -q egg_info >/dev/null"
    step env 60 "$PYTHON" tools/gpu_summary.py env "$OUT" --require-cuda --wheels "$WHEELS"
    PYTEST_WORKERS=0 pytest_step packed-attention 300 -m gpu \
        --junitxml "$OUT/junit_packed_attention.xml" "${PACKED_ATTENTION_TESTS[@]}"
    if ((SKIP_BENCH)); then
        skip bench-train-phase "--skip-bench"
    else
        step bench-train-phase 420 "$PYTHON" "${BENCH_TRAIN_PHASE[@]}" \
            --workdir "$WORK/bench_train_phase" --json "$OUT/bench_train_phase.json"
    fi
    selected packed-attention || GPU_TESTS_IGNORE=()
    pytest_step gpu-tests 720 -m gpu --junitxml "$OUT/junit_gpu.xml" "${GPU_TESTS_IGNORE[@]}" \
        tests
    pytest_step cpu-tier-on-gpu 480 -m "not server and not network" \
        --junitxml "$OUT/junit_cpu_tier_on_gpu.xml" "${CPU_TIER_ON_GPU[@]}"
    if ((SKIP_BENCH)); then
        for b in bench-kernel bench-exact-kl bench-lm-head bench-rl bench-weight-sync; do
            skip "$b" "--skip-bench"
        done
    else
        step bench-kernel 300 "$PYTHON" tools/bench_logprob_kl.py --device cuda \
            --shapes 32768x152064 4096x32000 --json "$OUT/bench_logprob_kl.json"
        step bench-exact-kl 300 "$PYTHON" tools/bench_logprob_kl.py --device cuda --exact \
            --shapes 32768x152064 4096x32000 --json "$OUT/bench_exact_kl.json"
        step bench-lm-head 400 "$PYTHON" tools/bench_lm_head.py --device cuda \
            --tokens 16384 65536 --dtypes bf16 --exact --json "$OUT/bench_lm_head.json"
        step bench-rl 600 "$PYTHON" tools/bench_vs_trl.py --device cuda \
            --out "$WORK/bench_vs_trl" --json "$OUT/bench_vs_trl.json"
        step bench-weight-sync 300 "$PYTHON" tools/bench_weight_sync.py --engines process \
            --target-gb 1 --repeats 3 --work "$WORK/weight_sync" --json "$OUT/weight_sync.json"
    fi
fi
for e in "${EXTRA[@]}"; do
    step "${e%%=*}" 600 bash -c "${e#*=}"
done
finish
FINISHED=1
echo "== done in $(( $(date +%s) - T0 )) s"
cat "$OUT/summary.md"
"$PYTHON" -c 'import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))["ok"] else 1)' \
    "$OUT/summary.json"
