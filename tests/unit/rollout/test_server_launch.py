"""How the vLLM and SGLang engines launch their servers, without a server: the command line a
launch on GPUs uses."""
import json
import sys

import pytest


@pytest.fixture
def model_dir(tmp_path):
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": 64}))
    return str(path)


def _value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_vllm_uses_cuda_graphs_on_gpus_and_eager_mode_on_the_cpu(model_dir, tmp_path):
    from megatron_rl.rollout.vllm_engine import VLLMConfig, VLLMEngine

    config = VLLMConfig(work_dir=str(tmp_path / "w"), python=sys.executable, max_model_len=3072,
                        gpu_memory_utilization=0.25)
    engine = VLLMEngine(model_dir, config, start=False)
    gpu = engine._argv(model_dir, "127.0.0.1", 8000, cuda=True)
    assert "--enforce-eager" not in gpu
    assert _value(gpu, "--max-model-len") == "3072"
    assert _value(gpu, "--gpu-memory-utilization") == "0.25"
    assert "--enforce-eager" in engine._argv(model_dir, "127.0.0.1", 8000, cuda=False)
    eager = VLLMEngine(model_dir, VLLMConfig(work_dir=str(tmp_path / "e"), python=sys.executable,
                                             enforce_eager=True), start=False)
    assert "--enforce-eager" in eager._argv(model_dir, "127.0.0.1", 8000, cuda=True)
