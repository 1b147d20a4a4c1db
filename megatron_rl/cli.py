"""`megatron-rl <command>`: the command-line entry point.

    megatron-rl train   ...   RL training (Megatron-style flags or --config YAML); under torchrun too
    megatron-rl eval    ...   mean@k / pass@k table of a checkpoint
    megatron-rl convert ...   HF <-> Megatron checkpoint conversion
    megatron-rl toy     ...   the exact KL-gradient study of the paper's Section 3.3
"""

from __future__ import annotations

import sys

COMMANDS = {
    "train": ("megatron_rl.train", "main"),
    "eval": ("megatron_rl.evaluation", "main"),
    "convert": ("megatron_rl.convert", "main"),
    "toy": ("megatron_rl.toy", "main"),
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"unknown command {argv[0]!r}; valid: {sorted(COMMANDS)}", file=sys.stderr)
            return 2
        return 0
    import importlib

    module, fn = COMMANDS[argv[0]]
    result = getattr(importlib.import_module(module), fn)(argv[1:])
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
