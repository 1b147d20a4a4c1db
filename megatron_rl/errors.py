"""Mistakes in what a user gave a command, and how the commands report them.

A UserError is something the user fixes: a setting (ConfigError: a flag, a key of a --config
file), a data file (data.records.DataFormatError: the file, line and field), a destination a
command refuses (convert's --save). The functions raise it like any ValueError; where a command
becomes a process (`megatron-rl <command>`, `python -m megatron_rl.train`,
tools/convert_checkpoint.py) run_command prints its message as `<command>: error: <message>` and
exits with EXIT_USAGE, the status argparse gives a flag it refuses, without a traceback: the
message names what to fix, and a traceback above it would bury it. Every other exception is a
bug or a failure of the machine and keeps its traceback.
"""

from __future__ import annotations

import sys
from typing import Callable

EXIT_USAGE = 2
"""Exit status of a command refused for what it was given (argparse's for a bad flag)."""

class UserError(ValueError):
    """A mistake in a command's input, its message naming the flag, key, file or line to fix.
    A ValueError, so that callers catching the checks' ValueError catch it too."""


class ConfigError(UserError):
    """A setting refused: out of range, not finite, inconsistent with another, or a --config
    file that cannot be read."""


def run_command(command: str, main: Callable[[list[str]], object], argv: list[str]) -> int:
    """Run a command's `main(argv)` as a process does: its exit status (0 where main returns
    None), or EXIT_USAGE after printing `<command>: error: <message>` to stderr for a UserError
    (no traceback). A SystemExit from main (argparse's, a resumable stop's) passes through."""
    try:
        return int(main(argv) or 0)  # type: ignore[call-overload]
    except UserError as e:
        print(f"{command}: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
