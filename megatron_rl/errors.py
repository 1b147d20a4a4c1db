"""Mistakes in what a user gave a command, and how the commands report them.

A UserError is something the user fixes: a setting (ConfigError: a flag, a key of a --config
file), a data file (data.records.DataFormatError: the file, line and field), a destination a
command refuses (convert's --save). The functions raise it like any ValueError; where a command
becomes a process (`megatron-rl <command>`, `python -m megatron_rl.train`,
tools/convert_checkpoint.py) run_command prints its message as `<command>: error: <message>` and
exits with EXIT_USAGE, the status argparse gives a flag it refuses, without a traceback: the
message names what to fix, and a traceback above it would bury it.

A RunError is a run that cannot go on for a cause outside the program, found while it runs
(an --agent-environment that fails most of a step's episodes): run_command prints it the same
way and exits with EXIT_FAILURE. Its message names the cause (the environment, its error, the
record); the trainer's traceback would only show where the check is. Every other exception is
a bug or a failure of the machine and keeps its traceback.
"""

from __future__ import annotations

import os
import sys
from typing import Callable

EXIT_USAGE = 2
"""Exit status of a command refused for what it was given (argparse's for a bad flag)."""

EXIT_FAILURE = 1
"""Exit status of a command stopped by a RunError."""

EXIT_PIPE = 141
"""Exit status of a command whose output's reader went away (128 + SIGPIPE, as the shell
reports a tool that SIGPIPE killed)."""


class UserError(ValueError):
    """A mistake in a command's input, its message naming the flag, key, file or line to fix.
    A ValueError, so that callers catching the checks' ValueError catch it too."""


class ConfigError(UserError):
    """A setting refused: out of range, not finite, inconsistent with another, or a --config
    file that cannot be read."""


class RunError(RuntimeError):
    """A run that cannot go on, for a cause outside the program that its message names (the
    environment, the error it raised, the record it raised on): printed without a traceback."""


def run_command(command: str, main: Callable[[list[str]], object], argv: list[str]) -> int:
    """Run a command's `main(argv)` as a process does: its exit status (0 where main returns
    None), or, after printing `<command>: error: <message>` to stderr (no traceback),
    EXIT_USAGE for a UserError and EXIT_FAILURE for a RunError. A SystemExit from main
    (argparse's, a resumable stop's) passes through. Output cut short by its reader (`|
    head`) ends the command quietly with EXIT_PIPE, as a shell tool killed by SIGPIPE."""
    try:
        return int(main(argv) or 0)  # type: ignore[call-overload]
    except BrokenPipeError:
        # nothing more can reach stdout: point it at /dev/null so that the interpreter's own
        # flush at exit does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PIPE
    except UserError as e:
        print(f"{command}: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except RunError as e:
        print(f"{command}: error: {e}", file=sys.stderr, flush=True)
        return EXIT_FAILURE
