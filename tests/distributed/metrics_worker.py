"""Worker for test_metrics_reduction.py: this rank's half of a fixed global batch through
megatron_rl.metrics, reduced over the world; prints the metrics as one JSON line (rank 0)."""
import json
import os

import torch
import torch.distributed as dist

from megatron_rl import metrics

B, T = 8, 6


def global_batch():
    gen = torch.Generator().manual_seed(0)
    rewards = torch.tensor([1.0, 0.0, 0.05, 1.0, 0.0, 0.0, 1.0, 0.5])
    lengths = [3, 6, 1, 2, 6, 4, 5, 2]
    reasons = ["stop", "length", "stop", "stop", "length", "stop", "stop", "stop"]
    mask = (torch.rand(B, T, generator=gen) > 0.3).float()
    old = -torch.rand(B, T, generator=gen)
    ref = old + 0.2 * torch.randn(B, T, generator=gen)
    rollout = old + 0.01 * torch.randn(B, T, generator=gen)
    # the loss function's per-microbatch metrics: 2 microbatches per half
    results = [{k: torch.rand((), generator=gen) for k in metrics.LOSS_METRICS}
               | {"num_tokens": torch.tensor(float(n))} for n in (5, 9, 2, 7)]
    errors = [{"timeout": 1}, {"no_answer": 2}]
    return rewards, lengths, reasons, mask, old, ref, rollout, results, errors


def main():
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    group = None
    if world > 1:
        dist.init_process_group("gloo")
        group = dist.group.WORLD
    rewards, lengths, reasons, mask, old, ref, rollout, results, errors = global_batch()
    rows = slice(rank * B // world, (rank + 1) * B // world)
    mbs = slice(rank * 4 // world, (rank + 1) * 4 // world)
    out = metrics.batch_metrics(rewards[rows], lengths[rows], reasons[rows], group)
    out |= metrics.loss_metrics(results[mbs], group)
    out["kl_forward"] = metrics.forward_kl(ref[rows], old[rows], mask[rows], group)
    out |= metrics.mismatch_metrics(rollout[rows], old[rows], mask[rows], group)
    mine = errors[rank] if world > 1 else {"timeout": 1, "no_answer": 2}
    out |= metrics.count_metrics(mine, "reward_errors/", group)
    if rank == 0:
        print("METRICS " + json.dumps(out))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from megatron_rl.processes import skip_exit_collection

    skip_exit_collection()  # the heap is the imports': no shutdown collection over it
