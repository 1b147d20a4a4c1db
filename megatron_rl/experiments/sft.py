"""Supervised warm-up: maximise log pi(answer + eos | prompt) with the same Policy machinery as RL.

Used to turn a random tiny model into a weak base model for the CPU demos; works in any TP/PP/DP
layout like the RL loss (normalised by the global number of answer tokens). A target may carry
a mask (a tool-use trace: the policy's turns 1, the tool responses between them 0), and only its
1 tokens are trained on, as in RL.
"""

from __future__ import annotations

import os
import random
import time
from typing import Sequence

import torch.distributed as dist

from megatron_rl.batch import Trajectory, next_token_targets, pack_rollouts
from megatron_rl.parallel import all_reduce, data_parallel_group, device
from megatron_rl.progress import progress as progress_display


def sft(policy, pairs: Sequence[tuple[list[int], list[int]] | tuple[list[int], list[int], list[int]]],
        *, steps: int, batch_size: int, micro_batch_size: int, seed: int = 0,
        progress: bool = True) -> list[float]:
    """Train on (prompt ids, target ids[, target mask]) (targets include the stop token; the
    mask, all 1 when absent, says which target tokens are trained on). This DP rank uses its
    share of each global batch. Returns the per-step mean NLL of the trained tokens."""
    from megatron.core import parallel_state as ps

    from megatron_rl.ops import vocab_parallel_logprobs

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rng = random.Random(seed)
    losses = []
    show = progress and (not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1)
    bar = progress_display(range(steps), desc="SFT warm-up", disable=not show, unit="step")
    for _ in bar:
        chosen = [pairs[rng.randrange(len(pairs))] for _ in range(batch_size)][dp_rank::dp]
        batch = pack_rollouts([[Trajectory(list(c[0]), list(c[1]),
                                           list(c[2]) if len(c) > 2 else [1] * len(c[1]),
                                           [0.0] * len(c[1]), "stop", 0.0)] for c in chosen],
                              pad_token_id=0).to(device())
        n_tok = all_reduce(batch.loss_mask.sum(), data_parallel_group())
        micro = [{"tokens": batch.tokens[i:i + micro_batch_size],
                  "loss_mask": batch.loss_mask[i:i + micro_batch_size]}
                 for i in range(0, len(chosen), micro_batch_size)]

        def loss_fn(mb, logits):
            targets = next_token_targets(mb["tokens"]).to(logits.device)
            logp = vocab_parallel_logprobs(logits, targets, tp_group=policy.tp_group,
                                           vocab_start=policy.vocab_start)[:, :-1]
            loss = -(logp * mb["loss_mask"]).sum() / n_tok
            return loss, {"nll_sum": -(logp.detach() * mb["loss_mask"]).sum()}

        out = policy.forward_backward(micro, loss_fn)
        policy.step()
        if out:  # last pipeline stage: this DP rank's mean NLL per answer token
            losses.append(float(sum(o["nll_sum"] for o in out)
                                / batch.loss_mask.sum().clamp(min=1.0)))
            bar.set_postfix(nll=f"{losses[-1]:.3f}")
    return losses


def warm_up(init: str, out: str, traces: Sequence, steps: int, *, lr: float = 2e-3,
            lr_decay_style: str = "constant", seed: int = 0, name: str = "base") -> str:
    """The HF model at `init` (one process, TP1) after `steps` steps of `sft` on `traces`
    (batches of 64, drawn with `seed`; the learning rate `lr`, or `lr_decay_style` from it to
    lr / 20 over the steps), exported to `out` with `init`'s tokenizer files: the demos' base
    models. Returns `out`."""
    from megatron_rl.models import ModelArgs, hf_mapping
    from megatron_rl.models.optim import OptimConfig
    from megatron_rl.models.policy import Policy
    from megatron_rl.parallel import ParallelConfig, init_distributed

    init_distributed(ParallelConfig(1, 1), seed=seed)
    args = ModelArgs.from_pretrained(init)
    optim = OptimConfig(lr=lr, clip_grad=1.0, lr_decay_style=lr_decay_style, lr_decay_iters=steps,
                        min_lr=lr / 20 if lr_decay_style != "constant" else 0.0)
    policy = Policy(args, trainable=True, optim=optim)
    policy.load_hf(init)
    t0 = time.time()
    losses = sft(policy, traces, steps=steps, batch_size=64, micro_batch_size=64, seed=seed)
    print(f"[{name}] supervised warm-up: {steps} steps in {time.time() - t0:.0f} s, "
          f"NLL of the trained tokens {losses[0]:.2f} -> {losses[-1]:.2f}")
    full = policy.full_state_dict(dst=0)
    tok_files = [os.path.join(init, f) for f in os.listdir(init)
                 if f.startswith(("tokenizer", "special"))]
    hf_mapping.save_hf_checkpoint(hf_mapping.megatron_to_hf(full, args), args, out,
                                  extra_files=tuple(tok_files))
    return out
