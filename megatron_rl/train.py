"""RL training of a policy on verifiable rewards, with the KL term where the run puts it.

The loop, top-down, one RL step at a time:

    rollout (rollout_queue: prompts -> the rollout function, --rollout-function:
             generation and rewards -> this rank's batch and its behaviour log-probs; up to
             --async-level steps ahead)
    -> update (update.train_on_batch: reference log-probs -> advantages, with the KL in the
              reward when placed there -> PPO epochs over minibatches, with the KL in the loss
              when placed there)
    -> weight sync to the engine -> periodic eval, log and save

Launch: `megatron-rl train ...` or `torchrun --nproc-per-node N -m megatron_rl.train ...`.
Each data-parallel rank trains on its share of the prompts; losses are normalised by global
(all-reduced) token/sequence counts, so results do not depend on the layout.
"""

from __future__ import annotations

import sys
import time

from megatron_rl.checkpoint import copy_weights
from megatron_rl.config import TrainConfig, parse_config
from megatron_rl.errors import run_command
from megatron_rl.evaluation import evaluate
from megatron_rl.metrics_log import check_log_files
from megatron_rl.parallel import data_parallel_sum
from megatron_rl.rollout_queue import RolloutQueue
from megatron_rl.run_lock import RunLock
from megatron_rl.runtime import Run, setup_run
from megatron_rl.stopping import (EXIT_RESUMABLE, StoppedEarly, StopRequests,
                                  remove_stopped_marker, save_dir_of, write_stopped_marker)
from megatron_rl.update import train_on_batch


def train(cfg: TrainConfig) -> dict:
    """Build the run (setup_run), train it to --train-iters, close it. Returns the last step's
    metrics. Raises StoppedEarly after saving and closing the run when a signal
    (--exit-signal-handler) or the time budget (--exit-duration-in-mins) stopped it earlier."""
    stops = StopRequests(cfg.checkpoint.exit_signal_handler,
                         cfg.checkpoint.exit_duration_in_mins, time.monotonic())
    # one run per --save: global rank 0 holds the lock until the run ends, however it ends;
    # a signal during the setup too stops the run at its first step boundary
    with RunLock(cfg.checkpoint.save), stops:
        # this start takes over from the one that stopped early (before the setup: a run that
        # fails in it is not requeued again and again)
        remove_stopped_marker(cfg.checkpoint.save)
        check_log_files(cfg.checkpoint.save)  # a log that cannot be written: before the model
        run = setup_run(cfg)
        rollouts = RolloutQueue(run)
        try:
            last = train_loop(run, rollouts, stops)
        except BaseException:
            # nothing waits for a generation in flight: the engine stops (a managed server is
            # killed, so its request fails at once)
            rollouts.close(wait=False)
            run.close()
            raise
        rollouts.close(wait=True)
        run.close()
    return last


def train_loop(run: Run, rollouts: RolloutQueue, stops: StopRequests | None = None) -> dict:
    """Steps start_step .. --train-iters of `run`, their batches from `rollouts`. Saves every
    --save-interval steps and the last step; raises StoppedEarly, after saving the step, when
    `stops` says to stop."""
    cfg, engine, logger = run.cfg, run.engine, run.logger
    nonfinite_in_row = 0
    last = {}
    saved = run.start_step
    for step in logger.progress(range(run.start_step, cfg.train_iters), total=cfg.train_iters,
                                initial=run.start_step):
        t0 = time.perf_counter()
        batch, metrics = rollouts.take(step)  # generated now, or up to --async-level steps ago
        t_rollout = time.perf_counter() - t0
        ok = train_on_batch(run.policy, run.reference, cfg, batch, metrics)
        nonfinite_in_row = 0 if ok else nonfinite_in_row + 1
        metrics["skipped_update"] = float(not ok)
        if nonfinite_in_row >= cfg.algorithm.max_nonfinite_steps:
            logger.log(step + 1, metrics)
            raise FloatingPointError(f"{nonfinite_in_row} consecutive non-finite updates at step "
                                     f"{step}: stopping (--max-nonfinite-steps)")
        t_train = time.perf_counter() - t0 - t_rollout
        # weights change between requests: what is in flight finishes with the old ones
        t2 = time.perf_counter()
        rollouts.finish_generations()
        t3 = time.perf_counter()
        if cfg.rollout.rollout_release_memory:
            engine.resume_memory()
        engine.update_weights(step + 1)
        metrics.update({"time/rollout_wait": t3 - t2, "time/weight_sync": time.perf_counter() - t3})
        reset = cfg.algorithm.ref_reset_interval
        if reset and (step + 1) % reset == 0:
            copy_weights(run.policy, run.reference)
        tokens, t_step = data_parallel_sum(batch.loss_mask.sum()), time.perf_counter() - t0
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
            # the batches started ahead are saved with the step, and the data position
            # before them, for a resume that has to generate them again
            run.save(step + 1, data_state=rollouts.data_state(), ahead=rollouts.saved_state())
            saved = step + 1
        if stop is not None:
            write_stopped_marker(cfg.checkpoint.save, step + 1, stop)
            raise StoppedEarly(step + 1, stop)
    assert saved == max(run.start_step, cfg.train_iters), (saved, cfg.train_iters)
    return last


def main(argv=None) -> None:
    """Train; exit 0 at --train-iters, EXIT_RESUMABLE (75) when stopped early and saved. A
    configuration or data file refused raises errors.UserError (the process: status 2)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # before the flags are checked: an attempt refused for its configuration leaves no marker
    # of an earlier stop, so a job that requeues on the marker does not requeue it forever
    remove_stopped_marker(save_dir_of(argv))
    cfg = parse_config(argv)
    from megatron_rl.parallel import destroy_distributed
    from megatron_rl.processes import skip_exit_collection

    try:
        train(cfg)
    except StoppedEarly as e:
        print(f"[megatron-rl] {e}", file=sys.stderr, flush=True)
        destroy_distributed()
        skip_exit_collection()
        sys.exit(EXIT_RESUMABLE)
    destroy_distributed()
    skip_exit_collection()


if __name__ == "__main__":
    sys.exit(run_command("megatron-rl train", main, sys.argv[1:]))
