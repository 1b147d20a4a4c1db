"""Saves run checkpoints of a tiny policy (with its optimizer) and reference back to back
under ROOT, as fast as it can, until killed: step s holds policy weights s and reference weights
-s, so that a loaded pair says which steps its pieces come from. It continues after the newest
complete checkpoint, as a resumed run does. Prints "saved" after its first save (megatron
starts its writer's helper process in it, which takes seconds).

Usage: python save_kill_worker.py ROOT HF_DIR"""
import sys

import torch

from megatron_rl import checkpoint
from megatron_rl.models import ModelArgs
from megatron_rl.models.policy import Policy
from megatron_rl.parallel import ParallelConfig, init_distributed


def main(root: str, hf: str) -> None:
    init_distributed(ParallelConfig())
    args = ModelArgs.from_pretrained(hf)
    policy, reference = Policy(args, trainable=True), Policy(args, trainable=False)
    checkpoint.remove_partial_saves(root)
    newest = checkpoint.complete_checkpoint(root)
    step = 0 if newest is None else int(newest.rsplit("_", 1)[1])
    first = step + 1
    while True:
        step += 1
        with torch.no_grad():
            for p in policy.module.parameters():
                p.fill_(float(step))
            for p in reference.module.parameters():
                p.fill_(-float(step))
        checkpoint.save_run(root, step, policy, {"epoch": 0, "after": None, "seed": 0}, step,
                            reference=reference)
        if step == first:
            print("saved", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
