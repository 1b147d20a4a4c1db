#!/usr/bin/env bash
# The same reproduction with a real model on GPUs: tools/reproduce.py with
# --hf-checkpoint, MATH for training, MATH500 in domain, MMLU college science out of domain.
# Not run on GPUs by this project: a recipe, expected to need adjustment to your cluster.
#
#   MODEL=checkpoints/Qwen2.5-7B NPROC=8 bash scripts/reproduce_gpu.sh [extra reproduce.py flags]
#
# Per run: examples/qwen2.5-7b_math_k1-reward.yaml (TP4 x DP2, bf16, RLOO, 64 prompts x 5
# samples, lr 1e-6, vLLM rollouts); reproduce.py overrides the KL estimator/placement/beta,
# seed, PPO minibatches and async level per run, and --train-iters/--eval-interval. The full
# grid is 162 runs of STEPS steps: at roughly 1-2 min per step for a 7B model on 8 H100s that
# is weeks of GPU time; start with e.g. `--seeds 1 --betas 0.05 1 --regimes on`.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL="${MODEL:-checkpoints/Qwen2.5-7B}"
DATA="${DATA:-data}"
NPROC="${NPROC:-8}"
STEPS="${STEPS:-500}"
if [ ! -f "$DATA/math_train.jsonl" ]; then
    python tools/prepare_data.py --out-dir "$DATA" math_train math500 mmlu_college_science
fi
python tools/reproduce.py --out outputs/reproduce_gpu \
    --report outputs/reproduce_gpu/results.md --figures outputs/reproduce_gpu/figures \
    --hf-checkpoint "$MODEL" \
    --train-data "$DATA/math_train.jsonl" --eval-data "$DATA/math500.jsonl" \
    --ood-data "$DATA/mmlu_college_science.jsonl" \
    --launcher "torchrun --nproc-per-node $NPROC" \
    --train-args "--config examples/qwen2.5-7b_math_k1-reward.yaml" \
    --eval-args "--tensor-model-parallel-size 4 --samples 4 --max-new-tokens 1024" \
    --betas 0.05 0.1 0.3 1 --seeds 1 2 3 --regimes on off --async-levels 2 \
    --steps "$STEPS" --eval-interval 25 "$@"
