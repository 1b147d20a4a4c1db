"""The engine table (rollout/factory.py) agrees with the engines it describes, and no module
outside rollout/ decides behaviour by an engine's name."""
import ast
import pathlib

import pytest

from megatron_rl.rollout.factory import ENGINES

PACKAGE = pathlib.Path(__file__).resolve().parents[3] / "megatron_rl"


def _engine_class(name):
    if name == "local":
        from megatron_rl.rollout.local import LocalEngine
        return LocalEngine, None
    if name == "process":
        from megatron_rl.rollout.process import ProcessConfig, ProcessEngine
        return ProcessEngine, ProcessConfig
    if name == "vllm":
        from megatron_rl.rollout.vllm_engine import VLLMConfig, VLLMEngine
        return VLLMEngine, VLLMConfig
    from megatron_rl.rollout.sglang_engine import SGLangConfig, SGLangEngine
    return SGLangEngine, SGLangConfig


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_engine_table_matches_the_engine(name):
    spec = ENGINES[name]
    cls, config = _engine_class(name)
    assert cls.holds_own_weights is spec.holds_own_weights
    assert (cls.client_rank is None) is (not spec.holds_own_weights)
    assert spec.routed_experts or not spec.routed_experts_pipelined
    if config is not None:  # the modes its config accepts are the ones the table lists
        assert set(config.SYNCS) == set(spec.weight_syncs) - {"auto"}
    for method in ("generate", "update_weights", "stats", "release_memory", "resume_memory",
                   "health", "shutdown"):
        assert callable(getattr(cls, method, None)), f"{cls.__name__} lacks {method}"


def test_engine_config_rejects_a_sync_mode_it_does_not_take(tmp_path):
    from megatron_rl.rollout.process import ProcessConfig
    from megatron_rl.rollout.vllm_engine import VLLMConfig

    with pytest.raises(ValueError, match="VLLMConfig.sync 'distributed': this engine takes disk"):
        VLLMConfig(work_dir=str(tmp_path), sync="distributed")
    with pytest.raises(ValueError, match="ProcessConfig.sync 'disc'"):
        ProcessConfig(work_dir=str(tmp_path), hf_checkpoint=str(tmp_path), sync="disc")


def engine_name_comparisons(source: str) -> list[str]:
    """Comparisons (==, !=, in, not in) of a value that comes from --rollout-engine (an
    expression reading `rollout_engine`, or a name assigned from one, in the same function)
    with an engine's name ("local", "vllm", ...), as "line: code"."""
    names = set(ENGINES)

    def engine_name(node) -> bool:
        return (isinstance(node, ast.Constant) and node.value in names
                or isinstance(node, (ast.Tuple, ast.List, ast.Set))
                and any(engine_name(e) for e in node.elts))

    functions = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)

    def own_nodes(scope):
        """The scope's nodes, not those of the functions defined inside it."""
        todo = list(ast.iter_child_nodes(scope))
        while todo:
            node = todo.pop()
            yield node
            if not isinstance(node, functions):
                todo += ast.iter_child_nodes(node)

    found = set()

    def visit(scope, inherited: frozenset) -> None:
        """Comparisons in `scope`, with the names tainted in the scopes around it (closures)."""
        tainted = set(inherited)

        def from_engine(node) -> bool:
            return any(isinstance(n, ast.Attribute) and n.attr == "rollout_engine"
                       or isinstance(n, ast.Name) and n.id in tainted for n in ast.walk(node))

        pairs = []  # (target, value) of every assignment in the scope, tuples element-wise
        for node in own_nodes(scope):
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)) and node.value:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if (isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple)
                            and len(t.elts) == len(node.value.elts)):
                        pairs += zip(t.elts, node.value.elts)
                    else:
                        pairs.append((t, node.value))
        while True:  # names assigned from the engine's name, and from those names
            new = {n.id for t, v in pairs if from_engine(v) for n in ast.walk(t)
                   if isinstance(n, ast.Name)} - tainted
            if not new:
                break
            tainted |= new
        for node in own_nodes(scope):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                if any(map(engine_name, operands)) and any(
                        from_engine(o) for o in operands if not engine_name(o)):
                    found.add(f"{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, functions):
                visit(node, frozenset(tainted))

    visit(ast.parse(source), frozenset())
    return sorted(found)


def test_engine_name_comparisons_are_found_through_local_names():
    """The check below sees a comparison made through a local variable, or a tuple of names,
    and not one of another setting's value that happens to equal an engine's name."""
    src = ("def f(self):\n"
           "    engine = self.rollout.rollout_engine\n"
           "    e2 = engine\n"
           "    r, kind = self.rollout, self.rollout.rollout_engine\n"
           "    if engine == 'local' and e2 in ('vllm', 'sglang') or kind != 'process':\n"
           "        pass\n"
           "    if cfg.rollout.rollout_engine == 'vllm':\n"
           "        pass\n"
           "    def inner():\n"
           "        return e2 == 'vllm'\n"
           "def g(options):\n"
           "    backend = options.attention_backend\n"
           "    engine = 'local'\n"
           "    return backend == 'local' or engine == 'local'\n")
    assert [f.split(":")[0] for f in engine_name_comparisons(src)] == ["10", "5", "5", "5", "7"]


def test_no_engine_name_decides_behaviour_outside_rollout():
    """A comparison or membership test of --rollout-engine's value against an engine's name
    ("local", "vllm", ...) outside rollout/ is behaviour keyed on the name: it belongs in the
    engine table or the engine."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("rollout/"):
            continue
        found += [f"{rel}:{f}" for f in engine_name_comparisons(path.read_text())]
    assert not found, "engine names decide behaviour outside rollout/:\n" + "\n".join(found)


# -- servers started by the trainer: their context length, devices and memory share ----------

LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072}
GIB = 1 << 30


def _cfg(tmp_path, *flags):
    from megatron_rl.config import parse_config

    return parse_config(["--hf-checkpoint", "m", "--train-data", "d.jsonl", "--bf16",
                         "--save", str(tmp_path / "run"), "--max-new-tokens", "1024", *flags])


def test_context_length_is_the_runs_not_the_models(tmp_path):
    """A started server takes the longest prompt + --max-new-tokens (not the model's 131072
    positions, whose KV cache no recipe's share holds), or --rollout-max-context-len; a prompt
    it cannot hold, or a length beyond the model's positions, is refused up front."""
    from megatron_rl.rollout.factory import server_context_len

    r = _cfg(tmp_path, "--rollout-engine", "vllm").rollout
    assert server_context_len(r, 700, 131072) == 1724
    r = _cfg(tmp_path, "--rollout-engine", "vllm", "--rollout-max-context-len", "3072").rollout
    assert server_context_len(r, 700, 131072) == 3072
    with pytest.raises(ValueError, match="--rollout-max-context-len 3072 holds prompts of up to "
                                         "2048 tokens .* the longest prompt .* has 2100"):
        server_context_len(r, 2100, 131072)
    with pytest.raises(ValueError, match="--rollout-max-context-len 3072 exceeds the model's "
                                         "max_position_embeddings .2048."):
        server_context_len(r, 700, 2048)
    r = _cfg(tmp_path, "--rollout-engine", "vllm").rollout
    with pytest.raises(ValueError, match=r"the longest prompt \(1500 tokens\) \+ --max-new-tokens "
                                         r"\(1024\) = 2524 exceeds"):
        server_context_len(r, 1500, 2048)


def test_a_multi_turn_episode_sets_the_context_length(tmp_path):
    """--rollout-function agent: a started server holds a whole episode (--agent-max-tokens),
    more than a prompt and one turn; an episode longer than the model's positions or than
    --rollout-max-context-len is refused up front."""
    from megatron_rl.rollout.factory import server_context_len

    r = _cfg(tmp_path, "--rollout-engine", "vllm").rollout
    assert server_context_len(r, 700, 131072, episode_tokens=4096) == 4096
    assert server_context_len(r, 700, 131072, episode_tokens=1000) == 1724
    with pytest.raises(ValueError, match="--agent-max-tokens 4096 exceeds the model's "
                                         "max_position_embeddings .2048."):
        server_context_len(r, 700, 2048, episode_tokens=4096)
    r = _cfg(tmp_path, "--rollout-engine", "vllm", "--rollout-max-context-len", "3072").rollout
    with pytest.raises(ValueError, match="--rollout-max-context-len 3072 is shorter than an "
                                         "episode of --agent-max-tokens 4096"):
        server_context_len(r, 700, 131072, episode_tokens=4096)


def test_servers_on_gpus_get_their_device_context_and_share(tmp_path):
    """Pretending a CUDA run: server i on device i (or --rollout-gpus), the run's context
    length, vLLM the share as is, SGLang the share in its own terms."""
    from megatron_rl.models import ModelArgs
    from megatron_rl.rollout.factory import server_configs, server_memory_plan

    args = ModelArgs.from_hf_config(LLAMA_8B)
    cfg = _cfg(tmp_path, "--rollout-engine", "vllm", "--rollout-num-servers", "2",
               "--rollout-gpu-memory-utilization", "0.25")
    vllm = server_configs(cfg, args, 500, cuda=True, gpu_bytes=79 * GIB)
    assert [c.gpus for c in vllm] == [(0,), (1,)]
    assert [(c.max_model_len, c.gpu_memory_utilization, c.kv_cache_memory_bytes)
            for c in vllm] == [(1524, 0.25, None)] * 2
    assert vllm[0].work_dir != vllm[1].work_dir
    cpu = server_configs(cfg, args, 500, cuda=False)  # the CPU: no devices, no GPU share
    assert [(c.gpus, c.gpu_memory_utilization) for c in cpu] == [((), None)] * 2

    cfg = _cfg(tmp_path, "--rollout-engine", "sglang", "--rollout-num-servers", "2",
               "--rollout-gpus", "2", "3", "--rollout-gpu-memory-utilization", "0.25")
    sglang = server_configs(cfg, args, 500, cuda=True, gpu_bytes=79 * GIB)
    fraction, tokens = server_memory_plan(cfg, args, 1524, 79 * GIB).sglang_args()
    assert [(c.gpus, c.context_length, c.mem_fraction_static, c.max_total_tokens)
            for c in sglang] == [((2,), 1524, fraction, tokens), ((3,), 1524, fraction, tokens)]

    attached = _cfg(tmp_path, "--rollout-engine", "sglang", "--rollout-url", "http://a:1",
                    "--rollout-gpu-memory-utilization", "0.25")
    [c] = server_configs(attached, args, None, cuda=True)  # runs where and as it runs
    assert (c.url, c.gpus, c.max_total_tokens) == ("http://a:1", (), None)


def test_a_share_that_cannot_hold_one_request_is_refused_up_front(tmp_path, caplog):
    """Llama-3.1-8B at 0.25 of an 80 GB GPU: its own 131072 positions need 16 GiB of KV cache,
    the share leaves 4.8 GiB after the weights: refused before any server starts. A length
    that only the reserve's estimate makes short is let through with a warning."""
    from megatron_rl.models import ModelArgs
    from megatron_rl.rollout.factory import server_configs

    args = ModelArgs.from_hf_config(LLAMA_8B)
    cfg = _cfg(tmp_path, "--rollout-engine", "vllm", "--rollout-gpu-memory-utilization", "0.25",
               "--rollout-max-context-len", "131072")
    with pytest.raises(ValueError, match=r"--rollout-gpu-memory-utilization 0.25: one request of "
                                         r"131072 tokens .* needs 16.00 GiB of KV cache"):
        server_configs(cfg, args, 500, cuda=True, gpu_bytes=79 * GIB)
    cfg = _cfg(tmp_path, "--rollout-engine", "vllm", "--rollout-gpu-memory-utilization", "0.25",
               "--rollout-max-context-len", "20000")  # 2.4 GiB: fits without the reserve only
    with caplog.at_level("WARNING"):
        server_configs(cfg, args, 500, cuda=True, gpu_bytes=79 * GIB)
    assert "may not start" in caplog.text
