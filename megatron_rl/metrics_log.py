"""Where a run's metrics go: TensorBoard scalars, one JSON line per step in
<save>/metrics.jsonl, Weights & Biases (with --wandb-project) and the progress display. Written
by one rank, the last (the last pipeline stage, which holds the loss metrics); every other
rank's logger does nothing."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys
import warnings
from dataclasses import field
from typing import Any, Iterable, Iterator

import torch

from megatron_rl.progress import progress

# the metrics the progress display shows, by their last path component
PROGRESS_KEYS = ("reward/mean", "kl_k1", "eval/mean_at_k")

# the file under --save that keeps the id of the run's W&B run, continued by each later start
WANDB_RUN_ID = os.path.join("wandb", "run_id")


@dataclasses.dataclass
class LoggingConfig:
    """Weights & Biases logging, with Megatron's flags: on when --wandb-project is given."""

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
    a stop before --train-iters), finished otherwise."""

    def __init__(self, save_dir: str, enabled: bool, start_step: int = 0,
                 wandb_cfg: LoggingConfig | None = None, config: dict[str, Any] | None = None):
        self.save_dir, self.enabled = save_dir, enabled
        self.path = os.path.join(save_dir, "metrics.jsonl")
        self.writer = None
        self.wandb_run = None
        self._bar = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            redone = self.truncate(start_step)
            self.writer = SummaryWriter(os.path.join(save_dir, "tensorboard"),
                                        purge_step=start_step + 1)
            if wandb_cfg is not None and wandb_cfg.wandb_project:
                self.wandb_run = _start_wandb(wandb_cfg, save_dir, start_step,
                                              rewind=redone > 0, config=config)

    def log(self, step: int, metrics: dict) -> None:
        """The scalar entries of `metrics` (numbers and one-element tensors) at `step`."""
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items() if _is_number(v)}
        if self.writer is not None:
            for k, v in clean.items():
                self.writer.add_scalar(k, v, step)
            self.writer.flush()
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **clean}) + "\n")
        if self.wandb_run is not None:  # after metrics.jsonl: see the class docstring
            self.wandb_run.log(clean, step=step, commit=True)
        if self._bar is not None:
            self._bar.set_postfix({k.split("/")[-1]: f"{clean[k]:.3g}" for k in PROGRESS_KEYS
                                   if k in clean})

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
        dropped (beyond `step`)."""
        if not self.enabled or not os.path.exists(self.path):
            return 0
        rows, dropped, torn = [], 0, []
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
        if torn:
            warnings.warn(f"{self.path}: dropping {len(torn)} incomplete line(s) (line "
                          f"{', '.join(map(str, torn))}), written when a run was killed or the "
                          f"disk was full", stacklevel=2)
        if not torn and not dropped:
            return 0
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(rows)
        os.replace(tmp, self.path)
        return dropped

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb_run is not None:
            self.wandb_run.finish(exit_code=0 if sys.exc_info()[1] is None else 1)
            self.wandb_run = None


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
