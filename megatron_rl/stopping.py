"""Stopping a run before --train-iters, resumably: a SIGTERM/SIGINT (--exit-signal-handler) or
the wall-clock budget (--exit-duration-in-mins) asks for a stop at the next step boundary
(StopRequests); the loop saves that step, marks the run directory (STOPPED_EARLY) and raises
StoppedEarly, which the entry point turns into the exit status EXIT_RESUMABLE.

Under torchrun the stop has a deadline the worker does not set: torchrun's agent forwards the
signal and kills its workers with SIGKILL a fixed time later (torchrun_shutdown_limit).
StopRequests warns at startup where that limit is torchrun's default or cannot be set, and once
a step is measured to take longer than it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
import time
import warnings

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


TORCHRUN_SHUTDOWN_DEFAULT_S = 30
"""Seconds torchrun's agent waits for its workers after forwarding a signal before it kills
them, unless `--shutdown-timeout` or TORCH_ELASTIC_SHUTDOWN_TIMEOUT says otherwise (torch
versions whose torchrun has no --shutdown-timeout always wait this long)."""

SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
_SHUTDOWN_FLAGS = ("--shutdown-timeout", "--shutdown_timeout")
_SHUTDOWN_FLAG_ENV = "PET_SHUTDOWN_TIMEOUT"  # torchrun reads each flag's default from PET_<NAME>


@dataclasses.dataclass(frozen=True)
class ShutdownLimit:
    """How long torchrun's agent lets this worker run after it forwards a stop signal, before
    SIGKILL: `seconds`, and `source`, where that comes from (a flag, a variable, or "torchrun's
    default"). `ignored`: a setting that this torch's torchrun does not read (it has no
    --shutdown-timeout; the limit is the default then)."""

    seconds: float
    source: str
    ignored: str | None = None

    @property
    def is_default(self) -> bool:
        return self.source == "torchrun's default"


def _torchrun_takes_shutdown_timeout() -> bool:
    """Whether the installed torch's torchrun has --shutdown-timeout (and reads
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT): its LaunchConfig has the field. The agent runs the torch
    of the environment its workers run in, so the worker's torch answers for it."""
    try:
        from torch.distributed.launcher.api import LaunchConfig
    except ImportError:
        return False
    return "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}


def _parent_command_line() -> list[str]:
    """The command line of this process's parent (under torchrun: the agent); [] where it
    cannot be read (not Linux, or the parent is gone)."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _shutdown_flag(cmdline: list[str]) -> str | None:
    """The value of torchrun's --shutdown-timeout in a torchrun command line (None: not given,
    or not a torchrun command line). The trainer has no flag of that name, so its own flags at
    the end of the line are never taken for it."""
    if not any(a.endswith("torchrun") or a in ("torch.distributed.run", "torch.distributed.launch")
               for a in cmdline[:3]):
        return None
    for i, arg in enumerate(cmdline):
        for flag in _SHUTDOWN_FLAGS:
            if arg == flag and i + 1 < len(cmdline):
                return cmdline[i + 1]
            if arg.startswith(flag + "="):
                return arg[len(flag) + 1:]
    return None


def torchrun_shutdown_limit(environ=None, parent_cmdline: list[str] | None = None,
                            configurable: bool | None = None) -> ShutdownLimit | None:
    """The time torchrun gives this worker to stop after it forwards a SIGTERM or SIGINT (from
    SLURM, Kubernetes, a Ctrl-C), after which it SIGKILLs it; None when this process was not
    started by torchrun.

    The limit is the agent's setting, which a worker cannot change, only read: torchrun sets
    TORCHELASTIC_RUN_ID (and the other TORCHELASTIC_* variables) in each worker's environment,
    and a worker inherits the agent's environment, so TORCH_ELASTIC_SHUTDOWN_TIMEOUT and
    PET_SHUTDOWN_TIMEOUT (the flag's variable) are visible here; the flag itself is read from
    the agent's command line (the parent process). Precedence, as torchrun's: the flag, then
    PET_SHUTDOWN_TIMEOUT, then TORCH_ELASTIC_SHUTDOWN_TIMEOUT, then 30 s; a torch whose torchrun
    has no --shutdown-timeout always waits 30 s. `environ`, `parent_cmdline`, `configurable`:
    for tests (default: this process's)."""
    environ = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" not in environ:
        return None
    if configurable is None:
        configurable = _torchrun_takes_shutdown_timeout()
    cmdline = _parent_command_line() if parent_cmdline is None else parent_cmdline
    settings = [("torchrun --shutdown-timeout", _shutdown_flag(cmdline)),
                (_SHUTDOWN_FLAG_ENV, environ.get(_SHUTDOWN_FLAG_ENV)),
                (SHUTDOWN_TIMEOUT_ENV, environ.get(SHUTDOWN_TIMEOUT_ENV))]
    for source, value in settings:
        if value is None or value == "":
            continue
        if not configurable:
            return ShutdownLimit(TORCHRUN_SHUTDOWN_DEFAULT_S, "torchrun's default",
                                 ignored=f"{source}={value}")
        try:
            return ShutdownLimit(float(value), f"{source}={value}")
        except ValueError:
            continue  # torchrun itself refuses a value that is not a number
    return ShutdownLimit(TORCHRUN_SHUTDOWN_DEFAULT_S, "torchrun's default")


def shutdown_limit_warning(limit: ShutdownLimit, longest_step_s: float | None = None) -> str | None:
    """What to warn about `limit` (None: nothing). Without a measurement (`longest_step_s`
    None: at startup): a limit that is torchrun's default or that ignores its setting, since a
    step and a save then have 30 s. With one: a step (from one step boundary to the next, with
    the periodic save made there if any) that took longer than the limit, so that a stop
    signalled during such a step is killed before it saves."""
    how = (f"set {SHUTDOWN_TIMEOUT_ENV} (or torchrun --shutdown-timeout) in seconds above a "
           "step plus a save, and the scheduler's grace period above that (SLURM's "
           "--signal=TERM@<s>, Kubernetes' terminationGracePeriodSeconds; docs/launch.md, "
           "\"Stopping on a signal\")")
    killed = ("torchrun kills this rank {s:g} s after it forwards a SIGTERM or SIGINT ({src}), "
              "with no checkpoint saved and no <save>/stopped_early written if the step in "
              "flight and its save take longer").format(s=limit.seconds, src=limit.source)
    if longest_step_s is None:
        if limit.ignored:
            import torch

            return (f"{limit.ignored} is ignored: the torchrun of torch {torch.__version__} has "
                    f"no --shutdown-timeout and waits {TORCHRUN_SHUTDOWN_DEFAULT_S} s; "
                    f"{killed}. Use a torch whose torchrun has --shutdown-timeout, or stop with "
                    "--exit-duration-in-mins, a budget the trainer keeps itself")
        if limit.is_default:
            return f"{killed}; {how}"
        return None
    if longest_step_s > limit.seconds:
        return (f"a step took {longest_step_s:.0f} s (between two step boundaries, with the "
                f"periodic save made at the first, if any), more than the {limit.seconds:g} s "
                f"torchrun lets this rank run after it forwards a SIGTERM or SIGINT "
                f"({limit.source}): a stop signalled during such a step would be killed before "
                f"the step and its save finish, saving nothing; {how}")
    return None


class StopRequests:
    """When to stop before --train-iters: a SIGTERM/SIGINT received (--exit-signal-handler) or
    the wall-clock budget spent (--exit-duration-in-mins, counted from `started`, a
    time.monotonic()). The handlers only record the signal; `reason()` is asked at each step
    boundary and agrees across all ranks (an all-reduce of the flags), so that they save and
    stop at the same step. A context manager: the previous handlers come back on exit.

    With the handlers on, under torchrun, it also checks torchrun's shutdown limit
    (torchrun_shutdown_limit) on the first local rank of each node: at entry, and against the
    longest time between two step boundaries (`reason()` calls) once measured; each warning
    once."""

    REPEAT_SIGINT_S = 2.0  # a second Ctrl-C later than this stops at once (torchrun forwards
    #                        the terminal's SIGINT to its workers: the copy arrives within it)

    def __init__(self, handle_signals: bool, budget_mins: float, started: float):
        self.handle_signals, self.budget_s, self.started = handle_signals, budget_mins * 60, started
        self.received: int | None = None
        self._at = 0.0
        self._previous: dict[int, object] = {}
        self.shutdown_limit: ShutdownLimit | None = None
        self.longest_step_s = 0.0
        self._boundary: float | None = None
        self._warned_step = False

    def __enter__(self) -> "StopRequests":
        if self.handle_signals and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._on_signal)
        if self.handle_signals and os.environ.get("LOCAL_RANK", "0") == "0":
            self.shutdown_limit = torchrun_shutdown_limit()
            if self.shutdown_limit is not None:
                message = shutdown_limit_warning(self.shutdown_limit)
                if message:
                    warnings.warn(message, stacklevel=2)
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
        self._time_step()
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

    def _time_step(self) -> None:
        """The time since the previous step boundary, against torchrun's shutdown limit."""
        now = time.monotonic()
        if self._boundary is not None:
            self.longest_step_s = max(self.longest_step_s, now - self._boundary)
        self._boundary = now
        if self.shutdown_limit is not None and not self._warned_step:
            message = shutdown_limit_warning(self.shutdown_limit, self.longest_step_s)
            if message:
                warnings.warn(message, stacklevel=3)
                self._warned_step = True


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
            with open(found["--config"], encoding="utf-8-sig") as f:
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
