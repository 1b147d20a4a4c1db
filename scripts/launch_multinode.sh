#!/usr/bin/env bash
# Launch `python -m megatron_rl.train` with torchrun on one or many nodes. Run it once per node;
# every argument is passed through to the trainer (e.g. --config examples/<recipe>.yaml, flags).
#
# Environment (defaults in brackets):
#   NNODES         number of nodes                           [$SLURM_NNODES or 1]
#   NODE_RANK      this node's rank, 0 .. NNODES-1            [$SLURM_NODEID or 0]
#   MASTER_ADDR    host name / IP of node 0                   [first host of $SLURM_JOB_NODELIST,
#                                                              or 127.0.0.1 on one node]
#   MASTER_PORT    free TCP port on node 0                    [29500; under SLURM 20000 + job id
#                                                              mod 20000, so jobs sharing a node
#                                                              do not collide]
#   GPUS_PER_NODE  processes per node (one per GPU)           [$SLURM_GPUS_ON_NODE, else the
#                                                              number of GPUs nvidia-smi lists,
#                                                              else 1 (CPU, gloo)]
#   RDZV_BACKEND   torchrun rendezvous: static (ranks follow  [static]
#                  NODE_RANK) or c10d (an elastic store at
#                  MASTER_ADDR:MASTER_PORT hosted by the agent
#                  on that address; nodes may start in any
#                  order and torchrun numbers them itself)
#   RDZV_ID        c10d run id, the same on every node        [$SLURM_JOB_ID, else megatron-rl]
#   TORCHRUN       launcher command                           [torchrun]
#   DRY_RUN=1      print the command instead of running it
#
# Examples:
#   # one node, 8 GPUs
#   bash scripts/launch_multinode.sh --config examples/qwen2.5-7b_math_k1-reward.yaml
#   # two nodes by hand: the same command on both, NODE_RANK 0 and 1
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 bash scripts/launch_multinode.sh --config ...
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 bash scripts/launch_multinode.sh --config ...
#   # SLURM: one task per node; everything else comes from SLURM_* (see docs/launch.md)
#   srun --nodes 2 --ntasks-per-node 1 bash scripts/launch_multinode.sh --config ...
#
# The world size is NNODES x GPUS_PER_NODE; tensor x pipeline parallel sizes must divide it
# (data parallel is the quotient). Only global rank 0 starts a rollout server (vLLM / SGLang).
set -euo pipefail

die() { echo "launch_multinode.sh: $*" >&2; exit 2; }

first_slurm_host() {
    # scontrol expands compressed node lists (node[01-04,07]); without it, take the list's first
    # entry and expand only the simple "prefix[NN-..." form.
    if command -v scontrol >/dev/null 2>&1; then
        scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1
    else
        local first="${SLURM_JOB_NODELIST%%,*}"
        if [[ "$SLURM_JOB_NODELIST" =~ ^([^\[,]+)\[([0-9]+) ]]; then
            first="${BASH_REMATCH[1]}${BASH_REMATCH[2]}"
        fi
        echo "$first"
    fi
}

count_gpus() {
    if command -v nvidia-smi >/dev/null 2>&1; then
        local n
        n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
        if [ "${n:-0}" -gt 0 ]; then echo "$n"; return; fi
    fi
    echo 1
}

if [ -n "${SLURM_JOB_ID:-}" ]; then
    # one torchrun per node: more tasks per node would start several launchers on the same GPUs
    if [ -n "${SLURM_NTASKS:-}" ] && [ -n "${SLURM_NNODES:-}" ] \
        && [ "$SLURM_NTASKS" != "$SLURM_NNODES" ]; then
        die "under SLURM run one task per node (srun --ntasks-per-node 1); got SLURM_NTASKS=$SLURM_NTASKS for SLURM_NNODES=$SLURM_NNODES"
    fi
    NNODES="${NNODES:-${SLURM_NNODES:-1}}"
    NODE_RANK="${NODE_RANK:-${SLURM_NODEID:-0}}"
    if [ -z "${MASTER_ADDR:-}" ] && [ -n "${SLURM_JOB_NODELIST:-}" ]; then
        MASTER_ADDR="$(first_slurm_host)"
    fi
    MASTER_PORT="${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}"
    GPUS_PER_NODE="${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}"
fi

NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_PORT="${MASTER_PORT:-29500}"
GPUS_PER_NODE="${GPUS_PER_NODE:-$(count_gpus)}"
TORCHRUN="${TORCHRUN:-torchrun}"
RDZV_BACKEND="${RDZV_BACKEND:-static}"
RDZV_ID="${RDZV_ID:-${SLURM_JOB_ID:-megatron-rl}}"
if [ -z "${MASTER_ADDR:-}" ]; then
    [ "$NNODES" -eq 1 ] || die "MASTER_ADDR is required with NNODES=$NNODES (node 0's address)"
    MASTER_ADDR=127.0.0.1
fi

for v in NNODES NODE_RANK MASTER_PORT GPUS_PER_NODE; do
    [[ "${!v}" =~ ^[0-9]+$ ]] || die "$v must be a non-negative integer, got '${!v}'"
done
[ "$NNODES" -ge 1 ] || die "NNODES must be >= 1"
[ "$GPUS_PER_NODE" -ge 1 ] || die "GPUS_PER_NODE must be >= 1"
[ "$NODE_RANK" -lt "$NNODES" ] || die "NODE_RANK $NODE_RANK is not below NNODES $NNODES"
case "$RDZV_BACKEND" in
    static|c10d) ;;
    *) die "RDZV_BACKEND must be static or c10d, got '$RDZV_BACKEND'" ;;
esac
[ "$#" -gt 0 ] || die "no training arguments; e.g. --config examples/tiny_cpu.yaml (see docs/launch.md)"

# megatron_rl importable from any working directory (paths in the flags stay relative to it)
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
# torchrun sets OMP_NUM_THREADS=1 per process when unset; say so explicitly (CPU runs need it).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

if [ "$RDZV_BACKEND" = "c10d" ]; then
    rdzv=(--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RDZV_ID")
else
    rdzv=(--node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
fi
# shellcheck disable=SC2206  # TORCHRUN may be a command with arguments (python -m torch.distributed.run)
cmd=($TORCHRUN
     --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" "${rdzv[@]}"
     -m megatron_rl.train "$@")

echo "[launch] node $NODE_RANK/$NNODES on $(hostname): $GPUS_PER_NODE processes," \
     "$RDZV_BACKEND rendezvous $MASTER_ADDR:$MASTER_PORT, world size $((NNODES * GPUS_PER_NODE))" >&2
if [ "${DRY_RUN:-0}" = "1" ]; then
    printf '%q ' "${cmd[@]}"
    echo
    exit 0
fi
exec "${cmd[@]}"
