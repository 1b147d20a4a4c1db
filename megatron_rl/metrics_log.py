"""Where a run's metrics go: TensorBoard scalars, one JSON line per step in
<save>/metrics.jsonl, and the progress display. Written by one rank, the last (the last
pipeline stage, which holds the loss metrics); every other rank's logger does nothing."""

from __future__ import annotations

import json
import os
from typing import Iterable, Iterator

import torch

from megatron_rl.progress import progress

# the metrics the progress display shows, by their last path component
PROGRESS_KEYS = ("reward/mean", "kl_k1", "eval/mean_at_k")


class MetricsLogger:
    """TensorBoard + metrics.jsonl under `save_dir`, when `enabled` (this rank logs)."""

    def __init__(self, save_dir: str, enabled: bool):
        self.save_dir, self.enabled = save_dir, enabled
        self.path = os.path.join(save_dir, "metrics.jsonl")
        self.writer = None
        self._bar = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(os.path.join(save_dir, "tensorboard"))

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
        """After a resume, drop logged steps beyond `step` (they will be redone)."""
        if not self.enabled or not os.path.exists(self.path):
            return
        with open(self.path) as f:
            rows = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(rows)
        os.replace(tmp, self.path)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _is_number(v) -> bool:
    if isinstance(v, torch.Tensor):
        return v.numel() == 1
    return isinstance(v, (int, float)) and not isinstance(v, bool)
