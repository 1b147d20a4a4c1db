"""What a trainer process pays at startup: importing megatron-core does not import wandb (about
2 s of CPU in every process and torchrun rank), and wandb stays importable afterwards for the
--wandb-project logger."""
import subprocess
import sys

import pytest


def test_megatron_core_import_skips_wandb_which_stays_importable():
    pytest.importorskip("wandb")
    code = ("import sys, megatron_rl, megatron.core.inference.contexts.dynamic_context as d; "
            "print('wandb' in sys.modules, d.HAVE_WANDB); import wandb; print(wandb.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=300).stdout.split()
    assert out == ["False", "False", "wandb"], out
