"""Every YAML recipe under examples/ parses into a valid TrainConfig (unknown keys, bad choices
and type errors fail here, not on a GPU cluster), and examples/tiny_cpu.yaml keeps the RL
settings of tools/cpu_demo.py."""
import glob
import math
import os
import sys

import pytest

from megatron_rl.config import TrainConfig, parse_config
from megatron_rl.flags import flag_fields, to_flat_dict

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPES = sorted(glob.glob(os.path.join(REPO, "examples", "*.yaml")))
# Recipes name their model and data by path; the paths need not exist for validation, but the
# overrides make the test independent of whatever a recipe points at.
REQUIRED = ["--hf-checkpoint", "/nonexistent/hf", "--train-data", "/nonexistent/train.jsonl"]
# Fields that name files or directories: where tools/cpu_demo.py and the recipe may differ.
PATH_FIELDS = {"hf_checkpoint", "ref_checkpoint", "load", "save", "train_data", "eval_data"}


def test_examples_exist():
    names = {os.path.basename(p) for p in RECIPES}
    assert "tiny_cpu.yaml" in names
    assert len(names) >= 6, names


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_recipe_parses(path, tmp_path):
    cfg = parse_config(["--config", path, *REQUIRED, "--save", str(tmp_path / "run")])
    assert cfg.model.hf_checkpoint == "/nonexistent/hf"
    # flags override the file: the documented way to sweep beta
    swept = parse_config(["--config", path, *REQUIRED, "--kl-coef", "0.7"])
    assert swept.loss.kl.coef == 0.7


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_recipe_is_complete_without_overrides(path):
    """Each recipe names its model and data itself, so `--config FILE` alone is a valid launch."""
    cfg = parse_config(["--config", path])
    assert cfg.model.hf_checkpoint and cfg.data.train_data


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_recipe_keys_are_fields_and_values_typed(path):
    import yaml

    with open(path) as f:
        loaded = yaml.safe_load(f)
    fields = flag_fields(TrainConfig)
    for key, value in loaded.items():
        assert key in fields, f"{path}: unknown key {key!r}"
        kind = fields[key][1]
        if kind in (float, float | None):  # YAML reads "1e-6" as a string: write 1.0e-6
            assert isinstance(value, (int, float)) and not isinstance(value, bool), (key, value)
        elif kind in (int, int | None):
            assert isinstance(value, int) and not isinstance(value, bool), (key, value)
        elif kind in (bool, bool | None):
            assert isinstance(value, bool), (key, value)
        elif kind == list[str]:
            assert isinstance(value, list), (key, value)


def test_unknown_key_fails(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("kl_coeff: 0.1\n")
    with pytest.raises(ValueError, match="unknown keys"):
        parse_config(["--config", str(bad), *REQUIRED])


# The config.json (the fields the trainer reads) of each model a recipe names, by the name of its
# --hf-checkpoint directory: the checkpoints are not here, their architecture is.
HF_CONFIGS = {
    "Qwen3-4B-Instruct-2507": {
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 2560,
        "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 5000000,
        "max_position_embeddings": 262144, "tie_word_embeddings": True, "attention_bias": False},
    "Qwen2.5-7B": {
        "architectures": ["Qwen2ForCausalLM"], "vocab_size": 152064, "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "use_sliding_window": False},
    "Llama-3.1-8B-Instruct": {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    "Qwen3-30B-A3B-Base": {
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
        "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "max_position_embeddings": 32768, "tie_word_embeddings": False, "attention_bias": False,
        "use_sliding_window": False, "num_experts": 128, "num_experts_per_tok": 8,
        "moe_intermediate_size": 768, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": []},
}
# What an 80 GB H100 reports (the recipes' target), rounded down.
H100_BYTES = 79 << 30


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_recipe_server_holds_a_full_length_request(path):
    """A recipe that starts a vLLM/SGLang server gives it a context length within the model's
    positions (and, with --rollout-function agent, at least a whole episode of
    --agent-max-tokens) and a GPU memory share whose KV cache, after the weights and the reserve
    (rollout/memory.py), holds one request of that length on an 80 GB H100: the server starts."""
    from megatron_rl.models import ModelArgs
    from megatron_rl.rollout.factory import ENGINES, server_context_len, server_memory_plan
    from megatron_rl.rollout.needs import episode_tokens

    cfg = parse_config(["--config", path])
    r = cfg.rollout
    if not ENGINES[r.rollout_engine].servers or r.rollout_url:
        assert r.rollout_gpu_memory_utilization is None  # nothing started here to budget
        return
    args = ModelArgs.from_hf_config(HF_CONFIGS[os.path.basename(cfg.model.hf_checkpoint)])
    # the length is the recipe's own (known before the data is), the prompts are checked by it
    assert r.rollout_max_context_len > r.max_new_tokens
    episode = episode_tokens(r.rollout_function, cfg.agent)
    context_len = server_context_len(r, r.rollout_max_context_len - r.max_new_tokens,
                                     args.max_position_embeddings, episode)
    assert r.rollout_gpu_memory_utilization is not None
    plan = server_memory_plan(cfg, args, context_len, H100_BYTES)
    assert plan.fits, plan.describe()


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_recipe_microbatch_holds_a_full_length_sequence(path):
    """A packed microbatch of --max-tokens-per-microbatch tokens takes the longest sequence the
    recipe lets through (a longer one stops the step): --rollout-max-context-len of a server
    started here, a whole episode (--agent-max-tokens) of --rollout-function agent, at least
    one full response."""
    from megatron_rl.rollout.factory import ENGINES
    from megatron_rl.rollout.needs import episode_tokens

    cfg = parse_config(["--config", path])
    r, budget = cfg.rollout, cfg.algorithm.max_tokens_per_microbatch
    if not cfg.algorithm.sequence_packing or not budget:
        return  # microbatches sized by the batch's longest sequence
    longest = r.max_new_tokens + 1
    if ENGINES[r.rollout_engine].servers and not r.rollout_url:
        longest = max(longest, r.rollout_max_context_len)
    longest = max(longest, episode_tokens(r.rollout_function, cfg.agent))
    assert budget >= longest, (budget, longest)


def test_qwen3_recipe_model_is_supported_at_its_layout():
    """Qwen3-4B-Instruct-2507's config.json (the recipe's model) parses, fits the recipe's TP and
    maps to the known parameter count (4.02 B, tied embeddings)."""
    from megatron_rl.models import ModelArgs, hf_mapping

    cfg = parse_config(["--config", os.path.join(REPO, "examples",
                                                  "qwen3-4b-instruct_countdown_async10.yaml")])
    args = ModelArgs.from_hf_config(HF_CONFIGS["Qwen3-4B-Instruct-2507"])
    assert args.qk_norm and not args.qkv_bias and args.head_dim == 128
    tp = cfg.parallel.tensor_model_parallel_size
    assert args.num_key_value_heads % tp == 0 and args.vocab_size % tp == 0
    n = sum(math.prod(s) for s in hf_mapping.hf_expected_shapes(args).values())
    assert n == sum(math.prod(s) for s in hf_mapping.expected_shapes(args).values())
    assert abs(n - 4.02e9) < 0.01e9, n


def test_moe_recipe_model_and_layout():
    """The GSPO recipe's Qwen3-30B-A3B-Base: its config.json parses as a Qwen3-MoE with every
    layer sparse and untied embeddings (what the sglang engine serves), the recipe's layout is
    valid on its 16 training ranks (TP 2 + SP, EP 8 dividing the experts and DP 8), routing
    replay is on with an engine that returns routes, and the parameter counts of the file's
    memory budget hold: 30.53e9 in all (28.99e9 in experts), per GPU 1.81e9 of experts and
    0.78e9 of the rest."""
    from megatron_rl.models import ModelArgs, hf_mapping
    from megatron_rl.rollout.factory import ENGINES
    from megatron_rl.rollout.sglang_engine import _check_servable

    cfg = parse_config(["--config", os.path.join(REPO, "examples", "qwen3-30b-a3b_math_gspo.yaml")])
    hf = HF_CONFIGS[os.path.basename(cfg.model.hf_checkpoint)]
    args = ModelArgs.from_hf_config(hf)
    assert args.moe_layer_pattern == [1] * 48 and args.num_experts == 128
    assert args.num_experts_per_tok == 8 and args.norm_topk_prob
    _check_servable(hf, "Qwen3-30B-A3B-Base")  # raises for a checkpoint SGLang serves wrongly

    p = cfg.parallel
    tp, ep = p.tensor_model_parallel_size, p.expert_model_parallel_size
    assert p.sequence_parallel and p.pipeline_model_parallel_size == 1
    assert args.num_key_value_heads % tp == 0 and args.vocab_size % tp == 0
    assert args.num_experts % ep == 0
    dp = p.data_parallel_size(16)
    assert dp == 8
    cfg.check_layout(dp)
    assert cfg.algorithm.routing_replay and ENGINES[cfg.rollout.rollout_engine].routed_experts
    assert cfg.loss.policy_loss == "gspo" and cfg.loss.aggregation == "seq-mean-token-mean"

    shapes = hf_mapping.expected_shapes(args)
    total = sum(math.prod(s) for s in shapes.values())
    experts = sum(math.prod(s) for n, s in shapes.items() if hf_mapping.is_expert_param(n))
    assert total == sum(math.prod(s) for s in hf_mapping.hf_expected_shapes(args).values())
    assert abs(total - 30.53e9) < 0.01e9 and abs(experts - 28.99e9) < 0.01e9, (total, experts)
    # per GPU: the experts split over EP x expert-TP (= TP); of the rest, the matrices split by
    # TP (embedding, output layer, attention), the routers and norms whole on each TP rank
    whole = sum(math.prod(s) for n, s in shapes.items()
                if not hf_mapping.is_expert_param(n) and (len(s) == 1 or ".router." in n))
    dense_per_gpu = (total - experts - whole) / tp + whole
    assert abs(experts / (ep * tp) - 1.81e9) < 0.01e9
    assert abs(dense_per_gpu - 0.78e9) < 0.01e9, dense_per_gpu


def test_tiny_cpu_recipe_matches_cpu_demo(monkeypatch):
    """The TrainConfig tools/cpu_demo.py builds equals examples/tiny_cpu.yaml up to paths."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    try:
        import cpu_demo
    finally:
        sys.path.pop(0)

    class Captured(Exception):
        pass

    def capture(cfg):
        raise Captured(cfg)

    monkeypatch.setattr(cpu_demo, "prepare_data", lambda out, **kw: ("/t.jsonl", "/e.jsonl"))
    monkeypatch.setattr(cpu_demo, "build_base_model", lambda out, train, steps, seed, **kw: "/base")
    monkeypatch.setattr(cpu_demo, "discard_stale_run", lambda cfg, fresh: capture(cfg))
    monkeypatch.setattr(sys, "argv", ["cpu_demo.py", "--out", "/nonexistent/demo"])
    with pytest.raises(Captured) as info:
        cpu_demo.main()
    demo = to_flat_dict(info.value.args[0])
    recipe = to_flat_dict(parse_config(
        ["--config", os.path.join(REPO, "examples", "tiny_cpu.yaml")]))
    diff = {k: (demo[k], recipe[k]) for k in demo if k not in PATH_FIELDS and demo[k] != recipe[k]}
    assert not diff, f"(cpu_demo, tiny_cpu.yaml) differ: {diff}"
