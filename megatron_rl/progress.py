"""Progress display that suits where the output goes.

`progress(iterable, desc, ...)` wraps an iterable. On a terminal it is a tqdm bar. When the stream
is a file or a pipe (CI logs, `nohup`, a batch job's output file), a redrawn bar would write
carriage-return clutter or nothing useful, so it prints one plain line every `every` steps or
every `interval` seconds, whichever comes first (checked as each step completes), and a final
line when the iteration ends or the display is closed:

    RL: 40/500 (8%) elapsed 12:00, eta 2:18:00, 18.00 s/it | reward=0.41, kl_k1=0.002
    RL: 500/500 (100%) done in 2:30:00, 18.00 s/it | reward=0.63, kl_k1=0.004

Both forms show the same numbers: steps done out of the total, the rate (steps per second, or
seconds per step below one), and the postfix given with `set_postfix`.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterable, Iterator
from typing import IO, Any

_clock = time.monotonic  # seconds; a module attribute so that tests can drive the time


def progress(iterable: Iterable, desc: str = "", total: int | None = None, initial: int = 0,
             disable: bool = False, unit: str = "it", *, every: int | None = None,
             interval: float = 30.0, file: IO[str] | None = None) -> "Progress":
    """`iterable`, shown as progress on `file` (default: sys.stderr).

    total: the step count at the end (default: len(iterable) where it has one); initial: steps
    already done (a resumed run); disable: show nothing. On a non-terminal stream: a line every
    `every` steps (default: a twentieth of the total, at least 1; 100 without a total) or every
    `interval` seconds, whichever comes first, and a final line.
    """
    return Progress(iterable, desc=desc, total=total, initial=initial, disable=disable,
                    unit=unit, every=every, interval=interval, file=file)


def _is_tty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


def format_interval(seconds: float) -> str:
    """M:SS below an hour, else H:MM:SS (tqdm's format)."""
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h:d}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def format_rate(rate: float | None, unit: str) -> str:
    """`2.50 it/s`, or `12.30 s/it` below one step per second (as tqdm shows it)."""
    if rate is None:
        return f"? {unit}/s"
    if rate >= 1 or rate == 0:
        return f"{rate:.2f} {unit}/s"
    return f"{1 / rate:.2f} s/{unit}"


def format_postfix(postfix: dict) -> str:
    """`key=value, ...`: floats to 3 significant digits, anything else as str()."""
    return ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in postfix.items())


class Progress:
    """The iterator `progress` returns: iterate it, `set_postfix({...})` to show values beside
    the count, `update(n)` to count steps by hand, `close()` to end early (the final line)."""

    def __init__(self, iterable: Iterable, desc: str = "", total: int | None = None,
                 initial: int = 0, disable: bool = False, unit: str = "it", *,
                 every: int | None = None, interval: float = 30.0,
                 file: IO[str] | None = None):
        self.iterable = iterable
        self.desc, self.unit, self.disable = desc, unit, disable
        if total is None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.total = total
        self.initial = self.n = initial
        self.file = file if file is not None else sys.stderr
        self.tty = _is_tty(self.file)
        if every is None:
            every = max(1, math.ceil(total / 20)) if total else 100
        if every < 1 or interval <= 0:
            raise ValueError(f"progress: every {every} and interval {interval} must be positive")
        self.every, self.interval = every, interval
        self.postfix: dict = {}
        self.closed = False
        self._start = self._last_time = _clock()
        self._last_n = initial
        self._bar = None
        if self.tty:
            from tqdm import tqdm

            self._bar = tqdm(iterable, desc=desc, total=total, initial=initial, disable=disable,
                             unit=unit, dynamic_ncols=True, file=self.file)
            self._it: Iterator = iter(self._bar)
        else:
            self._it = self._count(iterable)

    # -- iteration -------------------------------------------------------------------------------
    def __iter__(self) -> "Progress":
        return self

    def __next__(self):
        return next(self._it)

    def _count(self, iterable: Iterable) -> Iterator:
        """Each item, then one step counted once the caller asks for the next; the final line
        when the items run out or the loop is left (the generator is closed)."""
        try:
            for item in iterable:
                yield item
                self.update(1)
        finally:
            self.close()

    # -- the display -----------------------------------------------------------------------------
    def set_postfix(self, postfix: dict | None = None, **kwargs) -> None:
        """Values shown after the count (tqdm's set_postfix): floats to 3 significant digits."""
        merged = {**(postfix or {}), **kwargs}
        if self._bar is not None:
            self._bar.set_postfix(merged)
        else:
            self.postfix = merged

    def update(self, n: int = 1) -> None:
        """Count `n` more steps; on a non-terminal stream, print a line when `every` steps or
        `interval` seconds have passed since the last one."""
        if self._bar is not None:
            self._bar.update(n)
            return
        self.n += n
        if self.disable:
            return
        now = _clock()
        if self.n - self._last_n >= self.every or now - self._last_time >= self.interval:
            self._write(self.line(now))
            self._last_n, self._last_time = self.n, now

    def close(self) -> None:
        """End the display: the bar closes; on a non-terminal stream the final line."""
        if self.closed:
            return
        self.closed = True
        if self._bar is not None:
            self._bar.close()
        elif not self.disable:
            self._write(self.line(_clock(), final=True))

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def line(self, now: float, final: bool = False) -> str:
        """The plain line at time `now` (on the clock of `_clock`)."""
        elapsed = now - self._start
        done = self.n - self.initial
        rate = done / elapsed if elapsed > 0 else None
        count = f"{self.n}/{self.total} ({100 * self.n / self.total:.0f}%)" if self.total \
            else f"{self.n}"
        parts = [f"{self.desc}: {count}" if self.desc else count]
        if final:
            ended = "done" if self.total is None or self.n >= self.total else "stopped"
            parts.append(f"{ended} in {format_interval(elapsed)},")
        else:
            parts.append(f"elapsed {format_interval(elapsed)},")
            if self.total and rate:
                parts.append(f"eta {format_interval((self.total - self.n) / rate)},")
        parts.append(format_rate(rate, self.unit))
        text = " ".join(parts)
        if self.postfix:
            text += " | " + format_postfix(self.postfix)
        return text

    def _write(self, text: str) -> None:
        self.file.write(text + "\n")
        self.file.flush()
