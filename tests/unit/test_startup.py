"""What a trainer process pays at startup: importing megatron-core imports neither wandb (about
2 s of CPU in every process and torchrun rank; it stays importable afterwards for the
--wandb-project logger) nor, without CUDA, torch's compiler stack for fusions that never run
there (about 2.5 s)."""
import subprocess
import sys

import pytest
import torch


def _run(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=300)
    return out.stdout.split()


def test_megatron_core_import_skips_wandb_which_stays_importable():
    pytest.importorskip("wandb")
    out = _run("import sys, megatron_rl, megatron.core.inference.contexts.dynamic_context as d; "
               "print('wandb' in sys.modules, d.HAVE_WANDB); import wandb; print(wandb.__name__)")
    assert out == ["False", "False", "wandb"], out


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA megatron's fusions compile")
def test_without_cuda_megatron_core_import_skips_the_compiler_stack():
    out = _run("import sys, megatron_rl, megatron.core, megatron.core.jit as j; "
               "print('torch._dynamo' in sys.modules, j.jit_fuser is j.noop_decorator)")
    assert out == ["False", "True"], out
