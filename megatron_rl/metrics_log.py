"""Where a run's metrics go: TensorBoard scalars, one JSON line per step in
<save>/metrics.jsonl, Weights & Biases (with --wandb-project) and the progress display. Written
by one rank, the last (the last pipeline stage, which holds the loss metrics); every other
rank's logger does nothing.

A log is a record of the run, not part of it: a write that fails mid-run (metrics.jsonl made
unwritable, the TensorBoard directory removed by a cleanup, W&B's service gone, a full disk) is
reported once, with the path and the error, and retried at every later step with the rows it
missed, while training and its checkpoints go on. A start refuses a metrics.jsonl it cannot
read or append to, naming it, before any model is built (`check_log_files`): nothing is lost
then, and a run that started would otherwise log a gap the user notices only later."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import importlib.util
import json
import os
import sys
import warnings
from dataclasses import field
from typing import Any, Callable, Iterable, Iterator

import torch

from megatron_rl.progress import progress

# the metrics the progress display shows, by their last path component
PROGRESS_KEYS = ("reward/mean", "kl_k1", "eval/mean_at_k")

# the file under --save that keeps the id of the run's W&B run, continued by each later start
WANDB_RUN_ID = os.path.join("wandb", "run_id")
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
# the most rows a failing log keeps for its retries (each a few kB): older ones are dropped
MAX_UNWRITTEN_ROWS = 10_000


@dataclasses.dataclass
class LoggingConfig:
    """Weights & Biases logging, with Megatron's flags: on when --wandb-project is given; and
    the trajectories written for reading (--save-rollouts: rollout/trajectory_log.py)."""

    wandb_project: str | None = field(default=None, metadata={"help": (
        "also log each step's metrics and the run's configuration to this Weights & Biases "
        "project (needs the wandb package: pip install wandb). A run resumed from --save "
        "continues the same W&B run. W&B's environment applies: WANDB_MODE=offline writes "
        "the run under --wandb-save-dir only, for `wandb sync` later")})
    wandb_exp_name: str | None = field(default=None, metadata={"help": (
        "display name of the W&B run (unset: W&B picks one); needs --wandb-project")})
    wandb_save_dir: str | None = field(default=None, metadata={"help": (
        "directory of W&B's local files: the run's logs, and the whole run under "
        "WANDB_MODE=offline (unset: <save>/wandb); needs --wandb-project")})
    wandb_entity: str | None = field(default=None, metadata={"help": (
        "W&B user or team that owns --wandb-project (unset: the logged-in user's default "
        "entity); needs --wandb-project")})
    save_rollouts: int = field(default=0, metadata={"min": 0, "help": (
        "write the trajectories of every this many steps' batches, and of every evaluation, "
        "as JSONL under <save>/rollouts (step_000010.jsonl, eval_step_000010.jsonl: token ids, "
        "the text of each policy and environment segment, the engine's log-probs, reward, end "
        "reason, environment info), for reading with `megatron-rl rollouts` (0: none)")})

    def validate(self) -> None:
        """Raise ValueError for a W&B setting without --wandb-project, or --wandb-project
        where the wandb package is not installed (found at startup, before any model is
        built; it is imported only when the logger starts)."""
        if not self.wandb_project:
            for name in ("wandb_exp_name", "wandb_save_dir", "wandb_entity"):
                value = getattr(self, name)
                if value:
                    raise ValueError(f"--{name.replace('_', '-')} {value!r} needs "
                                     "--wandb-project (W&B logging is on only with a project)")
            return
        if importlib.util.find_spec("wandb") is None:
            raise ValueError(_missing_wandb(self.wandb_project))


def _missing_wandb(project: str) -> str:
    return (f"--wandb-project {project!r} logs to Weights & Biases, but the wandb package is "
            "not installed: pip install wandb")


class MetricsLogger:
    """TensorBoard + metrics.jsonl under `save_dir`, and W&B where `wandb_cfg` names a project,
    when `enabled` (this rank logs). `config` (the run's flat settings, to_flat_dict) becomes
    the W&B run's config.

    A run that starts at `start_step` (0, or the step of the checkpoint it resumes) logs steps
    start_step + 1 onwards, so whatever an earlier attempt logged beyond `start_step` (a kill
    after some steps but before their checkpoint) is dropped here: metrics.jsonl is cut back to
    its rows with step <= start_step, and TensorBoard hides the earlier events at steps >
    start_step (SummaryWriter's purge_step). Each step is then logged exactly once however often
    the run was killed and resumed.

    W&B: the first start creates a W&B run and keeps its id in <save>/wandb/run_id; every later
    start with that --save continues the same run, logging each step as W&B's `step`. A resumed
    W&B run ignores a step at or below the last one it holds (W&B's steps only increase), which
    would keep the killed attempt's values for the steps redone after a resume. So a start that
    finds steps beyond `start_step` in metrics.jsonl (written just before W&B, so W&B holds no
    step that metrics.jsonl lacks) rewinds the run: `wandb.init(resume_from="<id>?_step=
    <start_step>")` truncates its history after start_step and the redone steps replace it, as
    in metrics.jsonl and TensorBoard. A start with nothing to redo (a resume from a clean stop)
    continues the run with `resume="allow"`. Rewind is a W&B server feature not offered
    everywhere (a preview on W&B's cloud, absent from self-managed servers): where the server
    refuses it, the run continues with `resume="allow"` and a warning says that W&B keeps the
    earlier values of the redone steps.
    Under WANDB_MODE=offline W&B resumes nothing itself (it says so): each start writes its own
    <wandb-save-dir>/wandb/offline-run-*-<id> directory under the same run id, whose
    transaction log (run-<id>.wandb, what `wandb sync` uploads) holds that start's steps and,
    for a rewinding start, the rewind in its run record (branch point: the run's id, `_step` =
    start_step). Applied in the order the starts ran, these give each step once, with the
    values of the last start that logged it; joining several offline directories into one run
    is then `wandb sync`'s part, which W&B supports only in part for resumed runs.
    Closing marks the W&B run failed (exit code 1) when an exception is in flight (a failure, or
    a stop before --train-iters), finished otherwise.

    A log that fails (metrics.jsonl, TensorBoard, W&B; at the start too, for TensorBoard and
    W&B's logging) never stops the run: the first failure of each is reported by one warning
    naming its path and the error, the rows it missed are kept (the newest MAX_UNWRITTEN_ROWS)
    and written with the next step's when a write succeeds again (TensorBoard into a new event
    file, its directory made again), so a log repaired mid-run holds every step. Closing warns
    of the steps a log still lacks."""

    def __init__(self, save_dir: str, enabled: bool, start_step: int = 0,
                 wandb_cfg: LoggingConfig | None = None, config: dict[str, Any] | None = None):
        self.save_dir, self.enabled = save_dir, enabled
        self.path = os.path.join(save_dir, METRICS_FILE)
        self.tensorboard_dir = os.path.join(save_dir, TENSORBOARD_DIR)
        self.writer = None
        self.wandb_run = None
        self._bar = None
        # TensorBoard's first event file hides an earlier attempt's events past start_step
        self._purge_step: int | None = start_step + 1
        # per log: the rows it missed, and its first error (reported once)
        self._unwritten: dict[str, list[tuple[int, dict]]] = {}
        self._failed: dict[str, str] = {}
        if enabled:
            redone = self.truncate(start_step)
            self._write("tensorboard", self.tensorboard_dir, [], self._write_tensorboard)
            if wandb_cfg is not None and wandb_cfg.wandb_project:
                self.wandb_run = _start_wandb(wandb_cfg, save_dir, start_step,
                                              rewind=redone > 0, config=config)

    def log(self, step: int, metrics: dict) -> None:
        """The scalar entries of `metrics` (numbers and one-element tensors) at `step`."""
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items() if _is_number(v)}
        row = [(step, clean)]
        self._write("metrics.jsonl", self.path, row, self._write_jsonl)
        self._write("tensorboard", self.tensorboard_dir, row, self._write_tensorboard)
        if self.wandb_run is not None:  # after metrics.jsonl: see the class docstring
            self._write("W&B", f"W&B run {self.wandb_run.id}", row, self._write_wandb)
        if self._bar is not None:
            self._bar.set_postfix({k.split("/")[-1]: f"{clean[k]:.3g}" for k in PROGRESS_KEYS
                                   if k in clean})

    def _write(self, name: str, where: str, rows: list[tuple[int, dict]],
               write: Callable[[list[tuple[int, dict]]], None]) -> None:
        """`rows`, after the ones log `name` missed, through `write` (which drops from the list
        the rows it wrote); a failure is reported once and the rows left are kept for the
        next attempt."""
        late = self._unwritten.get(name, [])
        pending = late + rows
        try:
            write(pending)
        except Exception as e:  # noqa: BLE001 -- whatever a log raises, training goes on
            if name not in self._failed:
                self._failed[name] = f"{type(e).__name__}: {e}"
                warnings.warn(f"{where}: writing the metrics failed ({type(e).__name__}: {e}); "
                              "training goes on, and this log is retried at every step with "
                              "the rows it missed (reported once)", stacklevel=3)
            self._unwritten[name] = pending[-MAX_UNWRITTEN_ROWS:]
            return
        if late:
            print(f"[megatron-rl] {where}: written again (steps {_steps(late)} late)",
                  file=sys.stderr, flush=True)
        self._unwritten[name] = []

    def _write_jsonl(self, rows: list[tuple[int, dict]]) -> None:
        """Append `rows` to metrics.jsonl, each flushed on its own, dropping it from `rows` once
        written. After a failed write the file may end in a torn line: it is ended first, so
        that the next start drops it (truncate) without losing the row after it."""
        with open(self.path, "a", encoding="utf-8") as f:
            if "metrics.jsonl" in self._failed and f.tell() > 0:
                with open(self.path, "rb") as tail:
                    tail.seek(-1, os.SEEK_END)
                    if tail.read(1) != b"\n":
                        f.write("\n")
            while rows:
                step, clean = rows[0]
                f.write(json.dumps({"step": step, **clean}) + "\n")
                f.flush()
                rows.pop(0)

    def _write_tensorboard(self, rows: list[tuple[int, dict]]) -> None:
        """`rows` as TensorBoard scalars; the writer made (again, after a failure) first."""
        if self.writer is not None and not os.path.isdir(self.tensorboard_dir):
            # removed since the last flush: the writer holds nothing to write, so it closes
            # quietly (its thread fails, with a traceback, on a write into the removed file)
            writer, self.writer = self.writer, None
            with contextlib.suppress(Exception):
                writer.close()
            raise FileNotFoundError(errno.ENOENT, "the directory was removed",
                                    self.tensorboard_dir)
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            os.makedirs(self.tensorboard_dir, exist_ok=True)
            self.writer = SummaryWriter(self.tensorboard_dir, purge_step=self._purge_step)
            self._purge_step = None
        try:
            for step, clean in rows:
                for k, v in clean.items():
                    self.writer.add_scalar(k, v, step)
            self.writer.flush()
        except Exception:
            writer, self.writer = self.writer, None
            with contextlib.suppress(Exception):  # its writer thread has failed: so does close
                writer.close()
            raise
        rows.clear()

    def _write_wandb(self, rows: list[tuple[int, dict]]) -> None:
        assert self.wandb_run is not None
        while rows:
            step, clean = rows[0]
            self.wandb_run.log(clean, step=step, commit=True)
            rows.pop(0)

    def progress(self, steps: Iterable[int], total: int, initial: int) -> Iterator[int]:
        """`steps`, shown as progress on the logging rank (a bar on a terminal, a line now and
        then on a file or pipe: megatron_rl.progress)."""
        self._bar = progress(steps, desc="RL", initial=initial, total=total,
                             disable=not self.enabled, unit="step")
        return iter(self._bar)

    def truncate(self, step: int) -> int:
        """Drop the rows of metrics.jsonl beyond `step` (they will be redone), and any line that
        is not a complete JSON row: the last one, torn by a kill or a full disk mid-write (with
        a warning naming the file and line). Rewritten through a temporary file and a rename,
        so a kill here leaves the old file or the new one. Returns the number of complete rows
        dropped (beyond `step`). A file that cannot be read or rewritten is refused
        (ValueError naming it: rows appended after the steps to redo would log them twice)."""
        if not self.enabled or not os.path.exists(self.path):
            return 0
        rows, dropped, torn = [], 0, []
        try:
            with open(self.path, encoding="utf-8", errors="replace") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        row_step = json.loads(line)["step"]
                    except (ValueError, KeyError, TypeError):
                        torn.append(lineno)
                        continue
                    if row_step <= step:
                        rows.append(line if line.endswith("\n") else line + "\n")
                    else:
                        dropped += 1
        except OSError as e:
            raise ValueError(_unusable_log(self.path, e)) from e
        if torn:
            warnings.warn(f"{self.path}: dropping {len(torn)} incomplete line(s) (line "
                          f"{', '.join(map(str, torn))}), written when a run was killed or the "
                          f"disk was full", stacklevel=2)
        if not torn and not dropped:
            return 0
        tmp = self.path + ".tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(rows)
            os.replace(tmp, self.path)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise ValueError(_unusable_log(self.path, e)) from e
        return dropped

    def close(self) -> None:
        """Close the logs; a warning names each one that still lacks steps."""
        if self.writer is not None:
            try:
                self.writer.close()
            except Exception as e:  # noqa: BLE001
                self._failed.setdefault("tensorboard", f"{type(e).__name__}: {e}")
                warnings.warn(f"{self.tensorboard_dir}: closing the TensorBoard log failed "
                              f"({type(e).__name__}: {e})", stacklevel=2)
            self.writer = None
        for name, rows in self._unwritten.items():
            if rows:
                warnings.warn(f"{name}: steps {_steps(rows)} of this run were not written "
                              f"({self._failed[name]})", stacklevel=2)
        if self.wandb_run is not None:
            try:
                self.wandb_run.finish(exit_code=0 if sys.exc_info()[1] is None else 1)
            except Exception as e:  # noqa: BLE001
                warnings.warn(f"W&B run {self.wandb_run.id}: finishing it failed "
                              f"({type(e).__name__}: {e})", stacklevel=2)
            self.wandb_run = None


def _steps(rows: list[tuple[int, dict]]) -> str:
    """The steps of `rows` as "a-b" (or "a")."""
    first, last = rows[0][0], rows[-1][0]
    return str(first) if first == last else f"{first}-{last}"


def _unusable_log(path: str, error: OSError) -> str:
    return (f"{path} cannot be read and appended to ({type(error).__name__}: {error}): it "
            "holds the run's metrics, one row per step. Make it a writable file again (or "
            "move it aside: the run then starts a new one) and start the run again")


def check_log_files(save_dir: str) -> None:
    """Raise ValueError naming the path when the logs under `save_dir` cannot be used: a
    metrics.jsonl that cannot be read and appended to (a directory in its place, its
    permissions), a TensorBoard path that is not a directory. Checked at the start, before any
    model is built; touches nothing (an existing file is opened, not written)."""
    path = os.path.join(save_dir, METRICS_FILE)
    if os.path.lexists(path):
        try:
            with open(path, "rb") as f:
                f.read(1)
            with open(path, "ab"):
                pass
        except OSError as e:
            raise ValueError(_unusable_log(path, e)) from e
    tensorboard = os.path.join(save_dir, TENSORBOARD_DIR)
    if os.path.lexists(tensorboard) and not os.path.isdir(tensorboard):
        raise ValueError(f"{tensorboard} is not a directory: it holds the run's TensorBoard "
                         "logs. Move it aside and start the run again")


def _start_wandb(cfg: LoggingConfig, save: str, start_step: int, rewind: bool,
                 config: dict[str, Any] | None) -> Any:
    """The W&B run of the run in `save`, started or continued (MetricsLogger's docstring):
    rewound to `start_step` where `rewind`."""
    try:
        import wandb
    except ImportError as e:
        raise ImportError(_missing_wandb(cfg.wandb_project or "")) from e
    wandb_dir = cfg.wandb_save_dir or os.path.join(save, "wandb")
    os.makedirs(wandb_dir, exist_ok=True)
    id_path = os.path.join(save, WANDB_RUN_ID)
    kwargs = dict(project=cfg.wandb_project, entity=cfg.wandb_entity, name=cfg.wandb_exp_name,
                  dir=wandb_dir, config=config)
    run_id = None
    if os.path.exists(id_path):
        with open(id_path) as f:
            run_id = f.read().strip() or None
    if run_id is None:
        run = wandb.init(**kwargs)
        os.makedirs(os.path.dirname(id_path), exist_ok=True)
        with open(id_path + ".tmp", "w") as f:
            f.write(run.id + "\n")
        os.replace(id_path + ".tmp", id_path)
        return run
    if rewind:
        try:
            return wandb.init(resume_from=f"{run_id}?_step={start_step}", **kwargs)
        except wandb.Error as e:
            warnings.warn(f"W&B run {run_id}: rewinding it to step {start_step} failed ({e}); "
                          f"continuing it instead: W&B keeps the values it holds for the steps "
                          f"after {start_step} that this start redoes (metrics.jsonl and "
                          "TensorBoard hold the redone ones)")
    return wandb.init(id=run_id, resume="allow", **kwargs)


def _is_number(v) -> bool:
    if isinstance(v, torch.Tensor):
        return v.numel() == 1
    return isinstance(v, (int, float)) and not isinstance(v, bool)
