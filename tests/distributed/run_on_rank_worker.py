"""Worker for test_run_on_rank.py (two ranks under torchrun, gloo): the default process group's
timeout comes from --distributed-timeout-minutes (0.1: 6 s), and rank 0 works alone for longer
than that while rank 1 waits for it. Prints one `RESULT {json}` line per rank and phase:

    error   rank 0's work raises: rank 1 gets RankFailed naming rank 0 and the error, at once
    slow    rank 0's work (through on_client) takes 9 s: both ranks get its result
    groups  megatron-core's groups took the same timeout
    plain   rank 0 keeps rank 1 waiting 9 s in a plain collective: rank 1 fails after ~6 s
            (what the timeout does to a wait inside a collective; the default group is unusable
            after it, so this phase comes last)
"""
import datetime
import json
import os
import time
import types

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps  # imported before the ranks meet (slow import)

from megatron_rl.parallel import ParallelConfig, RankFailed, init_distributed, run_on_rank
from megatron_rl.rollout.base import on_client

TIMEOUT_MINUTES = 0.1   # 6 s
WORK_S = 9.0            # longer than the timeout


def report(phase: str, **fields) -> None:
    print("RESULT " + json.dumps({"phase": phase, "rank": dist.get_rank(), **fields}), flush=True)


def meet_before_init() -> None:
    """Both ranks reach init_distributed together: its rendezvous has the 6 s timeout too, and
    importing megatron on a busy machine can put the ranks seconds apart. torchrun's agent
    hosts the store at MASTER_ADDR:MASTER_PORT."""
    world = int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=False, timeout=datetime.timedelta(seconds=120))
    store.add("run_on_rank_worker/arrived", 1)
    while store.add("run_on_rank_worker/arrived", 0) < world:
        time.sleep(0.05)


def fail_on_client():
    raise ValueError("the server sent 3 completions for 4 prompts")


def slow_batch():
    time.sleep(WORK_S)
    return {"prompts": [[1, 2, 3]], "rewards": [1.0, 0.0]}


def main() -> None:
    meet_before_init()
    init_distributed(ParallelConfig(distributed_timeout_minutes=TIMEOUT_MINUTES))
    rank = dist.get_rank()

    t0 = time.monotonic()
    try:
        run_on_rank(0, fail_on_client, "generating step 7's batch")
        report("error", raised=None)
    except (ValueError, RankFailed) as e:
        report("error", raised=type(e).__name__, message=str(e), seconds=time.monotonic() - t0)

    t0 = time.monotonic()
    out = on_client(types.SimpleNamespace(client_rank=0), slow_batch, "generating step 8's batch")
    report("slow", result=out, seconds=time.monotonic() - t0)

    cpu = torch.device("cpu")
    report("groups", seconds={
        name: group._get_backend(cpu).options._timeout.total_seconds()
        for name, group in (("default", dist.group.WORLD),
                            ("data_parallel", ps.get_data_parallel_group()),
                            ("model_parallel", ps.get_model_parallel_group()))})

    t0 = time.monotonic()
    if rank == 0:
        time.sleep(WORK_S)  # outlive rank 1's timeout: it must see a timeout, not a closed peer
    else:
        try:
            dist.broadcast_object_list([None], src=0)
            report("plain", raised=None)
        except RuntimeError as e:
            report("plain", raised=type(e).__name__, message=str(e)[:300],
                   seconds=time.monotonic() - t0)
    os._exit(0)  # the default group is broken now: no teardown through it


if __name__ == "__main__":
    main()
    from megatron_rl.processes import skip_exit_collection

    skip_exit_collection()  # the heap is the imports': no shutdown collection over it
