"""A rollout function given by import path (--rollout-function log_fault_rollout:breaking_logs,
with this directory on PYTHONPATH and the run's --save as --rollout-function-args' "save") that breaks the run's logs from inside the trainer, at a
known moment: when step LOG_FAULT_STEP's batch (0-based, the step logged as LOG_FAULT_STEP + 1)
is rolled out, <save>/metrics.jsonl is moved to metrics.jsonl.moved and a directory takes its
place (what no process can append to, root included), and <save>/tensorboard is removed (a
cleanup script, a quota). The batch itself is the built-in single-turn one."""
import os
import shutil

from megatron_rl.rollout.single_turn import single_turn


def breaking_logs(ctx, records):
    if not ctx.evaluation and ctx.step == int(os.environ["LOG_FAULT_STEP"]):
        save = ctx.args["save"]
        metrics = os.path.join(save, "metrics.jsonl")
        os.rename(metrics, metrics + ".moved")
        os.mkdir(metrics)
        shutil.rmtree(os.path.join(save, "tensorboard"))
    return single_turn(ctx, records)
