"""`megatron-rl <command>`: the command-line entry point.

The commands are the ``megatron_rl.commands`` entry points that setup.py declares, each naming
the ``module:function`` that runs it with the remaining arguments. This module knows none of
them by name, so it imports neither the trainer nor the research code in
``megatron_rl.experiments`` until a command is chosen. A command's one-line description in
``megatron-rl --help`` is the first sentence of its module's docstring, read from the source
without importing the module (``--help`` stays instant). A command that raises a UserError (a
flag, a config or data file, a destination refused: errors.py) ends with its message and exit
status 2, no traceback.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import re
import shutil
import sys
import textwrap

from megatron_rl.errors import EXIT_USAGE, run_command

GROUP = "megatron_rl.commands"


def commands() -> dict[str, importlib.metadata.EntryPoint]:
    """Registered commands by name, sorted (the first registration of a name wins)."""
    found: dict[str, importlib.metadata.EntryPoint] = {}
    for ep in importlib.metadata.entry_points(group=GROUP):
        found.setdefault(ep.name, ep)
    return dict(sorted(found.items()))


def describe(ep: importlib.metadata.EntryPoint) -> str:
    """First sentence of the docstring of the module `ep` points at ('' when it has none)."""
    try:
        spec = importlib.util.find_spec(ep.module)
        with open(spec.origin, encoding="utf-8") as f:
            doc = ast.get_docstring(ast.parse(f.read())) or ""
    except (ImportError, AttributeError, TypeError, OSError, SyntaxError, ValueError):
        return ""
    paragraph = " ".join(doc.split("\n\n", 1)[0].split())
    end = re.search(r"\.\s+(?=[A-Z])", paragraph)  # not "Sec. 3.3"
    return (paragraph[: end.start() + 1] if end else paragraph).rstrip(":")


def usage(found: dict[str, importlib.metadata.EntryPoint]) -> str:
    width = max(shutil.get_terminal_size().columns, 60)
    pad = max((len(name) for name in found), default=0) + 4
    lines = ["usage: megatron-rl <command> [args...]   (megatron-rl <command> --help: its flags)",
             "", "commands:"]
    for name, ep in found.items():
        lines += textwrap.wrap(describe(ep) or ep.value, width=width, initial_indent=f"  {name:<{pad}}",
                               subsequent_indent=" " * (pad + 2)) or [f"  {name}"]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    found = commands()
    if not found:
        print(f"no {GROUP!r} entry points are registered: install megatron-rl "
              "(pip install --no-build-isolation -e .; a checkout used from PYTHONPATH without "
              "installing: python setup.py egg_info there)", file=sys.stderr)
        return 2
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in found:
        print(usage(found))
        if argv and argv[0] not in ("-h", "--help"):
            print(f"unknown command {argv[0]!r}; valid: {sorted(found)}", file=sys.stderr)
            return EXIT_USAGE
        return 0
    return run_command(f"megatron-rl {argv[0]}", found[argv[0]].load(), argv[1:])


if __name__ == "__main__":
    sys.exit(main())
