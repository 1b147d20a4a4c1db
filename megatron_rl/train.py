"""RL training of a policy on verifiable rewards, with the KL term where the run puts it.

The loop, top-down:

    rollout -> rewards -> reference log-probs -> advantages (KL in the reward when placed there)
    -> PPO epochs over minibatches (KL in the loss when placed there) -> weight sync
    -> periodic eval and save

Launch: `megatron-rl train ...` or `torchrun --nproc-per-node N -m megatron_rl.train ...`.
Each data-parallel rank generates and scores its share of the prompts; losses are normalised by
global (all-reduced) token/sequence counts, so results do not depend on the layout.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_rl import metrics as global_metrics
from megatron_rl.batch import RolloutBatch, pack_rollouts
from megatron_rl.checkpoint import copy_weights
from megatron_rl.config import TrainConfig, parse_config
from megatron_rl.correction import rollout_correction_weights
from megatron_rl.evaluation import evaluate
from megatron_rl.loss import build_advantages, policy_loss
from megatron_rl.packing import Layout, Microbatch, balance_groups
from megatron_rl.parallel import all_reduce, data_parallel_group, device, dist_rank
from megatron_rl.rollout.base import on_client
from megatron_rl.rollout.threads import BackgroundThreads
from megatron_rl.runtime import Run, setup_run

if TYPE_CHECKING:
    from megatron_rl.models.policy import Policy


@dataclasses.dataclass
class Rollout:
    """One step's batch on its way: the prompts taken from the data, and either the finished
    (batch, metrics) or, for an engine with weights of its own under --async-level, its client
    rank's generation running in a background thread (`future`). `version` is the weight
    version that generates it."""
    step: int
    data_state: dict              # the data position before this batch (a resume re-takes it)
    version: int
    records: list
    future: concurrent.futures.Future | None = None
    done: tuple | None = None     # (RolloutBatch, metrics)


def start_rollout(run: Run, step: int, threads: BackgroundThreads | None = None) -> Rollout:
    """Take `step`'s prompts and start generating them. Generated once per batch: by an engine
    without a client rank (the in-process one), each data-parallel replica's model-parallel
    group generates its share together, here and now; an engine with one client gets the whole
    batch from that rank -- in one of `threads` when given (--async-level >= 1), so that
    generation overlaps training."""
    data_state = run.train_data.state_dict()
    records = run.train_data.next_batch(run.cfg.algorithm.num_prompts_per_step)
    r = Rollout(step, data_state, run.engine.weight_version, records)
    if threads is not None:
        if dist_rank() == run.engine.client_rank:
            r.future = threads.submit(_generate, run, records, _seed(run, step))
    else:
        r.done = _build_batch(run, r)
    return r


def finish_rollout(run: Run, r: Rollout) -> tuple[RolloutBatch, dict]:
    """The step's batch and its metrics (waits for a background generation)."""
    return r.done if r.done is not None else _build_batch(run, r)


def generate_batch(run: Run, step: int) -> tuple[RolloutBatch, dict]:
    """Sample group_size responses for this DP rank's prompts of `step` and score them."""
    return finish_rollout(run, start_rollout(run, step))


def _seed(run: Run, step: int) -> int:
    return run.cfg.seed + 7919 * step


def _build_batch(run: Run, r: Rollout) -> tuple[RolloutBatch, dict]:
    cfg, algo, engine = run.cfg, run.cfg.algorithm, run.engine
    if engine.client_rank is None:
        mine = r.records[run.dp_rank::run.dp_size]
        prompt_ids, completions, rewards, reasons = _score(
            run, mine, *_generate(run, mine, _seed(run, r.step) + run.dp_rank))
        if algo.sequence_packing and run.dp_size > 1:  # re-deal the groups by token count
            parts = _gather_dp((prompt_ids, completions, rewards))
            whole = [sum((list(p[i]) for p in parts), []) for i in range(3)]
            prompt_ids, completions, rewards = _deal_groups(run, *whole)
        engine_stats: dict = {}
    else:
        def generate_and_score():
            generated = (r.future.result() if r.future is not None
                         else _generate(run, r.records, _seed(run, r.step)))
            if cfg.rollout.rollout_release_memory:  # generated: the GPUs are the trainer's now
                engine.release_memory()
            return (*_score(run, r.records, *generated), engine.stats())

        prompt_ids, completions, rewards, reasons, engine_stats = on_client(
            engine, generate_and_score, f"generating and scoring step {r.step}'s batch")
        prompt_ids, completions, rewards = _deal_groups(run, prompt_ids, completions, rewards)
        reasons = reasons if run.dp_rank == 0 else {}  # counted once in the global sum
    # the one host -> device boundary: from here on the batch lives where the model does
    batch = pack_rollouts(prompt_ids, completions, rewards, run.codec.pad_id).to(device())
    dp_group = data_parallel_group()
    metrics = global_metrics.count_metrics(reasons, "reward_errors/", dp_group)
    metrics.update(engine_stats)
    # behaviour policy = the weights that generated the batch (see --old-logprobs)
    if cfg.use_rollout_logprobs():
        batch.old_logprobs = batch.rollout_logprobs.clone()
    else:
        # replaying the engine's experts, the recompute also notes the routers' own choice
        own: list | None = ([] if batch.routed_experts is not None and run.policy.pp_size == 1
                            else None)
        batch.old_logprobs = run.policy.token_logprobs(batch.tokens, layout(cfg),
                                                       seq_lengths=batch.seq_lengths,
                                                       routes=batch.routed_experts,
                                                       own_routes=own)
        metrics.update(global_metrics.mismatch_metrics(batch.rollout_logprobs,
                                                       batch.old_logprobs, batch.loss_mask,
                                                       dp_group))
        if own and batch.routed_experts is not None:
            metrics.update(global_metrics.routing_metrics(own[0], batch.routed_experts,
                                                          batch.seq_lengths, dp_group))
    return batch, metrics


def _deal_groups(run: Run, prompt_ids, completions, rewards):
    """This data-parallel rank's groups (prompt ids, completions, flat rewards) of the whole
    batch: with --sequence-packing dealt by token count (packing.balance_groups), so that no rank
    trains on a long tail the others wait for; else every dp_size-th group."""
    g = run.cfg.algorithm.group_size
    if run.cfg.algorithm.sequence_packing:
        tokens = [sum(len(p) + len(c.token_ids) for c in grp)
                  for p, grp in zip(prompt_ids, completions)]
        mine = balance_groups(tokens, run.dp_size)[run.dp_rank]
    else:
        mine = list(range(len(prompt_ids)))[run.dp_rank::run.dp_size]
    return ([prompt_ids[i] for i in mine], [completions[i] for i in mine],
            [x for i in mine for x in rewards[i * g:(i + 1) * g]])


def _gather_dp(obj) -> list:
    """Every data-parallel rank's picklable `obj`, in rank order."""
    group = data_parallel_group()
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _generate(run: Run, records, seed: int):
    """(prompt ids, group_size completions per prompt) for `records`."""
    prompt_ids = [run.codec.encode(r.text) for r in records]
    return prompt_ids, run.engine.generate(prompt_ids, run.cfg.algorithm.group_size,
                                           run.sampling_params(seed=seed))


def _score(run: Run, records, prompt_ids, completions):
    """(prompt ids, completions, flat rewards, reward-error counts) for `records`."""
    g = run.cfg.algorithm.group_size
    texts = [run.codec.decode(c.token_ids) for group in completions for c in group]
    expand = lambda xs: [x for x in xs for _ in range(g)]  # noqa: E731
    rewards, reasons = run.scorer.score_batch(texts, expand([r.answer for r in records]),
                                              expand([r.task for r in records]),
                                              expand([r.metadata for r in records]))
    return prompt_ids, completions, list(rewards), dict(reasons)


def _global_sum(x) -> float:
    """Sum of a number (or a scalar tensor) over the data-parallel ranks."""
    return float(all_reduce(torch.as_tensor(x, dtype=torch.float64).reshape(1),
                            data_parallel_group()))


def train_on_batch(policy: Policy, reference: Policy, cfg: TrainConfig, batch: RolloutBatch,
                   metrics: dict) -> bool:
    """Advantages and PPO epochs over minibatches of `batch`: the policy's optimizer steps, with
    the reference's log-probs for the KL. Adds the step's loss and KL metrics to `metrics`.
    Returns False when an update was skipped (a non-finite loss or gradient)."""
    algo, loss_cfg = cfg.algorithm, cfg.loss
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
    advantages = build_advantages(batch.rewards, batch.old_logprobs, ref_lp, batch.loss_mask,
                                  loss_cfg, batch.group_size, token_kl=exact_kl)
    rollout_lp = batch.rollout_logprobs if loss_cfg.kl.is_proposal == "rollout" else None
    is_weights = None
    if loss_cfg.rollout_correction.enabled:  # the engine's samples, the trainer's pi_old
        is_weights, stats = rollout_correction_weights(batch.old_logprobs, batch.rollout_logprobs,
                                                       batch.loss_mask,
                                                       loss_cfg.rollout_correction)
        metrics.update(global_metrics.correction_metrics(stats, data_parallel_group()))
    rollout_tokens = _global_sum(batch.loss_mask.sum())
    n = batch.num_sequences
    per_mb = n // algo.ppo_minibatches
    ok_all = True
    grad_norms: list[float] = []
    step_metrics: list[dict] = []  # the loss function's per-microbatch metrics (device tensors)
    for epoch in range(algo.ppo_epochs):
        for mb in range(algo.ppo_minibatches):
            idx = list(range(mb * per_mb, (mb + 1) * per_mb))
            mbatch = batch.select(idx)
            norm_tokens = (rollout_tokens if loss_cfg.aggregation == "token-sum-over-batch-tokens"
                           else _global_sum(mbatch.loss_mask.sum()))
            norm_seqs = _global_sum(len(idx))
            micro = [_microbatch(batch, advantages, ref_lp, m, is_weights, rollout_lp)
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
    # every logged value is the global batch's (all data-parallel ranks)
    metrics.update(global_metrics.loss_metrics(step_metrics, data_parallel_group(),
                                               num_steps=algo.ppo_epochs * algo.ppo_minibatches))
    metrics["kl_forward"] = global_metrics.forward_kl(ref_lp, batch.old_logprobs,
                                                      batch.loss_mask, data_parallel_group())
    return ok_all


def layout(cfg: TrainConfig) -> Layout:
    """The microbatch layout of the trainer's forward passes (--sequence-packing,
    --max-tokens-per-microbatch, --micro-batch-size)."""
    a = cfg.algorithm
    return Layout(packed=a.sequence_packing, micro_batch_size=a.micro_batch_size,
                  max_tokens=a.max_tokens_per_microbatch)


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
    megatron_rl.loss.policy_loss. The microbatch dict carries its packing.Microbatch
    ("layout"), loss_mask, old_logprobs, advantages and ref_logprobs (see _microbatch).

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
                              rollout_logprobs=mb.get("rollout_logprobs"),
                              num_global_tokens=num_global_tokens, num_global_seqs=num_global_seqs)
        m["entropy"] = (entropy.detach() * mask).sum() / mask.sum().clamp(min=1)
        m["loss"] = loss.detach().clone()  # clone: the schedule scales the loss in place
        m["num_tokens"] = mask.sum()
        return loss, m

    return loss_fn


def _microbatch(batch: RolloutBatch, advantages, ref_lp, m: Microbatch,
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


EXIT_RESUMABLE = 75
"""Exit status of a run that stopped before --train-iters with its last step saved (a signal
under --exit-signal-handler, or --exit-duration-in-mins): sysexits.h's EX_TEMPFAIL, "a temporary
failure, retry later". It differs from success (0), from an error (1) and from a death by signal
(128 + n), so that a job script requeues exactly the runs that can resume."""

STOPPED_EARLY = "stopped_early"
"""File in --save that says the run stopped early and resumes when started again (JSON: step,
reason); the next start of the run removes it. It tells a launcher that only sees torchrun's
own status (non-zero whenever a worker's is) to requeue."""


class StoppedEarly(Exception):
    """The run stopped before --train-iters, its `step` saved (`reason`: the signal, or the
    time budget); main() exits with EXIT_RESUMABLE."""

    def __init__(self, step: int, reason: str):
        super().__init__(f"stopped at step {step} ({reason}); its checkpoint is saved: start the "
                         "same command again to resume")
        self.step, self.reason = step, reason


class StopRequests:
    """When to stop before --train-iters: a SIGTERM/SIGINT received (--exit-signal-handler) or
    the wall-clock budget spent (--exit-duration-in-mins, counted from `started`, a
    time.monotonic()). The handlers only record the signal; `reason()` is asked at each step
    boundary and agrees across all ranks (an all-reduce of the flags), so that they save and
    stop at the same step. A context manager: the previous handlers come back on exit."""

    REPEAT_SIGINT_S = 2.0  # a second Ctrl-C later than this stops at once (torchrun forwards
    #                        the terminal's SIGINT to its workers: the copy arrives within it)

    def __init__(self, handle_signals: bool, budget_mins: float, started: float):
        self.handle_signals, self.budget_s, self.started = handle_signals, budget_mins * 60, started
        self.received: int | None = None
        self._at = 0.0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopRequests":
        if self.handle_signals and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _on_signal(self, signum: int, frame) -> None:
        now = time.monotonic()
        if self.received is None:
            self.received, self._at = signum, now
            print(f"[megatron-rl] received {signal.Signals(signum).name}: finishing the step in "
                  "flight, then saving and stopping", file=sys.stderr, flush=True)
        elif signum == signal.SIGINT and now - self._at > self.REPEAT_SIGINT_S:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without saving

    def reason(self) -> str | None:
        """Why to stop after the step just finished (None: go on); the same on every rank."""
        if not (self.handle_signals or self.budget_s):
            return None
        over = bool(self.budget_s) and time.monotonic() - self.started >= self.budget_s
        flags = [float(self.received == signal.SIGTERM), float(self.received == signal.SIGINT),
                 float(over)]
        if dist.is_initialized():
            flags = all_reduce(flags, op=dist.ReduceOp.MAX).tolist()
        if flags[0] or flags[1]:
            return "SIGTERM" if flags[0] else "SIGINT"
        if flags[2]:
            return f"--exit-duration-in-mins {self.budget_s / 60:g} spent"
        return None


def train(cfg: TrainConfig) -> dict:
    """Build the run (setup_run), train it to --train-iters, close it. Returns the last step's
    metrics. Raises StoppedEarly after saving and closing the run when a signal
    (--exit-signal-handler) or the time budget (--exit-duration-in-mins) stopped it earlier."""
    started = time.monotonic()
    stops = StopRequests(cfg.checkpoint.exit_signal_handler,
                         cfg.checkpoint.exit_duration_in_mins, started)
    # this start takes over from the one that stopped early (before the setup: a run that
    # fails in it is not requeued again and again)
    _remove_stopped_marker(cfg.checkpoint.save)
    with stops:  # a signal during the setup too stops the run at its first step boundary
        run = setup_run(cfg)
        # an engine with weights of its own generates ahead in the background under
        # --async-level: up to k requests in flight, from its client rank
        threads = (BackgroundThreads(max(cfg.algorithm.async_level, 1))
                   if cfg.overlaps_rollout() else None)
        try:
            last = train_loop(run, threads, stops)
        except BaseException:
            # nothing waits for a generation in flight: the engine stops (a managed server is
            # killed, so its request fails at once) and the request's daemon thread ends with
            # the process, even when an attached server never answers
            if threads is not None:
                threads.shutdown(wait=False, cancel_futures=True)
            run.close()
            raise
        if threads is not None:
            threads.shutdown(wait=True)
        run.close()
    return last


def _remove_stopped_marker(save: str) -> None:
    """Remove <save>/STOPPED_EARLY (every rank may: the first one does)."""
    try:
        os.remove(os.path.join(save, STOPPED_EARLY))
    except FileNotFoundError:
        pass


def train_loop(run: Run, threads: BackgroundThreads | None = None,
               stops: StopRequests | None = None) -> dict:
    """Steps start_step .. --train-iters of `run`; `threads` generate ahead (--async-level).
    Saves every --save-interval steps and the last step; raises StoppedEarly, after saving the
    step, when `stops` says to stop."""
    cfg, engine, logger = run.cfg, run.engine, run.logger
    pending: collections.deque[Rollout] = collections.deque()  # batches started ahead
    nonfinite_in_row = 0
    last = {}
    saved = run.start_step
    for step in logger.progress(range(run.start_step, cfg.train_iters), total=cfg.train_iters,
                                initial=run.start_step):
        t0 = time.perf_counter()
        # keep --async-level batches ahead of this one (none past the last step): generated by
        # weights <= k updates old
        while (len(pending) <= cfg.algorithm.async_level
               and step + len(pending) < cfg.train_iters):
            pending.append(start_rollout(run, step + len(pending), threads))
        current = pending.popleft()
        batch, metrics = finish_rollout(run, current)
        metrics["rollout/staleness"] = float(step - current.version)
        t_rollout = time.perf_counter() - t0
        metrics.update(global_metrics.batch_metrics(batch.rewards, batch.response_lengths,
                                                    batch.finish_reasons, data_parallel_group()))
        t1 = time.perf_counter()
        ok = train_on_batch(run.policy, run.reference, cfg, batch, metrics)
        nonfinite_in_row = 0 if ok else nonfinite_in_row + 1
        metrics["skipped_update"] = float(not ok)
        if nonfinite_in_row >= cfg.algorithm.max_nonfinite_steps:
            logger.log(step + 1, metrics)
            raise FloatingPointError(f"{nonfinite_in_row} consecutive non-finite updates at step "
                                     f"{step}: stopping (--max-nonfinite-steps)")
        t_train = time.perf_counter() - t1
        # weights change between requests: what is in flight finishes with the old ones (the
        # client's background generations; the other ranks wait for them outside the
        # collectives of the weight update)
        t2 = time.perf_counter()
        if threads is not None and pending:
            on_client(engine, lambda: _finish_generations(pending), "generating the batches "
                      f"of steps {', '.join(str(r.step) for r in pending)} ahead")
        t3 = time.perf_counter()
        if cfg.rollout.rollout_release_memory:
            engine.resume_memory()
        engine.update_weights(step + 1)
        metrics.update({"time/rollout_wait": t3 - t2, "time/weight_sync": time.perf_counter() - t3})
        reset = cfg.algorithm.ref_reset_interval
        if reset and (step + 1) % reset == 0:
            copy_weights(run.policy, run.reference)
        tokens, t_step = _global_sum(batch.loss_mask.sum()), time.perf_counter() - t0
        metrics.update({"time/rollout": t_rollout, "time/train": t_train, "time/step": t_step,
                        "throughput/tokens_per_s": tokens / max(t_step, 1e-9)})
        if cfg.eval.eval_interval and (step + 1) % cfg.eval.eval_interval == 0:
            metrics.update(evaluate(run, step + 1))
        logger.log(step + 1, metrics)
        last = metrics
        stop = stops.reason() if stops is not None and step + 1 < cfg.train_iters else None
        interval = cfg.checkpoint.save_interval
        if (step + 1 == cfg.train_iters or stop is not None
                or (interval and (step + 1) % interval == 0)):
            # resume re-generates the pending (async) batches: record the data position before them
            run.save(step + 1, data_state=pending[0].data_state if pending else None)
            saved = step + 1
        if stop is not None:
            if dist_rank() == 0:
                with open(os.path.join(cfg.checkpoint.save, STOPPED_EARLY), "w") as f:
                    json.dump({"step": step + 1, "reason": stop}, f)
            raise StoppedEarly(step + 1, stop)
    assert saved == max(run.start_step, cfg.train_iters), (saved, cfg.train_iters)
    return last
def _finish_generations(pending) -> None:
    """Wait for the background generations of the Rollouts `pending` (the client rank's); a
    failed one raises its exception."""
    for r in pending:
        if r.future is not None:
            r.future.result()


def main(argv=None) -> None:
    """Train; exit 0 at --train-iters, EXIT_RESUMABLE (75) when stopped early and saved."""
    cfg = parse_config(argv)
    from megatron_rl.parallel import destroy_distributed

    try:
        train(cfg)
    except StoppedEarly as e:
        print(f"[megatron-rl] {e}", file=sys.stderr, flush=True)
        destroy_distributed()
        sys.exit(EXIT_RESUMABLE)
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1:])
