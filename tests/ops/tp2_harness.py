"""Vocab-parallel ops on two gloo ranks, for tests/ops (imported as `tp2_harness`; pytest puts
this directory on sys.path).

`run_two_ranks(case, backends)` spawns two processes; for every split in TP2_SPLITS, backend and
dtype (fp32, bf16) each rank calls `case(rank, split, backend, dtype, group)`, which computes on
its shard of the vocabulary and returns (outputs, gradient shard [rows, split[rank]]). The
gradient shards are gathered (shards may differ in size: each one is broadcast in turn) and rank
0's {(split, backend, dtype): (outputs, full gradient)} comes back to the test. `case` must be a
module-level function (it is pickled by name into the spawned processes).
"""
from __future__ import annotations

import os
import tempfile

import torch

TP2_SPLITS = [(500, 500), (515, 516)]  # even shards, and uneven ones (any V_local works)
DTYPES = (torch.float32, torch.bfloat16)


def run_two_ranks(case, backends: list[str]) -> dict:
    import torch.multiprocessing as mp

    from megatron_rl.rollout.net import free_port

    with tempfile.TemporaryDirectory() as tmp:
        result_file = os.path.join(tmp, "results.pt")
        mp.spawn(_worker, args=(case, backends, f"tcp://127.0.0.1:{free_port()}", result_file),
                 nprocs=2, join=True)
        return torch.load(result_file)


def _worker(rank, case, backends, init_method, result_file):
    import torch.distributed as dist

    from megatron_rl.parallel import destroy_distributed
    from megatron_rl.processes import skip_exit_collection

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    try:
        results = {}
        for split in TP2_SPLITS:
            for backend in backends:
                for dtype in DTYPES:
                    outs, grad = case(rank, split, backend, dtype, dist.group.WORLD)
                    shards = []
                    for src in range(2):
                        buf = (grad.clone() if src == rank
                               else torch.empty(grad.shape[0], split[src], dtype=grad.dtype))
                        dist.broadcast(buf, src=src)
                        shards.append(buf)
                    results[(split, backend, dtype)] = (outs, torch.cat(shards, dim=1))
        if rank == 0:
            torch.save(results, result_file)
    finally:
        destroy_distributed()  # a barrier first: see its docstring
    skip_exit_collection()  # the heap is the imports': no shutdown collection over it
