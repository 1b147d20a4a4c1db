"""A step's rollout batch, from the data to this rank's RolloutBatch: where the rollout runs, and
what each rank trains on.

    prompts (the step's records, and the data position before them)
    -> the rollout function (rollout/functions.py: generation and rewards, groups of
       Trajectory): on every rank, each data-parallel replica its share (an engine without a
       client rank: the in-process one), or the whole batch on the engine's client rank (a
       server, a child process), under --async-level in a background thread
    -> the groups dealt to the data-parallel ranks (by token count with --sequence-packing)
    -> this rank's RolloutBatch on the device (batch.pack_rollouts), its behaviour log-probs
       (update.behaviour_logprobs: the weights that generated it, at the time it is built) and
       the rollout metrics

`RolloutQueue` is what the training loop uses: each step's batch, generated up to --async-level
steps ahead. `generate_batch(run, step)` builds one step's batch at once (tools, tests).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
from typing import TYPE_CHECKING

import torch.distributed as dist

from megatron_rl import metrics as global_metrics
from megatron_rl.batch import RolloutBatch, pack_rollouts
from megatron_rl.packing import balance_groups
from megatron_rl.parallel import data_parallel_group, device, dist_rank
from megatron_rl.rewards.types import REASONS
from megatron_rl.rollout.base import on_client
from megatron_rl.rollout.functions import RolloutContext, Trajectory, run_rollout, trajectory_counts
from megatron_rl.rollout.threads import BackgroundThreads
from megatron_rl.update import behaviour_logprobs

if TYPE_CHECKING:
    from megatron_rl.runtime import Run


@dataclasses.dataclass
class Rollout:
    """One step's batch on its way: the prompts taken from the data, and either the finished
    (batch, metrics) or, for an engine with weights of its own under --async-level, its client
    rank's rollout function running in a background thread (`future`: the groups of
    trajectories). `version` is the weight version that generates it."""
    step: int
    data_state: dict              # the data position before this batch (a resume re-takes it)
    version: int
    records: list
    future: concurrent.futures.Future | None = None
    done: tuple | None = None     # (RolloutBatch, metrics)


def start_rollout(run: Run, step: int, threads: BackgroundThreads | None = None) -> Rollout:
    """Take `step`'s prompts and start their rollout. Rolled out once per batch: with an engine
    without a client rank (the in-process one), each data-parallel replica's model-parallel
    group rolls out its share together, here and now; with an engine that has one client, that
    rank rolls out the whole batch -- in one of `threads` when given (--async-level >= 1), so
    that generation overlaps training."""
    data_state = run.train_data.state_dict()
    records = run.train_data.next_batch(run.cfg.algorithm.num_prompts_per_step)
    r = Rollout(step, data_state, run.engine.weight_version, records)
    if threads is not None:
        if dist_rank() == run.engine.client_rank:
            r.future = threads.submit(_rollout, run, records, _seed(run, step), step)
    else:
        r.done = _build_batch(run, r)
    return r


def finish_rollout(run: Run, r: Rollout) -> tuple[RolloutBatch, dict]:
    """The step's batch and its metrics (waits for a background generation): the rollout's
    (reward errors, the engine's counters, the recompute's mismatch), its staleness (updates
    between the generating weights and this step's) and the batch's rewards and lengths."""
    batch, metrics = r.done if r.done is not None else _build_batch(run, r)
    metrics["rollout/staleness"] = float(r.step - r.version)
    metrics.update(global_metrics.batch_metrics(batch.rewards, batch.response_lengths,
                                                batch.finish_reasons, data_parallel_group()))
    return batch, metrics


def generate_batch(run: Run, step: int) -> tuple[RolloutBatch, dict]:
    """`step`'s batch and metrics on this rank, rolled out here and now (tools, tests)."""
    return finish_rollout(run, start_rollout(run, step))


class RolloutQueue:
    """The training loop's rollouts, in step order: each step's batch, with the batches of up
    to --async-level later steps started ahead (none past --train-iters), so that they come
    from weights up to k updates old. An engine with weights of its own generates them in
    background threads of its client rank (TrainConfig.overlaps_rollout); the in-process engine
    generates them in turn (stale, no overlap)."""

    def __init__(self, run: Run):
        self.run = run
        k = run.cfg.algorithm.async_level
        self.threads = BackgroundThreads(max(k, 1)) if run.cfg.overlaps_rollout() else None
        self.pending: collections.deque[Rollout] = collections.deque()  # started ahead

    def take(self, step: int) -> tuple[RolloutBatch, dict]:
        """`step`'s batch and metrics (finish_rollout), the later ones started ahead."""
        cfg = self.run.cfg
        while (len(self.pending) <= cfg.algorithm.async_level
               and step + len(self.pending) < cfg.train_iters):
            self.pending.append(start_rollout(self.run, step + len(self.pending), self.threads))
        current = self.pending.popleft()
        assert current.step == step, (current.step, step)
        return finish_rollout(self.run, current)

    def finish_generations(self) -> None:
        """Wait, on every rank, until the background generations started ahead are done (the
        client's; the other ranks wait outside the collectives): before the weights change, so
        that each request is served by one weight version. A failed one raises."""
        if self.threads is None or not self.pending:
            return
        steps = ", ".join(str(r.step) for r in self.pending)
        on_client(self.run.engine, self._wait_pending,
                  f"generating the batches of steps {steps} ahead")

    def _wait_pending(self) -> None:
        for r in self.pending:
            if r.future is not None:
                r.future.result()

    def data_state(self) -> dict | None:
        """The data position a resume starts from: before the batches started ahead (they are
        generated again), or None for the current one."""
        return self.pending[0].data_state if self.pending else None

    def close(self, wait: bool) -> None:
        """Stop the background threads. wait=False (a failed or interrupted run): nothing waits
        for a generation in flight; its daemon thread ends with the process, even when an
        attached server never answers."""
        if self.threads is not None:
            self.threads.shutdown(wait=wait, cancel_futures=not wait)


def _seed(run: Run, step: int) -> int:
    return run.cfg.seed + 7919 * step


def _build_batch(run: Run, r: Rollout) -> tuple[RolloutBatch, dict]:
    """This rank's RolloutBatch of `r` on the device, its behaviour log-probs filled, and the
    rollout's metrics (reward errors, the engine's counters, the recompute's). Collective over
    all ranks."""
    cfg, algo, engine = run.cfg, run.cfg.algorithm, run.engine
    if engine.client_rank is None:
        mine = r.records[run.dp_rank::run.dp_size]
        groups = _rollout(run, mine, _seed(run, r.step) + run.dp_rank, r.step)
        if algo.sequence_packing and run.dp_size > 1:  # re-deal the groups by token count
            groups = _deal_groups(run, [g for part in _gather_dp(groups) for g in part])
        engine_stats: dict = {}
    else:
        def generate():
            groups = (r.future.result() if r.future is not None
                      else _rollout(run, r.records, _seed(run, r.step), r.step))
            if cfg.rollout.rollout_release_memory:  # generated: the GPUs are the trainer's now
                engine.release_memory()
            return groups, engine.stats()

        groups, engine_stats = on_client(engine, generate,
                                         f"generating and scoring step {r.step}'s batch")
        groups = _deal_groups(run, groups)
    # the one host -> device boundary: from here on the batch lives where the model does
    batch = pack_rollouts(groups, run.codec.pad_id).to(device())
    metrics = global_metrics.count_metrics(_reward_errors(groups), "reward_errors/",
                                           data_parallel_group())
    counts = global_metrics.count_metrics(trajectory_counts(groups), "rollout/",
                                          data_parallel_group())
    metrics.update({k: v / metrics["reward_errors/total"] for k, v in counts.items()})
    metrics.update(engine_stats)
    # behaviour policy = the weights that generated the batch (see --old-logprobs)
    metrics.update(behaviour_logprobs(run.policy, cfg, batch))
    return batch, metrics


def _rollout(run: Run, records: list, seed: int, step: int) -> list[list[Trajectory]]:
    """--rollout-function's groups of trajectories for `records`, sampled with `seed`."""
    ctx = RolloutContext(run.engine, run.sampling_params(seed=seed), run.cfg.algorithm.group_size,
                         run.codec, run.scorer, run.cfg, step)
    return run_rollout(run.cfg.rollout.rollout_function, ctx, records)


def _reward_errors(groups: list[list[Trajectory]]) -> dict[str, int]:
    """Trajectories by the reason their reward is 0 (rewards.types.REASONS, and any other a
    rollout function gives), and their "total"."""
    counts = collections.Counter(t.reward_error for g in groups for t in g
                                 if t.reward_error is not None)
    return {**dict.fromkeys(REASONS, 0), **counts, "total": sum(len(g) for g in groups)}


def _deal_groups(run: Run, groups: list[list[Trajectory]]) -> list[list[Trajectory]]:
    """This data-parallel rank's groups of the whole batch: with --sequence-packing dealt by
    token count (packing.balance_groups), so that no rank trains on a long tail the others
    wait for; else every dp_size-th group."""
    if run.cfg.algorithm.sequence_packing:
        tokens = [sum(len(t.prompt_ids) + len(t.response_ids) for t in g) for g in groups]
        mine = balance_groups(tokens, run.dp_size)[run.dp_rank]
    else:
        mine = list(range(len(groups)))[run.dp_rank::run.dp_size]
    return [groups[i] for i in mine]


def _gather_dp(obj) -> list:
    """Every data-parallel rank's picklable `obj`, in rank order."""
    group = data_parallel_group()
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
