"""Conversion round trip on the GPU: HF -> Megatron checkpoint -> HF with megatron_rl.convert (the
policy built on the GPU, dist_checkpointing save and load from device tensors); every tensor comes
back equal, as stored (fp32) and exported as bf16."""
import pytest
import torch

from gpu_helpers import single_gpu_rank

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("ckpt", ["tiny_qwen2", "tiny_qwen3", "tiny_llama_tied"])
def test_hf_megatron_hf_round_trip_on_gpu(ckpt, request, tmp_path):
    from megatron_rl import convert
    from megatron_rl.models import hf_mapping

    single_gpu_rank()
    path = request.getfixturevalue(ckpt)
    original = hf_mapping.load_hf_state_dict(path)
    root = str(tmp_path / "megatron")
    convert.hf_to_megatron(path, root)
    for dtype in (None, "bfloat16"):
        out = str(tmp_path / f"hf_{dtype}")
        convert.megatron_to_hf(root, out, dtype=dtype)
        back = hf_mapping.load_hf_state_dict(out)
        assert set(back) == set(original)
        for name, t in original.items():
            want = t if dtype is None else t.to(torch.bfloat16)
            assert back[name].dtype == want.dtype and torch.equal(back[name], want), name
