"""Plug-ins a user configures and extends: settings for an environment (--agent-env-args), a
rollout function (--rollout-function-args) and tools (--agent-tool-args) from the command line
and YAML; custom tools by import path; the Python sandbox's limits as flags; a rollout
function's declared needs (rollout/needs.py), which a function wrapping agent_rollout keeps;
agent flags that nothing reads refused; a data row's task free where an environment gives the
reward.

The environments, tools and rollout functions are this module's own, named by import path as a
user names theirs; the configuration, the agent loop (on test_agent_loop's scripted engine and
the character tokenizer), the tools, the sandbox, the data loading and the scorer are real.
"""
import functools
import json
import os

import pytest
from test_agent_loop import ScriptedEngine

from megatron_rl import config_changes
from megatron_rl.agent.env import Environment, StepResult
from megatron_rl.agent.loop import agent_rollout
from megatron_rl.agent.sandbox import SandboxLimits, SandboxUnavailable
from megatron_rl.agent.settings import tool_registry
from megatron_rl.agent.tools import Tool, ToolCall, execute_tool_call
from megatron_rl.checkpoint import TRAIN_CONFIG
from megatron_rl.config import parse_config
from megatron_rl.data.prompts import Codec, PromptRecord
from megatron_rl.data.records import DataFormatError, TaskExample, write_jsonl
from megatron_rl.errors import ConfigError
from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout.functions import RolloutContext, check_groups, run_rollout
from megatron_rl.rollout.single_turn import single_turn

HERE = __name__
BASE = ["--hf-checkpoint", "m", "--train-data", "d.jsonl"]
AGENT = ["--rollout-function", "agent"]


class Guess(Environment):
    """Guess `secret`, a setting of the environment (--agent-env-args): reward 1 and done on
    the right guess, "wrong" otherwise; `reward_at_end=False`: done without a reward."""

    def __init__(self, secret: int, reward_at_end: bool = True):
        self.secret, self.reward_at_end = secret, reward_at_end

    def step(self, turn):
        digits = "".join(c if c.isdigit() else " " for c in turn).split()
        if digits and int(digits[-1]) == self.secret:
            return StepResult(reward=1.0 if self.reward_at_end else None, done=True)
        return StepResult("wrong")


WORD_COUNT = Tool("word_count", "Count the words of a text.",
                  {"type": "object", "properties": {"text": {"type": "string"}},
                   "required": ["text"]}, lambda text: str(len(text.split())))
NOT_A_TOOL = "a string"


def make_lookup(table: dict, name: str = "lookup") -> Tool:
    """A tool answering each key of `table` (its settings: --agent-tool-args)."""
    return Tool(name, "Look a constant up by its name.",
                {"type": "object", "properties": {"key": {"type": "string"}},
                 "required": ["key"]}, lambda key: table.get(key, "unknown"))


def make_nothing() -> str:
    return "not a tool"


@functools.wraps(agent_rollout)
def wrapped_agent(ctx, records):
    """A user's rollout function around the agent loop (functools.wraps keeps its needs)."""
    return agent_rollout(ctx, records)


def plain_rollout(ctx, records):
    """A user's rollout function that declares nothing: single-turn, reward ctx.args["reward"]."""
    groups = single_turn(ctx, records)
    for group in groups:
        for t in group:
            t.reward = float(ctx.args["reward"])
    return groups


def _ctx(tokenizer, scorer, cfg, policy, group_size=1):
    codec = Codec.from_tokenizer(tokenizer, chat_template=False)
    engine = ScriptedEngine(tokenizer, policy, positions=cfg.agent.agent_max_tokens)
    return RolloutContext(engine, SamplingParams(max_new_tokens=200, seed=5,
                                                 stop_token_ids=codec.stop_ids),
                          group_size, codec, scorer, agent=cfg.agent,
                          args=cfg.rollout.rollout_function_args)


def _yaml(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return ["--config", str(path)]


# -- settings for the environment and the rollout function -------------------------------------

def test_env_args_reach_each_episodes_environment_from_the_flag_and_from_yaml(
        tokenizer, scorer, tmp_path):
    guesses = ["50<eos>", "7<eos>"]
    records = [PromptRecord("g:0", "Guess:", "math", "0")]
    flag = parse_config(BASE + AGENT + ["--agent-environment", f"{HERE}:Guess",
                                        "--agent-env-args", '{"secret": 7}'])
    yaml = parse_config(BASE + _yaml(tmp_path, f"rollout_function: agent\n"
                                               f"agent_environment: {HERE}:Guess\n"
                                               f"agent_env_args:\n  secret: 7\n"))
    assert flag.agent.agent_env_args == yaml.agent.agent_env_args == {"secret": 7}
    for cfg in (flag, yaml):
        [[t]] = agent_rollout(_ctx(tokenizer, scorer, cfg, lambda _, call: guesses[call]),
                              records)
        assert (t.reward, t.metadata["end"]) == (1.0, "answer")  # the secret was its setting


def test_env_args_the_environment_cannot_take_are_refused_naming_flag_and_parameter(
        tmp_path, capsys):
    env = AGENT + ["--agent-environment", f"{HERE}:Guess"]
    with pytest.raises(ConfigError, match=r"--agent-env-args: .*Guess has no parameter 'depth'"
                                          r" \(its keyword parameters: secret, reward_at_end\)"):
        parse_config(BASE + env + ["--agent-env-args", '{"secret": 1, "depth": 2}'])
    with pytest.raises(ConfigError, match=r"--agent-env-args: .*missing a required argument: "
                                          r"'secret'"):
        parse_config(BASE + env)
    with pytest.raises(SystemExit):
        parse_config(BASE + env + ["--agent-env-args", "{secret: 1}"])
    assert "argument --agent-env-args: not valid JSON: Expecting property name" in \
        capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"agent_env_args: \[1, 2\] is not a mapping .*"
                                          r"--agent-env-args"):
        parse_config(BASE + env + _yaml(tmp_path, "agent_env_args: [1, 2]\n"))


def test_rollout_function_args_reach_the_function_as_ctx_args(tokenizer, scorer, tmp_path):
    path = f"{HERE}:plain_rollout"
    for cfg in (parse_config(BASE + ["--rollout-function", path,
                                     "--rollout-function-args", '{"reward": 0.25}']),
                parse_config(BASE + _yaml(tmp_path, f"rollout_function: {path}\n"
                                                    "rollout_function_args: {reward: 0.25}\n"))):
        ctx = _ctx(tokenizer, scorer, cfg, lambda *_: "12<eos>", group_size=2)
        groups = run_rollout(path, ctx, [PromptRecord("r:0", "Q:", "arithmetic", "12")])
        assert [t.reward for t in groups[0]] == [0.25, 0.25]


# -- tools by import path, the sandbox's limits --------------------------------------------------

def test_custom_tools_by_import_path_with_their_settings_run_in_the_loop(tokenizer, scorer):
    lookup = f"{HERE}:make_lookup"
    cfg = parse_config(BASE + AGENT + [
        "--agent-tools", "calculator", f"{HERE}:WORD_COUNT", lookup,
        "--agent-tool-args", json.dumps({lookup: {"table": {"pi": "3.14159"}}})])
    registry = tool_registry(cfg.agent)
    assert registry.names() == ["calculator", "word_count", "lookup"]
    assert execute_tool_call(registry, ToolCall("word_count", {"text": "a b c"})).text == "3"
    call = '<tool_call>\n{"name": "lookup", "arguments": {"key": "pi"}}\n</tool_call>'
    policy = lambda context, _: (call if "<tool_response>" not in context  # noqa: E731
                                 else "It is 3.14159<eos>")
    [[t]] = agent_rollout(_ctx(tokenizer, scorer, cfg, policy),
                          [PromptRecord("p:0", "What is pi?", "math", "3.14159")])
    text = tokenizer.decode(t.response_ids)
    assert "<tool_response>\n3.14159\n</tool_response>" in text
    assert t.metadata["counts"]["agent/tool_ok"] == 1


def test_a_bad_tool_path_or_setting_is_refused_naming_the_flag():
    for tools, args, match in (
            (["no_such_module_xyz:tool"], {}, r"--agent-tools 'no_such_module_xyz:tool': cannot "
                                              r"import module"),
            ([f"{HERE}:NOT_A_TOOL"], {}, r"--agent-tools '.*:NOT_A_TOOL': a str, neither a Tool"),
            (["calculatr"], {}, r"--agent-tools 'calculatr': neither a built-in tool "
                                r"\(calculator, python\)"),
            (["calculator"], {"calculator": {"x": 1}}, r"--agent-tool-args 'calculator': a "
                                                       r"built-in tool takes no settings"),
            ([f"{HERE}:make_lookup"], {f"{HERE}:make_lookup": {"tabel": {}}},
             r"--agent-tool-args '.*:make_lookup': .* no parameter 'tabel'"),
            (["calculator"], {f"{HERE}:make_lookup": {}}, r"--agent-tool-args '.*:make_lookup': "
                                                          r"not a tool of --agent-tools")):
        with pytest.raises(ConfigError, match=match):
            parse_config(BASE + AGENT + ["--agent-tools", *tools,
                                         "--agent-tool-args", json.dumps(args)])
    cfg = parse_config(BASE + AGENT + ["--agent-tools", f"{HERE}:make_nothing"])
    with pytest.raises(ValueError, match=r"--agent-tools '.*:make_nothing': the function "
                                         r"returned a str, not a Tool"):
        tool_registry(cfg.agent)


def test_the_sandbox_limits_are_flags_that_reach_the_python_tool():
    cfg = parse_config(BASE + AGENT + [
        "--agent-tools", "python", "--agent-sandbox-time", "2.5", "--agent-sandbox-memory-mb",
        "256", "--agent-sandbox-output-bytes", "2048", "--agent-sandbox-processes", "8"])
    assert cfg.agent.sandbox_limits() == SandboxLimits(wall_time_s=2.5, memory_mb=256,
                                                       max_output_bytes=2048, max_processes=8)
    with pytest.raises(ConfigError, match=r"--agent-sandbox-memory-mb 10: must be >= 64"):
        parse_config(BASE + AGENT + ["--agent-tools", "python", "--agent-sandbox-memory-mb", "10"])
    try:
        registry = tool_registry(cfg.agent)
    except SandboxUnavailable as e:
        pytest.skip(f"no sandbox on this host: {e}")
    tool = registry.get("python")
    assert tool is not None and "Limits: 2.5 s, 256 MiB per process." in tool.description
    result = execute_tool_call(registry, ToolCall("python", {"code": "print('x' * 5000)"}))
    assert result.outcome == "output_truncated"  # stopped past --agent-sandbox-output-bytes
    assert "more than 2048 bytes" in result.text


# -- a rollout function's needs ----------------------------------------------------------------

LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "max_position_embeddings": 131072}


def test_a_function_wrapping_agent_rollout_gets_what_agent_turns_on(tmp_path, tokenizer):
    """The same engine context (a whole episode), tool schemas in the prompts and refusal of
    routing replay as --rollout-function agent; a function that declares nothing gets none."""
    from megatron_rl.models import ModelArgs
    from megatron_rl.rollout.factory import server_configs
    from megatron_rl.runtime import prompt_builder

    args = ModelArgs.from_hf_config(LLAMA_8B)
    codec = Codec.from_tokenizer(tokenizer, chat_template=True)
    for function, agent in (("agent", True), (f"{HERE}:wrapped_agent", True),
                            (f"{HERE}:plain_rollout", False)):
        flags = BASE + ["--rollout-function", function, "--save", str(tmp_path),
                        "--max-new-tokens", "1024"]
        if agent:
            flags += ["--agent-max-tokens", "8192", "--agent-tools", "calculator",
                      f"{HERE}:WORD_COUNT"]
        cfg = parse_config(flags + ["--rollout-engine", "vllm"])
        [server] = server_configs(cfg, args, 700, cuda=False)
        assert server.max_model_len == (8192 if agent else 700 + 1024)
        tools = prompt_builder(cfg, codec).tools
        assert ([t["function"]["name"] for t in tools] if tools else None) == (
            ["calculator", "word_count"] if agent else None)
        replay = flags + ["--routing-replay"]
        if agent:
            with pytest.raises(ConfigError, match=rf"--routing-replay with --rollout-function "
                                                  rf"{function}: the engine's experts are "
                                                  rf"recorded per generate call"):
                parse_config(replay)
        else:
            assert parse_config(replay).algorithm.routing_replay


# -- agent flags nothing reads -----------------------------------------------------------------

def test_agent_flags_that_nothing_reads_are_refused_naming_them(tmp_path):
    for flags, match in (
            (["--agent-max-turns", "3", "--tool-call-format", "llama3"],
             r"--tool-call-format, --agent-max-turns set, but nothing reads them with "
             r"--rollout-function single-turn"),
            (["--rollout-function", f"{HERE}:plain_rollout", "--agent-tools", "python"],
             r"--agent-tools set, but nothing reads them with --rollout-function .*plain_rollout"),
            (AGENT + ["--agent-environment", f"{HERE}:Guess", "--agent-env-args",
                      '{"secret": 1}', "--tool-call-format", "llama3"],
             r"--tool-call-format set, but nothing reads them with --agent-environment "
             r".*:Guess"),
            (AGENT + ["--agent-env-timeout", "5"],
             r"--agent-env-timeout set, but nothing reads them with --agent-environment tools"),
            (AGENT + ["--agent-sandbox-time", "3"],
             r"--agent-sandbox-time set, but nothing reads them with --agent-environment tools "
             r"and --agent-tools calculator")):
        with pytest.raises(ConfigError, match=match):
            parse_config(BASE + flags)
    with pytest.raises(ConfigError, match=r"--agent-max-turns set, but nothing reads them"):
        parse_config(BASE + _yaml(tmp_path, "agent_max_turns: 3\n"))
    # what the agent reads is accepted; a saved run's config.json holds the defaults
    assert parse_config(BASE + AGENT + ["--agent-max-turns", "3"]).agent.agent_max_turns == 3
    assert parse_config(BASE + [f"--rollout-function={HERE}:wrapped_agent",
                                "--agent-max-turns", "3"]).agent.agent_max_turns == 3
    saved = tmp_path / "config.json"
    saved.write_text(json.dumps(config_changes.flat_config(parse_config(BASE))))
    assert parse_config(["--config", str(saved)]).agent.agent_max_turns == 4


def test_a_resume_may_drop_an_agent_setting_that_nothing_read(tmp_path):
    """A run saved with an agent setting its rollout function never read (accepted silently
    then) resumes without it, without --allow-config-change; one the run read needs it."""
    ckpt = os.path.join(str(tmp_path), "iter_0000002")
    os.makedirs(ckpt)
    saved = config_changes.flat_config(parse_config(BASE + ["--save", str(tmp_path)]))
    saved["agent_max_turns"] = 8  # single-turn: unread
    with open(os.path.join(ckpt, TRAIN_CONFIG), "w") as f:
        json.dump(saved, f)
    config_changes.check_resume(parse_config(BASE + ["--save", str(tmp_path)]), ckpt)
    with open(os.path.join(ckpt, TRAIN_CONFIG), "w") as f:
        json.dump({**saved, "rollout_function": "agent"}, f)
    with pytest.raises(ConfigError, match=r"--agent-max-turns: 8 -> 4"):
        config_changes.check_resume(parse_config(BASE + AGENT + ["--save", str(tmp_path)]), ckpt)


# -- a data row's task where an environment gives the reward -----------------------------------

def test_a_rows_task_is_free_where_an_environment_gives_the_reward(tmp_path, tokenizer, scorer):
    from megatron_rl.data.prompts import load_tokenizer
    from megatron_rl.experiments.tiny_model import make_char_tokenizer
    from megatron_rl.runtime import load_data

    directory = make_char_tokenizer(str(tmp_path / "tok"))
    train = str(tmp_path / "train.jsonl")
    write_jsonl(train, [TaskExample("Guess a number", "7", "arithmetic"),
                        TaskExample("Guess my number", "", "guess")])
    env = AGENT + ["--agent-environment", f"{HERE}:Guess", "--agent-env-args", '{"secret": 7}']
    flags = ["--hf-checkpoint", directory, "--train-data", train, "--save",
             str(tmp_path / "run"), "--max-new-tokens", "16"]
    codec = Codec.from_tokenizer(load_tokenizer(directory), chat_template=False)
    with pytest.raises(DataFormatError, match=rf"{train}:2: field 'task': unknown task 'guess'; "
                                              r"valid: .* \(any name with --agent-environment"):
        load_data(parse_config(flags), codec, 8192)
    data, _ = load_data(parse_config(flags + env), codec, 8192)
    records = {r.task: r for r in (data.record(0, i) for i in range(2))}
    assert records["guess"].text == "Guess my number"  # no task's instruction
    assert records["arithmetic"].text.startswith("Guess a number\n\nPlease reason")
    # an episode its environment ends without a reward: the task's verifier, which a free
    # task lacks, scores it 0 with reward error "error", not a crash
    cfg = parse_config(BASE + env[:-1] + ['{"secret": 7, "reward_at_end": false}'])
    [[t]] = agent_rollout(_ctx(tokenizer, scorer, cfg, lambda *_: "7<eos>"), [records["guess"]])
    assert (t.reward, t.reward_error, t.metadata["end"]) == (0.0, "error", "answer")
    check_groups([[t]], 1, 1, "agent")


def test_no_code_decides_by_the_rollout_functions_name():
    """A comparison of --rollout-function's value with a built-in's name ("agent",
    "single-turn") is behaviour a user's function wrapping that built-in would lose: it belongs
    in the function's declared needs (rollout/needs.py)."""
    import ast
    import pathlib

    package = pathlib.Path(__file__).resolve().parents[3] / "megatron_rl"
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            names = [n.value for n in (node.left, *node.comparators)
                     if isinstance(n, ast.Constant)]
            if {"agent", "single-turn"} & set(names) and "rollout_function" in ast.unparse(node):
                found.append(f"{path.relative_to(package)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "the rollout function's name decides behaviour:\n" + "\n".join(found)
