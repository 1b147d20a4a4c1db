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


def test_no_engine_name_decides_behaviour_outside_rollout():
    """A comparison or membership test against an engine's name ("local", "vllm", ...) outside
    rollout/ is behaviour keyed on the name: it belongs in the engine table or the engine."""
    names = set(ENGINES)
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(("rollout/", "experiments/")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(
                    isinstance(c, ast.Constant) and c.value in names
                    or isinstance(c, (ast.Tuple, ast.List, ast.Set)) and any(
                        isinstance(e, ast.Constant) and e.value in names for e in c.elts)
                    for c in [node.left, *node.comparators]):
                if "rollout_engine" in ast.unparse(node):
                    found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "engine names decide behaviour outside rollout/:\n" + "\n".join(found)
