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

With --save-rollouts N the whole batch of every Nth step is written as JSONL once its groups
exist, under the step it is trained at (a batch generated ahead under --async-level too):
rollout/trajectory_log.py.

With --dynamic-sampling the rollout function runs in rounds (dynamic_sampling.py:
`sample_informative`) until --num-prompts-per-step groups with reward spread are in hand.
Whoever rolls the batch out takes its prompts then: every rank in step with the
in-process engine, else the client rank, under --async-level in one background thread that
takes the batches' prompts in step order from a data cursor of its own, so that the data
position after each batch is known when it is finished and a resume continues with the first
prompt no finished batch consumed.

`RolloutQueue` is what the training loop uses: each step's batch, generated up to --async-level
steps ahead. `generate_batch(run, step)` builds one step's batch at once (tools, tests). The
settings these read are taken from the run's configuration once (`BatchSettings`).

A checkpoint saved with batches generated ahead (a SIGTERM stop, a periodic save) keeps them
(`RolloutQueue.saved_state`: their trajectories, or the in-process engine's finished batches,
their weight versions and the data position after them), so that the resumed run trains on the
batches, at the staleness, that the uninterrupted run does. A resume under settings that would
generate other batches (`ahead_free` lists the settings that may differ) generates them again
from the resumed weights, with a warning.
"""

from __future__ import annotations

import collections
import concurrent.futures
import copy
import dataclasses
import io
import math
import pickle
import types
import warnings
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from megatron_rl import metrics as global_metrics
from megatron_rl.batch import RolloutBatch, Trajectory, pack_rollouts
from megatron_rl.config_changes import RESUME_FREE, config_differences, flat_config
from megatron_rl.dynamic_sampling import (ROUND_SEED_STRIDE, DynamicSampling, Sampled,
                                          sample_informative)
from megatron_rl.packing import rank_groups
from megatron_rl.parallel import all_reduce, data_parallel_group, device, dist_rank
from megatron_rl.rewards.types import REASONS
from megatron_rl.rollout.base import on_client
from megatron_rl.rollout.functions import RolloutContext, run_rollout, trajectory_counts
from megatron_rl.rollout.threads import BackgroundThreads
from megatron_rl.rollout.trajectory_log import write_rollouts
from megatron_rl.rollout.versions import drop_stale, version_metrics
from megatron_rl.update import behaviour_logprobs

if TYPE_CHECKING:
    from megatron_rl.agent.settings import AgentConfig
    from megatron_rl.config import TrainConfig
    from megatron_rl.data.prompts import PromptDataset
    from megatron_rl.runtime import Run


@dataclasses.dataclass(frozen=True)
class BatchSettings:
    """The settings a step's batch is made with, taken from the run's configuration once
    (`of`): seed (--seed: each step's sampling seed derives from it), train_iters,
    num_prompts_per_step, group_size, async_level, overlaps (an engine with weights of its
    own generating in the background: TrainConfig.overlaps_rollout), sequence_packing (the
    groups dealt by token count), ppo_minibatches, rollout_function (--rollout-function) and
    what it reads (rollout_function_args, agent: RolloutContext's args and agent),
    release_memory (--rollout-release-memory), dynamic (the rule of --dynamic-sampling's
    rounds; None without it), partial_rollouts (--partial-rollouts: a weight update does not
    wait for the generations in flight) and max_token_staleness."""
    seed: int
    train_iters: int
    num_prompts_per_step: int
    group_size: int
    async_level: int
    overlaps: bool
    sequence_packing: bool
    ppo_minibatches: int
    rollout_function: str
    rollout_function_args: dict[str, Any]
    agent: AgentConfig
    release_memory: bool
    dynamic: DynamicSampling | None
    partial_rollouts: bool = False
    max_token_staleness: int | None = None

    @classmethod
    def of(cls, cfg: TrainConfig, dp_size: int, client_rank: int | None) -> BatchSettings:
        """The settings of `cfg` on `dp_size` data-parallel ranks, with an engine whose client
        rank is `client_rank` (None: the in-process engine, every replica rolls out its share)."""
        algo = cfg.algorithm
        dynamic = None
        if algo.dynamic_sampling:
            keep = algo.keeps_filtered_groups()
            dynamic = DynamicSampling(
                algo.num_prompts_per_step, keep, _batch_unit(cfg, dp_size) if keep else 1,
                dp_size if client_rank is None else 1, algo.dynamic_sampling_max_rounds)
        return cls(cfg.seed, cfg.train_iters, algo.num_prompts_per_step, algo.group_size,
                   algo.async_level, cfg.overlaps_rollout(), algo.sequence_packing,
                   algo.ppo_minibatches, cfg.rollout.rollout_function,
                   cfg.rollout.rollout_function_args, cfg.agent,
                   cfg.rollout.rollout_release_memory, dynamic, cfg.rollout.partial_rollouts,
                   cfg.rollout.max_token_staleness)


def batch_settings(run: Run) -> BatchSettings:
    """`run`'s BatchSettings."""
    return BatchSettings.of(run.cfg, run.dp_size, run.engine.client_rank)


@dataclasses.dataclass
class Rollout:
    """One step's batch on its way: the prompts taken from the data, and either the finished
    (batch, metrics) or, for an engine with weights of its own under --async-level, its client
    rank's rollout function running in a background thread (`future`: the groups of
    trajectories). `version` is the weight version that generates it."""
    step: int
    # the data position before this batch (a resume re-takes it); None where the batch takes
    # its prompts in the background (--dynamic-sampling under --async-level): then the data's
    # position is the one after the batch before, the finished batches' (finish_rollout)
    data_state: dict | None
    version: int
    records: list
    future: concurrent.futures.Future | None = None
    done: tuple | None = None     # (RolloutBatch, metrics)


def start_rollout(run: Run, s: BatchSettings, step: int,
                  threads: BackgroundThreads | None = None,
                  cursor: PromptDataset | None = None) -> Rollout:
    """Take `step`'s prompts and start their rollout. Rolled out once per batch: with an engine
    without a client rank (the in-process one), each data-parallel replica's model-parallel
    group rolls out its share together, here and now; with an engine that has one client, that
    rank rolls out the whole batch -- in one of `threads` when given (--async-level >= 1), so
    that generation overlaps training. With --dynamic-sampling the rollout takes the prompts
    itself (sample_informative); in `threads` (one of them: the batches in step order) from
    `cursor`, the background's copy of the data."""
    dynamic = s.dynamic is not None
    background = threads is not None and dynamic
    data_state = None if background else run.train_data.state_dict()
    records = [] if dynamic else run.train_data.next_batch(s.num_prompts_per_step)
    r = Rollout(step, data_state, run.engine.weight_version, records)
    if threads is not None:
        if dist_rank() == run.engine.client_rank:
            if background:
                assert cursor is not None, "background dynamic sampling takes from a cursor"
                r.future = threads.submit(_sample_on_client, run, s, cursor, step)
            else:
                r.future = threads.submit(_rollout, run, s, records, _seed(s, step), step)
    else:
        r.done = _build_batch(run, s, r)
    return r


def finish_rollout(run: Run, s: BatchSettings, r: Rollout) -> tuple[RolloutBatch, dict]:
    """The step's batch and its metrics (waits for a background generation): the rollout's
    (reward errors, the engine's counters, the recompute's mismatch), its staleness (updates
    between the generating weights and this step's) and the batch's rewards and lengths."""
    batch, metrics = r.done if r.done is not None else _build_batch(run, s, r)
    metrics["rollout/staleness"] = float(r.step - r.version)
    metrics.update(global_metrics.batch_metrics(batch.rewards, batch.response_lengths,
                                                batch.finish_reasons, data_parallel_group(),
                                                policy_tokens=batch.loss_mask.sum()))
    return batch, metrics


def generate_batch(run: Run, step: int) -> tuple[RolloutBatch, dict]:
    """`step`'s batch and metrics on this rank, rolled out here and now (tools, tests)."""
    s = batch_settings(run)
    return finish_rollout(run, s, start_rollout(run, s, step))


class RolloutQueue:
    """The training loop's rollouts, in step order: each step's batch, with the batches of up
    to --async-level later steps started ahead (none past --train-iters), so that they come
    from weights up to k updates old. An engine with weights of its own generates them in
    background threads of its client rank (TrainConfig.overlaps_rollout); the in-process engine
    generates them in turn (stale, no overlap)."""

    def __init__(self, run: Run):
        self.run = run
        self.settings = s = batch_settings(run)
        # --dynamic-sampling: one thread, so that the batches take their prompts in step order
        workers = 1 if s.dynamic is not None else max(s.async_level, 1)
        self.threads = BackgroundThreads(workers) if s.overlaps else None
        # the background's data position (its thread alone moves it): --dynamic-sampling
        self.cursor = (copy.copy(run.train_data)
                       if self.threads is not None and s.dynamic is not None else None)
        self.pending: collections.deque[Rollout] = collections.deque()  # started ahead
        saved, run.ahead = run.ahead, None
        if saved is not None:
            self._restore(saved)

    def take(self, step: int) -> tuple[RolloutBatch, dict]:
        """`step`'s batch and metrics (finish_rollout), the later ones started ahead."""
        s = self.settings
        while len(self.pending) <= s.async_level and step + len(self.pending) < s.train_iters:
            self.pending.append(start_rollout(self.run, s, step + len(self.pending),
                                              self.threads, self.cursor))
        current = self.pending.popleft()
        assert current.step == step, (current.step, step)
        return finish_rollout(self.run, s, current)

    def finish_generations(self) -> None:
        """Wait, on every rank, until the background generations started ahead are done (the
        client's; the other ranks wait outside the collectives): before the weights change, so
        that each request is served by one weight version. A failed one raises. Under
        --partial-rollouts nothing waits: the update interrupts them (rollout/process.py)."""
        if self.settings.partial_rollouts:
            return
        self._wait_all()

    def _wait_all(self) -> None:
        """finish_generations' wait, on every rank alike."""
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
        """The data position a resume starts from: before the batches started ahead (a resume
        that cannot use the saved ones, saved_state, generates them again), or None for the
        current one (after the last finished batch)."""
        return self.pending[0].data_state if self.pending else None

    def saved_state(self) -> bytes | None:
        """The batches started ahead, for the checkpoint of the step just trained (waited for
        here on every rank alike, as under --partial-rollouts finish_generations does not
        wait: no rank enters the checkpoint's collectives while the client still generates);
        None when none is. What this rank holds of each: the
        trajectories its client rank generated (or the in-process engine's finished batch),
        the prompts, the weight version that generated it, and the data position after them.
        Serialized here (torch.save) so that the checkpoint's extra state loads whatever they
        hold: a resume that cannot read them generates them again."""
        if not self.pending:
            return None
        self._wait_all()
        run = self.run
        state = {
            "format": AHEAD_FORMAT, "config": flat_config(run.cfg), "world_size": _world_size(),
            "data": (self.cursor if self.cursor is not None else run.train_data).state_dict(),
            "rollouts": [{"step": r.step, "version": r.version, "data_state": r.data_state,
                          "records": r.records, "done": r.done,
                          "generated": r.future.result() if r.future is not None else None}
                         for r in self.pending]}
        buffer = io.BytesIO()
        torch.save(state, buffer)
        return buffer.getvalue()

    def _restore(self, saved: bytes) -> None:
        """The batches a checkpoint saved ahead (saved_state) as the first ones pending, the data
        position after them; or, where any rank cannot use them (_ahead_problem), none: they
        are generated again, with a warning."""
        run = self.run
        state: dict = {}
        try:
            state = torch.load(io.BytesIO(saved), map_location=device(), weights_only=False,
                               pickle_module=_SAVED_PICKLE)
            problem = _ahead_problem(run, self.settings, state)
        except Exception as e:  # noqa: BLE001 -- saved by another version: generated again
            problem = f"they cannot be read ({type(e).__name__}: {e})"
        if all_reduce([float(problem is not None)], op=dist.ReduceOp.MAX).item():
            if dist_rank() == 0:
                saved_steps = state.get("rollouts", []) if isinstance(state, dict) else []
                steps = ", ".join(str(r["step"] + 1) for r in saved_steps) or "?"
                warnings.warn(
                    f"the batches generated ahead (--async-level) for steps {steps} and saved "
                    f"with the checkpoint of step {run.start_step} are generated again, from "
                    f"the resumed weights: {problem or 'another rank cannot use its share'}. "
                    "Their samples and rollout/staleness differ from those of a run that was "
                    "not stopped", stacklevel=2)
            return
        for item in state["rollouts"]:
            future = None
            if item["generated"] is not None:
                future = concurrent.futures.Future()
                future.set_result(item["generated"])
            self.pending.append(Rollout(item["step"], item["data_state"], item["version"],
                                        item["records"], future, item["done"]))
        (self.cursor if self.cursor is not None else run.train_data).load_state_dict(
            state["data"])

    def close(self, wait: bool) -> None:
        """Stop the background threads. wait=False (a failed or interrupted run): nothing waits
        for a generation in flight; its daemon thread ends with the process, even when an
        attached server never answers."""
        if self.threads is not None:
            self.threads.shutdown(wait=wait, cancel_futures=not wait)


def _seed(s: BatchSettings, step: int) -> int:
    """The sampling seed of `step`'s batch (of its first round under --dynamic-sampling)."""
    return s.seed + 7919 * step


AHEAD_FORMAT = 1  # the layout of RolloutQueue.saved_state

# The settings under which batches generated ahead and saved are the ones the resuming run would
# generate and train on: those a resume may change freely (config_changes.RESUME_FREE: where it
# stops and saves, where generation runs, kernels), but for the ones that decide how a batch
# is dealt to the ranks and cut (the in-process engine saves each rank's finished share).
_DEALING = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
            "expert_model_parallel_size", "sequence_parallel", "micro_batch_size",
            "sequence_packing", "max_tokens_per_microbatch")


def ahead_free() -> set[str]:
    """The settings (flat names) a resume may change and still train on the saved batches."""
    return set(RESUME_FREE) - set(_DEALING)


def _ahead_problem(run: Run, s: BatchSettings, state: dict) -> str | None:
    """Why the batches `state` saved ahead (RolloutQueue.saved_state) are not the ones `run`
    would train on, or None when they are."""
    if state.get("format") != AHEAD_FORMAT:
        return f"saved in another format ({state.get('format')!r})"
    if state["world_size"] != _world_size():
        return f"saved by {state['world_size']} ranks, resumed on {_world_size()}"
    steps = [r["step"] for r in state["rollouts"]]
    if steps[0] != run.start_step:
        return f"they start at step {steps[0] + 1}, the resumed run at {run.start_step + 1}"
    if steps[-1] >= s.train_iters:
        return f"--train-iters {s.train_iters} ends before step {steps[-1] + 1}"
    changed = {k: v for k, v in config_differences(state["config"], flat_config(run.cfg)).items()
               if k not in ahead_free()}
    if changed:
        return "settings differ from the saving run's: " + ", ".join(
            f"--{k.replace('_', '-')}: {old!r} -> {new!r}" for k, (old, new) in changed.items())
    return None


# Classes the batches saved ahead hold (pickled by module and name) that checkpoints written
# before they moved name by their former modules: {(former module, name): module now}.
_MOVED = {("megatron_rl.rollout.orchestrate", "Sampled"): "megatron_rl.dynamic_sampling",
          ("megatron_rl.rollout.functions", "Trajectory"): "megatron_rl.batch"}


class _SavedUnpickler(pickle.Unpickler):
    """Unpickles batches saved ahead, a class found where it lives now (_MOVED)."""

    def find_class(self, module: str, name: str):
        return super().find_class(_MOVED.get((module, name), module), name)


_SAVED_PICKLE = types.SimpleNamespace(__name__="pickle", Unpickler=_SavedUnpickler,
                                      load=pickle.load)  # torch.load's pickle_module


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _build_batch(run: Run, s: BatchSettings, r: Rollout) -> tuple[RolloutBatch, dict]:
    """This rank's RolloutBatch of `r` on the device, its behaviour log-probs filled, and the
    rollout's metrics (reward errors, the engine's counters, the recompute's). Collective over
    all ranks."""
    engine = run.engine
    sampled: Sampled | None = None
    if engine.client_rank is None and s.dynamic is not None:
        sampled = sample_informative(s.dynamic, run.train_data, _local_round(run, s, r.step))
        write_rollouts(run.rollout_log(), r.step + 1, "train", sampled.records, sampled.groups)
        groups = _my_groups(run, s, sampled.groups)
        engine_stats: dict = {}
    elif engine.client_rank is None:
        mine = r.records[run.dp_rank::run.dp_size]
        groups = _rollout(run, s, mine, _seed(s, r.step) + run.dp_rank, r.step)
        write_rollouts(run.rollout_log(), r.step + 1, "train", mine, groups, shared=True)
        if s.sequence_packing and run.dp_size > 1:  # re-deal the groups by token count
            groups = _my_groups(run, s, [g for part in _gather_dp(groups) for g in part])
        engine_stats = {}
    else:
        def generate():
            if r.future is not None:
                out = r.future.result()
            elif s.dynamic is not None:
                out = _sample_on_client(run, s, run.train_data, r.step)
            else:
                out = _rollout(run, s, r.records, _seed(s, r.step), r.step)
            if s.release_memory:  # generated: the GPUs are the trainer's now
                engine.release_memory()
            return out, engine.stats()

        out, engine_stats = on_client(engine, generate,
                                      f"generating and scoring step {r.step}'s batch")
        records = r.records
        if isinstance(out, Sampled):
            sampled, out = out, out.groups
            records = getattr(sampled, "records", None) or []  # None: saved by an older run
            # every rank's data position: after the prompts the client's rounds consumed
            run.train_data.load_state_dict(sampled.data_state)
        if len(records) == len(out):
            write_rollouts(run.rollout_log(), r.step + 1, "train", records, out,
                           writer=engine.client_rank or 0)
        groups = _my_groups(run, s, out)
    versions = None
    if s.partial_rollouts:  # each token's weight version; the samples too stale masked out
        versions = drop_stale(groups, r.step, r.version, s.max_token_staleness)
    # the one host -> device boundary: from here on the batch lives where the model does
    batch = pack_rollouts(groups, run.codec.pad_id).to(device())
    metrics = global_metrics.count_metrics(_reward_errors(groups), "reward_errors/",
                                           data_parallel_group())
    counts = global_metrics.count_metrics(trajectory_counts(groups), "rollout/",
                                          data_parallel_group())
    metrics.update({k: v / metrics["reward_errors/total"] for k, v in counts.items()})
    metrics.update(engine_stats)
    if versions is not None:
        metrics.update(version_metrics(global_metrics.count_metrics(
            versions, "", data_parallel_group())))
    if sampled is not None:
        metrics.update(sampled.stats)
        if sampled.shortfall and dist_rank() == 0:
            warnings.warn(f"step {r.step}: {sampled.shortfall}", stacklevel=1)
    # behaviour policy = the weights that generated the batch (see --old-logprobs)
    metrics.update(behaviour_logprobs(run.policy, run.cfg, batch))
    return batch, metrics


def _rollout(run: Run, s: BatchSettings, records: list, seed: int,
             step: int) -> list[list[Trajectory]]:
    """--rollout-function's groups of trajectories for `records`, sampled with `seed`."""
    ctx = RolloutContext(run.engine, run.sampling_params(seed=seed), s.group_size, run.codec,
                         run.scorer, step, agent=s.agent, args=s.rollout_function_args)
    return run_rollout(s.rollout_function, ctx, records)


def _batch_unit(cfg: TrainConfig, dp_size: int) -> int:
    """Groups a batch of variable size (--dynamic-sampling-keep-kl) is a multiple of: each
    data-parallel rank and PPO minibatch the same share, and under pipeline parallelism without
    packing minibatches of whole microbatches (TrainConfig.check_layout's rules)."""
    algo = cfg.algorithm
    unit = dp_size * algo.ppo_minibatches
    if cfg.parallel.pipeline_model_parallel_size > 1 and not algo.sequence_packing:
        unit *= algo.micro_batch_size // math.gcd(algo.micro_batch_size, algo.group_size)
    return unit


def _round_seed(s: BatchSettings, step: int, round_: int) -> int:
    """The sampling seed of a dynamic-sampling round: round 0 has the step's own."""
    return _seed(s, step) + ROUND_SEED_STRIDE * round_


def _local_round(run: Run, s: BatchSettings,
                 step: int) -> Callable[[list, int], list[list[Trajectory]]]:
    """A round of the in-process engine: each data-parallel replica rolls out its share of the
    records (every dp_size-th), and every rank gets all groups back in the records' order."""
    def rollout(records: list, round_: int) -> list[list[Trajectory]]:
        mine = _rollout(run, s, records[run.dp_rank::run.dp_size],
                        _round_seed(s, step, round_) + run.dp_rank, step)
        if run.dp_size == 1:
            return mine
        parts = _gather_dp(mine)
        return [parts[i % run.dp_size][i // run.dp_size] for i in range(len(records))]
    return rollout


def _sample_on_client(run: Run, s: BatchSettings, data: PromptDataset, step: int) -> Sampled:
    """sample_informative on the engine's client rank, for the whole batch."""
    assert s.dynamic is not None, "sampled under --dynamic-sampling"
    return sample_informative(s.dynamic, data, lambda records, round_: _rollout(
        run, s, records, _round_seed(s, step, round_), step))


def _reward_errors(groups: list[list[Trajectory]]) -> dict[str, int]:
    """Trajectories by the reason their reward is 0 (rewards.types.REASONS, and any other a
    rollout function gives), and their "total"."""
    counts = collections.Counter(t.reward_error for g in groups for t in g
                                 if t.reward_error is not None)
    return {**dict.fromkeys(REASONS, 0), **counts, "total": sum(len(g) for g in groups)}


def _deal_groups(groups: list[list[Trajectory]], dp_size: int, dp_rank: int,
                 ppo_minibatches: int, sequence_packing: bool) -> list[list[Trajectory]]:
    """Data-parallel rank `dp_rank`'s groups of the whole batch, minibatch by minibatch
    (packing.rank_groups: PPO minibatch k is the k-th block of groups at any layout): with
    --sequence-packing dealt by token count, so that no rank trains on a long tail the others
    wait for; else every dp_size-th group (without packing the in-process engine rolls out
    just these: every dp_size-th record)."""
    tokens = [sum(len(t.prompt_ids) + len(t.response_ids) for t in g) for g in groups]
    mine = rank_groups(tokens, dp_size, dp_rank, ppo_minibatches, balance=sequence_packing)
    return [groups[i] for i in mine]


def _my_groups(run: Run, s: BatchSettings,
               groups: list[list[Trajectory]]) -> list[list[Trajectory]]:
    """This rank's groups of the whole batch (_deal_groups)."""
    return _deal_groups(groups, run.dp_size, run.dp_rank, s.ppo_minibatches, s.sequence_packing)


def _gather_dp(obj) -> list:
    """Every data-parallel rank's picklable `obj`, in rank order."""
    group = data_parallel_group()
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
