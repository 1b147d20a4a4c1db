"""A vLLM server colocated on the trainer's GPU frees its memory around the training phase
(`--rollout-release-memory`: vLLM sleep mode level 1) and takes it back, serving the same
weights afterwards.

Needs a CUDA build of vLLM in $MEGATRON_RL_VLLM_PYTHON (or .venv-vllm); the GPU machines lent
to this project have none (no network to install one), so there it skips saying so.
"""
import subprocess

import pytest
import torch

from gpu_helpers import char_model

pytestmark = pytest.mark.gpu


def _cuda_vllm() -> str | None:
    from megatron_rl.rollout.vllm_engine import vllm_python

    py = vllm_python()
    if py is None:
        return None
    probe = subprocess.run([py, "-c", "import torch, vllm; print(torch.cuda.is_available())"],
                           capture_output=True, text=True)
    return py if probe.stdout.strip().endswith("True") else None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_vllm_sleep_frees_and_retakes_gpu_memory(tmp_path):
    if _cuda_vllm() is None:
        pytest.skip("no CUDA build of vLLM ($MEGATRON_RL_VLLM_PYTHON or .venv-vllm)")
    from megatron_rl.rollout.base import SamplingParams
    from megatron_rl.rollout.vllm_engine import VLLMConfig, VLLMEngine

    # vLLM's attention needs head_dim >= 32: 2 heads of 32
    model = char_model(str(tmp_path / "model"), seed=0, num_attention_heads=2,
                       num_key_value_heads=1)
    free0 = torch.cuda.mem_get_info()[0]
    engine = VLLMEngine(model, VLLMConfig(work_dir=str(tmp_path / "w"), dtype="float32",
                                          max_model_len=256, gpu_memory_utilization=0.3,
                                          sleep_mode=True))
    try:
        params = SamplingParams(max_new_tokens=8, seed=3)
        before = engine.generate([[5, 6, 7], [9, 10]], 2, params)
        held = free0 - torch.cuda.mem_get_info()[0]
        assert held > 0.2 * torch.cuda.mem_get_info()[1]  # its 30% budget, KV cache included
        engine.release_memory()
        freed = torch.cuda.mem_get_info()[0] - (free0 - held)
        assert freed > 0.8 * held, (freed, held)
        engine.resume_memory()
        after = engine.generate([[5, 6, 7], [9, 10]], 2, params)
        assert [[c.token_ids for c in g] for g in after] == [[c.token_ids for c in g]
                                                             for g in before]
    finally:
        engine.shutdown()
