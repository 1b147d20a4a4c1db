"""Reading SGLang's /generate answers (megatron_rl.rollout.sglang_engine._completion) without a
server: the routed experts, base64 of int32 [prompt + output - 1, layers, k] over every layer,
come back cut to the model's mixture-of-experts layers; an answer without them, or of the wrong
size, is a BadAnswer that says what is wrong."""
import base64

import pytest
import torch

from megatron_rl.rollout.base import BadAnswer
from megatron_rl.rollout.sglang_engine import _completion


def _item(routes: torch.Tensor | None, tokens=(7, 8, 9)) -> dict:
    meta = {"output_token_logprobs": [[-0.5, t, None] for t in tokens],
            "finish_reason": {"type": "length"}}
    if routes is not None:
        meta["routed_experts"] = base64.b64encode(
            routes.to(torch.int32).numpy().tobytes()).decode()
    return {"meta_info": meta}


def test_routed_experts_cut_to_the_moe_layers():
    prompt_len, layers, k = 4, 3, 2
    n = prompt_len + 3 - 1
    routes = torch.arange(n * layers * k).reshape(n, layers, k) % 8
    c = _completion(_item(routes), prompt_len, (layers, [0, 2]))
    assert c.token_ids == [7, 8, 9] and c.rollout_logprobs == [-0.5] * 3
    assert c.routed_experts is not None and c.routed_experts.dtype == torch.int16
    assert torch.equal(c.routed_experts.long(), routes[:, [0, 2]])
    assert _completion(_item(routes), prompt_len).routed_experts is None  # not asked for


def test_missing_or_misshapen_routes_are_named():
    with pytest.raises(BadAnswer, match="--enable-return-routed-experts"):
        _completion(_item(None), 4, (3, [0]))
    with pytest.raises(BadAnswer, match="not 6 tokens x 3 layers"):
        _completion(_item(torch.zeros(5, 3, 2)), 4, (3, [0]))


def test_moe_checkpoints_sglang_serves_wrongly_are_refused(tmp_path):
    from megatron_rl.rollout.sglang_engine import _check_servable

    base = {"model_type": "qwen3_moe", "mlp_only_layers": [], "decoder_sparse_step": 1,
            "tie_word_embeddings": False}
    _check_servable(base, "ok")  # every layer sparse, untied: Qwen3-30B-A3B's shape
    _check_servable({"model_type": "qwen2", "tie_word_embeddings": True}, "dense")
    with pytest.raises(ValueError, match="dense layers"):
        _check_servable(dict(base, mlp_only_layers=[1]), "ckpt")
    with pytest.raises(ValueError, match="tied embeddings"):
        _check_servable(dict(base, tie_word_embeddings=True), "ckpt")


def test_each_sample_of_each_prompt_has_its_own_seed(tmp_path):
    """The /generate request of a seeded call: sample j of prompt i is seeded
    prompt_seed(seed, i) + j, so copies of a prompt and samples of different prompts draw
    their own noise (SGLang honours these seeds under --enable-deterministic-inference, a GPU
    mode; its CPU attention backend refuses it, so a CPU server cannot show the samples)."""
    import json

    from megatron_rl.rollout.base import SamplingParams, prompt_seed
    from megatron_rl.rollout.net import free_port
    from megatron_rl.rollout.sglang_engine import SGLangConfig, SGLangEngine

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    engine = SGLangEngine(str(model), SGLangConfig(work_dir=str(tmp_path / "w"),
                                                   url=f"http://127.0.0.1:{free_port()}"),
                          start=False)
    sent = []

    def answer(path, payload, timeout=600.0):
        sent.append(payload)
        return [_item(None, tokens=(3,)) for _ in payload["input_ids"]]

    engine._post = answer  # the transport: what is under test is the request it is given
    prompts = [[5, 6], [7, 8], [5, 6]]
    engine.generate(prompts, 3, SamplingParams(max_new_tokens=1, seed=11))
    seeds = [sp["sampling_seed"] for sp in sent[0]["sampling_params"]]
    assert seeds == [prompt_seed(11, i) + j for i in range(3) for j in range(3)]
    assert len(set(seeds)) == 9
    engine.generate(prompts, 2, SamplingParams(max_new_tokens=1))
    assert all("sampling_seed" not in sp for sp in sent[1]["sampling_params"])
