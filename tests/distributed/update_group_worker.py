"""Worker for test_sglang_update_group.py, under torchrun (2 ranks, gloo): rank 0 is the trainer,
which opens two weight-update groups on one port through sglang_engine.trainer_update_group (two
servers of a pool under a fixed --nccl-master-port); rank 1 stands in for the SGLang server's
worker, joining each group the way SGLang's own `init_custom_process_group` does (a tcp://
rendezvous at rank 1, keys under a PrefixStore named after the group), with torchrun's
environment. Each group then carries a broadcast from rank 0; rank 1 prints what it received.

argv: PORT TIMEOUT_S
"""
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_rl.rollout.sglang_engine import trainer_update_group


def sglang_side_group(address: str, port: int, world_size: int, rank: int, group_name: str,
                      backend: str, timeout: timedelta):
    """A server worker's side of the group, as sglang.srt.utils.common.init_custom_process_group
    builds it (SGLang 0.5: rendezvous, set_timeout, PrefixStore, _new_process_group_helper)."""
    from torch.distributed.distributed_c10d import (GroupName, PrefixStore,
                                                    _new_process_group_helper, _world)
    from torch.distributed.rendezvous import rendezvous

    store, rank, world_size = next(rendezvous(f"tcp://{address}:{port}", rank, world_size,
                                              timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(world_size, rank, [], dist.Backend(backend),
                                         PrefixStore(group_name, store),
                                         group_name=GroupName(group_name), timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def main():
    port, timeout = int(sys.argv[1]), timedelta(seconds=float(sys.argv[2]))
    # the condition under test: torchrun asks every worker to use its agent's store
    assert os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True", os.environ
    dist.init_process_group("gloo")  # both sides run a default group of their own too
    rank = dist.get_rank()
    groups = {}  # both open at once, as a pool's servers' groups are
    for name in ["mrl_weights_test_0", "mrl_weights_test_1"]:
        if rank == 0:
            groups[name] = trainer_update_group("127.0.0.1", port, 2, name, "gloo",
                                                timeout=timeout)
        else:
            groups[name] = sglang_side_group("127.0.0.1", port, 2, 1, name, "gloo", timeout)
    for i, (name, group) in enumerate(groups.items()):
        t = torch.arange(6, dtype=torch.float32) + 10 * i if rank == 0 else torch.zeros(6)
        dist.broadcast(t, src=0, group=group)
        if rank == 1:
            print(f"RECEIVED {name} {t.tolist()}", flush=True)
    for group in groups.values():
        dist.destroy_process_group(group)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from megatron_rl.processes import skip_exit_collection

    skip_exit_collection()  # the heap is the imports': no shutdown collection over it
