"""Rollout functions by import path for the `megatron-rl eval` tests (this directory on
PYTHONPATH, or on sys.path under pytest): `recording` appends each call's (evaluation, ctx.step)
as a JSON line to the file $RECORD_STEPS and rolls out single-turn; `failing` raises."""
import json
import os

from megatron_rl.rollout.single_turn import single_turn


def recording(ctx, records):
    with open(os.environ["RECORD_STEPS"], "a") as f:
        f.write(json.dumps([ctx.evaluation, ctx.step]) + "\n")
    return single_turn(ctx, records)


def failing(ctx, records):
    raise RuntimeError("this rollout function fails")
