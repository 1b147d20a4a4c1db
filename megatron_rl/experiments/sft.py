"""Supervised warm-up: maximise log pi(answer + eos | prompt) with the same Policy machinery as RL.

Used to turn a random tiny model into a weak base model for the CPU demo; works in any TP/PP/DP
layout like the RL loss (normalised by the global number of answer tokens).
"""

from __future__ import annotations

import random
from typing import Sequence

import torch.distributed as dist

from megatron_rl.batch import next_token_targets, pack_rollouts
from megatron_rl.parallel import all_reduce, data_parallel_group, device
from megatron_rl.progress import progress as progress_display
from megatron_rl.rollout.base import Completion
from megatron_rl.rollout.functions import single_turn_groups


def sft(policy, pairs: Sequence[tuple[list[int], list[int]]], *, steps: int, batch_size: int,
        micro_batch_size: int, seed: int = 0, progress: bool = True) -> list[float]:
    """Train on (prompt ids, target ids) pairs (targets include the stop token). This DP rank
    uses its share of each global batch. Returns the per-step mean token NLL."""
    from megatron.core import parallel_state as ps

    from megatron_rl.ops import vocab_parallel_logprobs

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rng = random.Random(seed)
    losses = []
    show = progress and (not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1)
    bar = progress_display(range(steps), desc="SFT warm-up", disable=not show, unit="step")
    for _ in bar:
        chosen = [pairs[rng.randrange(len(pairs))] for _ in range(batch_size)][dp_rank::dp]
        batch = pack_rollouts(single_turn_groups([p for p, _ in chosen],
                                                 [[Completion(t, [0.0] * len(t), "stop")]
                                                  for _, t in chosen],
                                                 [0.0] * len(chosen)),
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
