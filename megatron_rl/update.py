"""The policy update of one RL step, on a rollout batch: every pass of the trainer's models
over the batch and the glue between them and the pure loss maths of loss.py.

    behaviour_logprobs   pi_old: the engine's log-probs, or one forward of the policy
    train_on_batch       reference log-probs (score_reference_exact for the exact KL)
                         -> advantages (loss.build_advantages) -> PPO epochs over minibatches:
                         forward_backward with make_rl_loss_fn on loss_microbatch's inputs,
                         the NaN guard (nonfinite_flag), the optimizer step

The forward passes run in the trainer's microbatch layout (`layout`, packing.Layout). This module
imports Megatron (through the Policy); loss.py, kl.py and advantages.py stay pure PyTorch.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_rl import metrics as global_metrics
from megatron_rl.batch import RolloutBatch
from megatron_rl.config import TrainConfig
from megatron_rl.correction import rollout_correction_weights
from megatron_rl.loss import build_advantages, num_sequences, policy_loss, shape_overlong
from megatron_rl.packing import Layout, Microbatch
from megatron_rl.parallel import (all_reduce, data_parallel_group, data_parallel_sum, device,
                                  use_cuda)

if TYPE_CHECKING:
    from megatron_rl.models.policy import Policy


def behaviour_logprobs(policy: Policy, cfg: TrainConfig, batch: RolloutBatch) -> dict:
    """Fill `batch.old_logprobs`, the behaviour policy's (see --old-logprobs): the engine's
    log-probs where they stand for it (TrainConfig.use_rollout_logprobs), else one forward of
    `policy` over the batch; the weights that generated the batch, when called as the batch is
    built. Returns the recompute's metrics: mismatch/* against the engine's log-probs and, when
    the forward replays the engine's experts, routing/* (how often the routers' own choice
    differs)."""
    metrics: dict = {}
    dp_group = data_parallel_group()
    if cfg.use_rollout_logprobs():
        batch.old_logprobs = batch.rollout_logprobs.clone()
    else:
        # replaying the engine's experts, the recompute also notes the routers' own choice
        own: list | None = ([] if batch.routed_experts is not None and policy.pp_size == 1
                            else None)
        batch.old_logprobs = policy.token_logprobs(batch.tokens, layout(cfg),
                                                   seq_lengths=batch.seq_lengths,
                                                   routes=batch.routed_experts,
                                                   own_routes=own)
        metrics.update(global_metrics.mismatch_metrics(batch.rollout_logprobs,
                                                       batch.old_logprobs, batch.loss_mask,
                                                       dp_group))
        if own and batch.routed_experts is not None:
            metrics.update(global_metrics.routing_metrics(own[0], batch.routed_experts,
                                                          batch.seq_lengths, dp_group))
    return metrics


def minibatch_rows(batch: RolloutBatch, num_minibatches: int) -> list[list[int]]:
    """The rows of each of `num_minibatches` PPO minibatches: equal slices of the rows
    (B / num_minibatches each); with groups of their own sizes (batch.group_sizes), equal
    slices of the groups, whole (packing.rank_groups deals each minibatch's groups to a rank
    as one block), so no row is left out when the rows do not divide."""
    if batch.group_sizes is None:
        per_mb = batch.num_sequences // num_minibatches
        return [list(range(mb * per_mb, (mb + 1) * per_mb)) for mb in range(num_minibatches)]
    groups = batch.group_rows()
    per_mb = len(groups) // num_minibatches
    return [[r for g in groups[mb * per_mb:(mb + 1) * per_mb] for r in g]
            for mb in range(num_minibatches)]


def train_on_batch(policy: Policy, reference: Policy, cfg: TrainConfig, batch: RolloutBatch,
                   metrics: dict) -> bool:
    """Advantages and PPO epochs over minibatches of `batch`: the policy's optimizer steps, with
    the reference's log-probs for the KL. Adds the step's loss and KL metrics to `metrics`.
    Returns False when an update was skipped (a non-finite loss or gradient)."""
    algo, loss_cfg = cfg.algorithm, cfg.loss
    # the advantages see every row's policy tokens: a response --overlong-filtering takes out of
    # the loss keeps its return, KL included, in its group's baseline (per sequence and per token)
    sampled_mask = batch.loss_mask
    if loss_cfg.overlong_filtering or loss_cfg.overlong_buffer_len:
        batch = overlong_batch(batch, cfg, metrics)
    # the reference is scored even with --kl-placement none: its KL is always logged
    exact_kl = None
    lay = layout(cfg)
    if loss_cfg.kl.exact:
        ref_lp, exact_kl = score_reference_exact(policy, reference, batch.tokens, lay,
                                                 batch.seq_lengths)
        metrics["kl_exact"] = global_metrics.token_mean(exact_kl, batch.loss_mask,
                                                        data_parallel_group())
    else:
        ref_lp = reference.token_logprobs(batch.tokens, lay, seq_lengths=batch.seq_lengths)
    advantages = build_advantages(batch.rewards, batch.old_logprobs, ref_lp, sampled_mask,
                                  loss_cfg, batch.group_size, token_kl=exact_kl,
                                  in_baseline=batch.in_baseline,
                                  token_rewards=batch.token_rewards,
                                  group_sizes=batch.group_sizes)
    rollout_lp = batch.rollout_logprobs if loss_cfg.kl.is_proposal == "rollout" else None
    is_weights = None
    if loss_cfg.rollout_correction.enabled:  # the engine's samples, the trainer's pi_old
        is_weights, stats = rollout_correction_weights(batch.old_logprobs, batch.rollout_logprobs,
                                                       batch.loss_mask,
                                                       loss_cfg.rollout_correction)
        metrics.update(global_metrics.correction_metrics(stats, data_parallel_group()))
    rollout_tokens = data_parallel_sum(batch.loss_mask.sum())
    minibatches = minibatch_rows(batch, algo.ppo_minibatches)
    ok_all = True
    grad_norms: list[float] = []
    step_metrics: list[dict] = []  # the loss function's per-microbatch metrics (device tensors)
    for epoch in range(algo.ppo_epochs):
        for idx in minibatches:
            mbatch = batch.select(idx)
            norm_tokens = (rollout_tokens if loss_cfg.aggregation == "token-sum-over-batch-tokens"
                           else data_parallel_sum(mbatch.loss_mask.sum()))
            # sequences with a loss token: an overlong-filtered or failed one is none; a
            # minibatch without any has loss 0 (each row adds 0), not 0/0
            norm_seqs = max(data_parallel_sum(num_sequences(mbatch.loss_mask)), 1.0)
            micro = [loss_microbatch(batch, advantages, ref_lp, m, is_weights, rollout_lp)
                     for m in lay.microbatches(batch.tokens, batch.seq_lengths, idx,
                                               policy.pad_multiple, policy.pp_size > 1,
                                               batch.routed_experts)]
            in_loss = reference if loss_cfg.kl.exact_kl_in_loss else None
            loss_fn = make_rl_loss_fn(policy, loss_cfg, norm_tokens, norm_seqs, in_loss)
            results = policy.forward_backward(micro, loss_fn, reference=in_loss,
                                              for_scoring=True)
            finite = not bool(all_reduce(nonfinite_flag(results, policy.parameters()),
                                         op=dist.ReduceOp.MAX))
            if finite:
                metrics["lr"] = policy.lr  # the rate this update uses (--lr-decay-style)
                updated, grad_norm = policy.step()
                grad_norms.append(grad_norm if grad_norm is not None else float("nan"))
            else:
                updated = False
            ok_all &= updated and finite
            step_metrics.extend(results)
    if grad_norms:  # mean and max over the optimizer steps of this batch (PPO minibatches)
        metrics["grad_norm"] = sum(grad_norms) / len(grad_norms)
        metrics["grad_norm_max"] = max(grad_norms)
    # every logged value is the global batch's (all data-parallel ranks); the loss's kl_exact
    # (with the exact KL in the loss), averaged over the PPO steps like kl_k1 / kl_k3, takes the
    # place of the batch's before them
    metrics.update(global_metrics.loss_metrics(step_metrics, data_parallel_group(),
                                               num_steps=algo.ppo_epochs * algo.ppo_minibatches))
    metrics["kl_forward"] = global_metrics.forward_kl(ref_lp, batch.old_logprobs,
                                                      batch.loss_mask, data_parallel_group())
    return ok_all


def overlong_batch(batch: RolloutBatch, cfg: TrainConfig, metrics: dict) -> RolloutBatch:
    """`batch` with --overlong-filtering and the soft overlong punishment applied to its loss
    mask and rewards (loss.shape_overlong); adds overlong/filtered_fraction,
    overlong/penalized_fraction and overlong/penalty_mean over the global batch to `metrics`."""
    rewards, mask, counts = shape_overlong(batch.rewards, batch.loss_mask, batch.response_lengths,
                                           batch.finish_reasons, cfg.rollout.max_new_tokens,
                                           cfg.loss)
    totals = global_metrics.count_metrics({**counts, "n": batch.num_sequences}, "",
                                          data_parallel_group())
    n = max(totals["n"], 1.0)
    metrics["overlong/filtered_fraction"] = totals["overlong/filtered"] / n
    metrics["overlong/penalized_fraction"] = totals["overlong/penalized"] / n
    metrics["overlong/penalty_mean"] = totals["overlong/penalty_sum"] / n
    return dataclasses.replace(batch, rewards=rewards, loss_mask=mask)


def layout(cfg: TrainConfig) -> Layout:
    """The microbatch layout of the trainer's forward passes (--sequence-packing,
    --max-tokens-per-microbatch, --micro-batch-size).

    Packed rows are shape-bucketed (packing.bucketed_length: at most 16 row lengths per token
    budget) on a GPU, where each new shape costs: torch.compile'd fusions specialise on it,
    CUDA graphs are captured per shape and the caching allocator keeps blocks per size. Not on
    the CPU, which has none of these and would only pay the padding (about 1-2% of the
    tokens). Nor with a mixture-of-experts load-balancing loss (--moe-aux-loss-coeff): the
    padding tokens pass the routers and would count in it. The padding is a segment of its own
    and scores nothing, so losses and gradients are those of the unbucketed rows."""
    a = cfg.algorithm
    bucket = use_cuda() and not cfg.model.options.moe_aux_loss_coeff
    return Layout(packed=a.sequence_packing, micro_batch_size=a.micro_batch_size,
                  max_tokens=a.max_tokens_per_microbatch, bucket=bucket)


def score_reference_exact(policy, reference, tokens: torch.Tensor, lay: Layout | int,
                          seq_lengths=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(reference token log-probs, exact per-position KL(pi_theta || pi_ref)), each [B, L-1]
    fp32 on every rank of the pipeline: one forward-only pass in which every microbatch runs
    through the policy and the reference together (Policy.forward_backward's `reference`), so
    both models' logits (or, with --fused-lm-head, hidden states) meet in one op without being
    stored. The KL is that of the current weights (the behaviour policy's on-policy): the
    reward side of `exact`."""
    def fn(mb, out, ref_out):
        return [reference.score(ref_out, mb.targets).logprobs,
                policy.score(out, mb.targets, ref_out=ref_out, reference=reference).exact_kl]

    out = policy.collect_per_token(tokens, lay, fn, 2, seq_lengths=seq_lengths,
                                   reference=reference)
    return out[0], out[1]


def make_rl_loss_fn(policy, loss_cfg, num_global_tokens: float, num_global_seqs: float,
                    reference=None):
    """The loss function handed to the pipeline schedule (forward_backward with for_scoring):
    log-probs and entropy of the current policy through Policy.score (from the logits, or the
    hidden states with --fused-lm-head), back in the batch's [b, L-1] layout, then
    megatron_rl.loss.policy_loss (the entropy too: the scoring op differentiates it, for
    --entropy-coef). The microbatch dict carries its packing.Microbatch
    ("layout"), loss_mask, old_logprobs, advantages and ref_logprobs (see loss_microbatch).

    With the "exact" KL estimator in the loss (or in the reward under "seq-is",
    KLConfig.exact_kl_in_loss) the function takes the reference's output too,
    loss_fn(mb, out, ref_out): forward_backward must run with reference=the reference Policy,
    given here as well. KL_t is then differentiated through the policy's output (its gradient
    p (log p - log q - KL_t) per vocab entry, computed in backward and added into the log-prob
    op's gradient: one op for both, see ops.token_logprobs_and_kl and ops.lm_head)."""
    exact = loss_cfg.kl.exact_kl_in_loss

    def loss_fn(mb, out, ref_out=None):
        if exact and (ref_out is None or reference is None):
            raise ValueError("the exact KL in the loss needs the reference's output: run "
                             "forward_backward with reference=<the reference Policy> and pass "
                             "it to make_rl_loss_fn")
        lay = mb["layout"]
        o = policy.score(out, lay.targets, return_entropy=True,
                         ref_out=ref_out if exact else None, reference=reference)
        logprobs, entropy = lay.to_rows(o.logprobs), lay.to_rows(o.entropy)
        token_kl = lay.to_rows(o.exact_kl) if exact else None
        mask = mb["loss_mask"]
        loss, m = policy_loss(logprobs, mb["old_logprobs"], mb["advantages"], mask, loss_cfg,
                              ref_logprobs=mb["ref_logprobs"], token_kl=token_kl,
                              is_weights=mb.get("is_weights"),
                              rollout_logprobs=mb.get("rollout_logprobs"), entropy=entropy,
                              num_global_tokens=num_global_tokens, num_global_seqs=num_global_seqs)
        m["entropy"] = (entropy.detach() * mask).sum() / mask.sum().clamp(min=1)
        m["loss"] = loss.detach().clone()  # clone: the schedule scales the loss in place
        m["num_tokens"] = mask.sum()
        return loss, m

    return loss_fn


def loss_microbatch(batch: RolloutBatch, advantages, ref_lp, m: Microbatch,
                    is_weights=None, rollout_lp=None) -> dict:
    """The loss function's microbatch: the model inputs of `m` and its rows' per-token data
    (is_weights: the rollout correction's; rollout_lp: the engine's log-probs, for the KL's
    importance weights under --kl-is-proposal rollout)."""
    t = m.rows.to(batch.device)
    return {**m.inputs, "layout": m, "loss_mask": batch.loss_mask[t],
            "old_logprobs": batch.old_logprobs[t], "advantages": advantages[t],
            "ref_logprobs": None if ref_lp is None else ref_lp[t],
            "is_weights": None if is_weights is None else is_weights[t],
            "rollout_logprobs": None if rollout_lp is None else rollout_lp[t]}


def nonfinite_flag(results: list[dict], params) -> torch.Tensor:
    """1.0 when a microbatch loss or a gradient is NaN/inf on this rank, else 0.0: a [1] tensor
    on the device, for a MAX all-reduce (the NaN guard), computed without a host sync."""
    bad = torch.zeros(1, device=device())
    for r in results:
        bad = torch.maximum(bad, (~torch.isfinite(r["loss"].float())).float().reshape(1))
    for p in params:
        g = getattr(p, "main_grad", None)
        if g is not None:
            bad = torch.maximum(bad, (~torch.isfinite(g).all()).float().reshape(1))
    return bad
