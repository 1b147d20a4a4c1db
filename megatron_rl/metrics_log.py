"""Where a run's metrics go: TensorBoard scalars, one JSON line per step in
<save>/metrics.jsonl, and the progress display. Written by one rank, the last (the last
pipeline stage, which holds the loss metrics); every other rank's logger does nothing."""

from __future__ import annotations

import json
import os
import warnings
from typing import Iterable, Iterator

import torch

from megatron_rl.progress import progress

# the metrics the progress display shows, by their last path component
PROGRESS_KEYS = ("reward/mean", "kl_k1", "eval/mean_at_k")


class MetricsLogger:
    """TensorBoard + metrics.jsonl under `save_dir`, when `enabled` (this rank logs).

    A run that starts at `start_step` (0, or the step of the checkpoint it resumes) logs steps
    start_step + 1 onwards, so whatever an earlier attempt logged beyond `start_step` (a kill
    after some steps but before their checkpoint) is dropped here: metrics.jsonl is cut back to
    its rows with step <= start_step, and TensorBoard hides the earlier events at steps >
    start_step (SummaryWriter's purge_step). Each step is then logged exactly once however often
    the run was killed and resumed."""

    def __init__(self, save_dir: str, enabled: bool, start_step: int = 0):
        self.save_dir, self.enabled = save_dir, enabled
        self.path = os.path.join(save_dir, "metrics.jsonl")
        self.writer = None
        self._bar = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.truncate(start_step)
            self.writer = SummaryWriter(os.path.join(save_dir, "tensorboard"),
                                        purge_step=start_step + 1)

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
        if self._bar is not None:
            self._bar.set_postfix({k.split("/")[-1]: f"{clean[k]:.3g}" for k in PROGRESS_KEYS
                                   if k in clean})

    def progress(self, steps: Iterable[int], total: int, initial: int) -> Iterator[int]:
        """`steps`, shown as progress on the logging rank (a bar on a terminal, a line now and
        then on a file or pipe: megatron_rl.progress)."""
        self._bar = progress(steps, desc="RL", initial=initial, total=total,
                             disable=not self.enabled, unit="step")
        return iter(self._bar)

    def truncate(self, step: int) -> None:
        """Drop the rows of metrics.jsonl beyond `step` (they will be redone), and any line that
        is not a complete JSON row: the last one, torn by a kill or a full disk mid-write (with
        a warning naming the file and line). Rewritten through a temporary file and a rename,
        so a kill here leaves the old file or the new one."""
        if not self.enabled or not os.path.exists(self.path):
            return
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
            return
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(rows)
        os.replace(tmp, self.path)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _is_number(v) -> bool:
    if isinstance(v, torch.Tensor):
        return v.numel() == 1
    return isinstance(v, (int, float)) and not isinstance(v, bool)
