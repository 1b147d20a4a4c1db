"""Stopping a run before --train-iters, resumably: a SIGTERM/SIGINT (--exit-signal-handler) or
the wall-clock budget (--exit-duration-in-mins) asks for a stop at the next step boundary
(StopRequests); the loop saves that step, marks the run directory (STOPPED_EARLY) and raises
StoppedEarly, which the entry point turns into the exit status EXIT_RESUMABLE.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import torch.distributed as dist

from megatron_rl.parallel import all_reduce, dist_rank


EXIT_RESUMABLE = 75
"""Exit status of a run that stopped before --train-iters with its last step saved (a signal
under --exit-signal-handler, or --exit-duration-in-mins): sysexits.h's EX_TEMPFAIL, "a temporary
failure, retry later". It differs from success (0), from an error (1) and from a death by signal
(128 + n), so that a job script requeues exactly the runs that can resume."""

STOPPED_EARLY = "stopped_early"
"""File in --save that says the run stopped early and resumes when started again (JSON: step,
reason); the next start of the run removes it first thing, before it checks its flags
(train.main), so that a start that fails leaves none. It tells a launcher that only sees
torchrun's own status (non-zero whenever a worker's is) to requeue."""


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


def write_stopped_marker(save: str, step: int, reason: str) -> None:
    """Write <save>/STOPPED_EARLY (JSON: step, reason) from global rank 0."""
    if dist_rank() == 0:
        with open(os.path.join(save, STOPPED_EARLY), "w") as f:
            json.dump({"step": step, "reason": reason}, f)


def save_dir_of(argv: list[str]) -> str:
    """The --save directory the trainer's command line `argv` names, read before (and without)
    checking the rest of it: the last `--save DIR` / `--save=DIR`, else the `save` key of the
    --config file, else the default. A --config file that cannot be read counts as naming
    none (the full parse reports it)."""
    import yaml

    from megatron_rl.config import CheckpointConfig

    found: dict[str, str] = {}
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        for flag in ("--save", "--config"):
            if arg == flag and i + 1 < len(argv):
                found[flag] = argv[i + 1]
            elif arg.startswith(flag + "="):
                found[flag] = arg[len(flag) + 1:]
    save = found.get("--save")
    if save is None and "--config" in found:
        try:
            with open(found["--config"]) as f:
                loaded = yaml.safe_load(f)
            if isinstance(loaded, dict) and isinstance(loaded.get("save"), str):
                save = loaded["save"]
        except (OSError, ValueError, yaml.YAMLError):
            pass
    return os.path.abspath(save if save is not None else CheckpointConfig().save)


def remove_stopped_marker(save: str) -> None:
    """Remove <save>/STOPPED_EARLY (every rank may: the first one does)."""
    try:
        os.remove(os.path.join(save, STOPPED_EARLY))
    except FileNotFoundError:
        pass
