#!/usr/bin/env python
"""Convert checkpoints between Hugging Face and Megatron formats (any TP/PP on either side).

    python tools/convert_checkpoint.py hf-to-megatron --load HF_DIR --save MEGATRON_ROOT
    torchrun --nproc-per-node 4 tools/convert_checkpoint.py megatron-to-hf --load MEGATRON_ROOT \
        --save HF_DIR --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2

--save is a new or empty directory; --overwrite replaces an earlier conversion's output there
and nothing else (megatron_rl.convert.check_destination).
"""
import sys

from megatron_rl.convert import main
from megatron_rl.errors import run_command

if __name__ == "__main__":
    sys.exit(run_command("megatron-rl convert", main, sys.argv[1:]))
