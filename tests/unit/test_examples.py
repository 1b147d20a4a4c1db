"""Every YAML recipe under examples/ parses into a valid TrainConfig (unknown keys, bad choices
and type errors fail here, not on a GPU cluster), and examples/tiny_cpu.yaml keeps the RL
settings of tools/cpu_demo.py."""
import glob
import math
import os
import sys

import pytest

from megatron_rl.config import flag_fields, parse_config, to_flat_dict

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
    fields = flag_fields()
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
}
# What an 80 GB H100 reports (the recipes' target), rounded down.
H100_BYTES = 79 << 30


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_recipe_server_holds_a_full_length_request(path):
    """A recipe that starts a vLLM/SGLang server gives it a context length within the model's
    positions and a GPU memory share whose KV cache, after the weights and the reserve
    (rollout/memory.py), holds one request of that length on an 80 GB H100: the server starts."""
    from megatron_rl.models import ModelArgs
    from megatron_rl.rollout.factory import ENGINES, server_context_len, server_memory_plan

    cfg = parse_config(["--config", path])
    r = cfg.rollout
    if not ENGINES[r.rollout_engine].servers or r.rollout_url:
        assert r.rollout_gpu_memory_utilization is None  # nothing started here to budget
        return
    args = ModelArgs.from_hf_config(HF_CONFIGS[os.path.basename(cfg.model.hf_checkpoint)])
    # the length is the recipe's own (known before the data is), the prompts are checked by it
    assert r.rollout_max_context_len > r.max_new_tokens
    context_len = server_context_len(r, r.rollout_max_context_len - r.max_new_tokens,
                                     args.max_position_embeddings)
    assert r.rollout_gpu_memory_utilization is not None
    plan = server_memory_plan(cfg, args, context_len, H100_BYTES)
    assert plan.fits, plan.describe()


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
    monkeypatch.setattr(cpu_demo, "build_base_model", lambda out, train, steps: "/base")
    monkeypatch.setattr(cpu_demo, "evaluate_weights", capture)
    monkeypatch.setattr(sys, "argv", ["cpu_demo.py", "--out", "/nonexistent/demo"])
    with pytest.raises(Captured) as info:
        cpu_demo.main()
    demo = to_flat_dict(info.value.args[0])
    recipe = to_flat_dict(parse_config(
        ["--config", os.path.join(REPO, "examples", "tiny_cpu.yaml")]))
    diff = {k: (demo[k], recipe[k]) for k in demo if k not in PATH_FIELDS and demo[k] != recipe[k]}
    assert not diff, f"(cpu_demo, tiny_cpu.yaml) differ: {diff}"
