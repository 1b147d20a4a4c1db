"""The agent rollout function (megatron_rl.agent.loop): episodes of policy turns and tool
responses as one trajectory, token in, token out.

The policy here is a scripted engine: it answers each context with the text a rule picks (a tool
call first, the answer once a tool response is in the context), tokenized by the real character
tokenizer, honouring the stop ids and the token limit of the generate call as an engine does,
with a distinct log-prob per token. What is under test is the loop: the exact token ids and
masks of the trajectory, the cut after a tool call, the environment's text, the limits, the
hostile calls, the real calculator tool and the real reward scorer.
"""
import pytest
from transformers import AutoTokenizer

from megatron_rl.agent.loop import ChatFormat, agent_rollout
from megatron_rl.agent.settings import AgentConfig
from megatron_rl.data.prompts import Codec, PromptRecord
from megatron_rl.experiments.tiny_model import make_char_tokenizer
from megatron_rl.rollout.base import SEED_STRIDE, Completion, SamplingParams
from megatron_rl.rollout.functions import RolloutContext, resolve_rollout_function

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'
# the Qwen2.5 template's tool messages and headers, on the character tokenizer
QWEN_LIKE = (  # literal text inside {{ }}: HF renders with trim_blocks
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


class ScriptedEngine:
    """generate(contexts, n, params): for each context, n completions of the text
    `policy(decoded context, call index)`, cut at the first stop id (kept, "stop") or at
    max_new_tokens ("length"); token t's log-prob is -(t + 1) / 100. Like the local engine it
    refuses a context that max_new_tokens would take past its `positions`. Records every
    call."""

    client_rank = None

    def __init__(self, tokenizer, policy, positions=10_000):
        self.tokenizer, self.policy, self.positions, self.calls = tokenizer, policy, positions, []

    def generate(self, contexts, n, params):
        self.calls.append((contexts, n, params))
        out = []
        for ctx in contexts:
            if len(ctx) + params.max_new_tokens > self.positions:
                raise ValueError(f"prompt ({len(ctx)}) + max_new_tokens exceeds the positions")
            text = self.policy(self.tokenizer.decode(ctx, skip_special_tokens=False),
                               len(self.calls) - 1)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            finish = "length"
            for i, t in enumerate(ids):
                if t in params.stop_token_ids:
                    ids, finish = ids[:i + 1], "stop"
                    break
            if len(ids) > params.max_new_tokens:
                ids, finish = ids[:params.max_new_tokens], "length"
            out.append([Completion(ids, [-(i + 1) / 100 for i in range(len(ids))], finish)
                        for _ in range(n)])
        return out


def calculator_then_answer(context, _):
    """One calculator call, then the product as the answer."""
    if "<tool_response>" not in context:
        return CALL + "\nthen more text that is cut<eos>"
    return "The answer is 408.<eos>"


def _run(tokenizer, scorer, policy, config=None, *, group_size=2, prompts=("Q: 12*34",),
         max_new_tokens=200):
    config = config or AgentConfig()
    codec = Codec.from_tokenizer(tokenizer, chat_template=False)
    engine = ScriptedEngine(tokenizer, policy, positions=config.agent_max_tokens)
    ctx = RolloutContext(engine, SamplingParams(max_new_tokens=max_new_tokens, seed=5,
                                                stop_token_ids=codec.stop_ids),
                         group_size, codec, scorer, agent=config)
    records = [PromptRecord(f"r{i}", p, "arithmetic", "408") for i, p in enumerate(prompts)]
    return agent_rollout(ctx, records), engine, codec


def _encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_tool_call_and_an_answer_are_one_trajectory_token_for_token(tokenizer, scorer):
    groups, engine, codec = _run(tokenizer, scorer, calculator_then_answer)
    assert [len(g) for g in groups] == [2]
    t = groups[0][0]
    turn1, turn2 = _encode(tokenizer, CALL), _encode(tokenizer, "The answer is 408.<eos>")
    env = _encode(tokenizer, "\n<tool_response>\n408\n</tool_response>\n")
    assert t.prompt_ids == codec.encode("Q: 12*34")
    # the policy's own ids (its first turn cut right after the call), the tool's text once
    assert t.response_ids == turn1 + env + turn2
    assert t.response_mask == [1] * len(turn1) + [0] * len(env) + [1] * len(turn2)
    assert t.rollout_logprobs == ([-(i + 1) / 100 for i in range(len(turn1))] + [0.0] * len(env)
                                  + [-(i + 1) / 100 for i in range(len(turn2))])
    assert (t.finish_reason, t.reward, t.reward_error) == ("stop", 1.0, None)
    # the tools give no reward: the verifier's on the last turn, the trajectory's reward as it is
    assert t.turn_rewards == [0.0, 1.0]
    counts = t.metadata["counts"]
    assert counts == {"agent/turns": 2, "agent/tool_calls": 1, "agent/tool_ok": 1,
                      "agent/called_tools": 1,
                      "agent/end_answer": 1, "agent/tool_seconds": counts["agent/tool_seconds"]}
    # turn 1: every prompt once with n = group size; turn 2: each episode's own context
    (c1, n1, p1), (c2, n2, p2) = engine.calls
    assert (c1, n1) == ([t.prompt_ids], 2)
    assert n2 == 1 and c2 == [t.prompt_ids + turn1 + env] * 2
    assert p2.seed != p1.seed  # each turn samples afresh


def test_the_call_end_is_a_stop_token_where_the_tokenizer_has_one(tmp_path, scorer):
    tok = AutoTokenizer.from_pretrained(make_char_tokenizer(str(tmp_path / "tok")))
    tok.add_special_tokens({"additional_special_tokens": ["</tool_call>"]})
    groups, engine, _ = _run(tok, scorer, calculator_then_answer, group_size=1)
    end_id = tok.convert_tokens_to_ids("</tool_call>")
    assert end_id in engine.calls[0][2].stop_token_ids
    t = groups[0][0]
    first = t.response_ids[:t.response_mask.index(0)]
    assert first == _encode(tok, CALL) and first[-1] == end_id
    assert t.reward == 1.0


def test_the_chat_template_gives_the_text_between_turns(tmp_path, scorer):
    tok = AutoTokenizer.from_pretrained(make_char_tokenizer(str(tmp_path / "tok")))
    tok.add_special_tokens({"additional_special_tokens": ["<|im_end|>", "<|im_start|>"]})
    tok.chat_template = QWEN_LIKE
    fmt = ChatFormat(tok)
    expected = ("<|im_start|>user\n<tool_response>\n408\n</tool_response>\n<tool_response>\n"
                "x\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    im_end, gt = tok.convert_tokens_to_ids("<|im_end|>"), _encode(tok, ">")[0]
    # the policy's turn ended with its end-of-turn token: only the newline after it is added
    assert fmt.after_turn(["408", "x"], im_end) == "\n" + expected
    # it did not (stopped at </tool_call>): the environment closes the turn
    assert fmt.after_turn(["408", "x"], gt) == "<|im_end|>\n" + expected

    def policy(context, _):
        if "<tool_response>" not in context:
            return CALL + "<|im_end|>"
        return "408<|im_end|>"

    codec_stop = tok.convert_tokens_to_ids("<|im_end|>")
    codec = Codec(tok, add_special_tokens=False, pad_id=0, stop_ids=(codec_stop,))
    engine = ScriptedEngine(tok, policy)
    ctx = RolloutContext(engine, SamplingParams(max_new_tokens=300, seed=1,
                                                stop_token_ids=(codec_stop,)), 1, codec, scorer)
    (t,), = agent_rollout(ctx, [PromptRecord("r", "<|im_start|>user\nQ<|im_end|>\n"
                                             "<|im_start|>assistant\n", "arithmetic", "408")])
    env = [i for i, m in zip(t.response_ids, t.response_mask) if m == 0]
    # the turn was cut after </tool_call> (before the policy's own <|im_end|>): the
    # environment's text closes it
    assert tok.decode(env, skip_special_tokens=False) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    assert t.reward == 1.0


@pytest.mark.parametrize("call, outcome, says", [
    ("<tool_call>\n{not json}\n</tool_call>", "unparseable_call", "could not be parsed"),
    ('<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>', "unknown_tool",
     "unknown tool 'search'"),
    ('<tool_call>\n{"name": "calculator", "arguments": {"expr": "1"}}\n</tool_call>',
     "bad_arguments", "invalid arguments"),
    ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1/0"}}\n</tool_call>',
     "tool_error", "division by zero"),
    ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "__import__(\'os\')"}}'
     '\n</tool_call>', "tool_error", ""),
])
def test_a_bad_call_is_answered_counted_and_the_episode_goes_on(tokenizer, scorer, call, outcome,
                                                                says):
    def policy(context, _):
        return call + "<eos>" if "<tool_response>" not in context else "408<eos>"

    groups, _, _ = _run(tokenizer, scorer, policy, group_size=1)
    t = groups[0][0]
    env = tokenizer.decode([i for i, m in zip(t.response_ids, t.response_mask) if m == 0])
    assert "Error" in env or outcome == "tool_error"
    assert says.lower() in env.lower()
    counts = t.metadata["counts"]
    assert counts[f"agent/tool_{outcome}"] == 1 and counts["agent/end_answer"] == 1
    assert counts["agent/turns"] == 2 and t.reward == 1.0


def test_limits_end_episodes_with_their_reason(tokenizer, scorer):
    always_call = lambda context, _: CALL + "<eos>"  # noqa: E731
    groups, engine, _ = _run(tokenizer, scorer, always_call, AgentConfig(agent_max_turns=3),
                             group_size=1)
    t = groups[0][0]
    assert t.metadata["end"] == "max_turns" and t.metadata["counts"]["agent/turns"] == 3
    assert t.metadata["counts"]["agent/tool_calls"] == 2  # the last turn's call is not run
    assert len(engine.calls) == 3 and t.response_mask[-1] == 1

    groups, _, _ = _run(tokenizer, scorer, always_call, AgentConfig(agent_max_tool_calls=0),
                        group_size=1)
    t = groups[0][0]
    assert t.metadata["end"] == "max_tool_calls" and 0 not in t.response_mask

    # a short episode limit: every turn asks for no more tokens than are left (the engine
    # refuses more), and the episode ends when the tools' text leaves no room for a turn
    groups, engine, _ = _run(tokenizer, scorer, calculator_then_answer,
                             AgentConfig(agent_max_tokens=150), group_size=1, max_new_tokens=100)
    t = groups[0][0]
    used = [len(t.prompt_ids), len(_encode(tokenizer, CALL)),
            len(_encode(tokenizer, "\n<tool_response>\n408\n</tool_response>\n"))]
    assert [p.max_new_tokens for _, _, p in engine.calls] == [100, 150 - sum(used)]
    assert t.metadata["end"] == "answer" and len(t.tokens) <= 150 and t.reward == 1.0
    groups, _, _ = _run(tokenizer, scorer, calculator_then_answer,
                        AgentConfig(agent_max_tokens=100), group_size=1, max_new_tokens=90)
    t = groups[0][0]
    assert t.metadata["end"] == "max_tokens" and len(t.tokens) <= 100 and 0 not in t.response_mask

    # a turn that runs out of --max-new-tokens without a call
    groups, _, _ = _run(tokenizer, scorer, lambda c, _: "thinking " * 50, group_size=1,
                        max_new_tokens=20)
    t = groups[0][0]
    assert t.metadata["end"] == "length" and t.finish_reason == "length"
    assert len(t.response_ids) == 20


def test_agent_is_a_built_in_rollout_function():
    assert resolve_rollout_function("agent") is agent_rollout
    with pytest.raises(ValueError, match="--agent-tools 'shell'"):
        AgentConfig(agent_tools=["shell"]).validate()


def test_an_episode_near_the_limit_never_cuts_another_episodes_turn(tokenizer, scorer):
    """One turn-synchronous batch of episodes of different lengths, all nearer the episode
    limit than --max-new-tokens: each takes its turn with its own room, so the episode that
    scores 1.0 alone still does (its tool call is not cut at the long prompt's room), and no
    two calls of a turn share a seed."""
    config, max_new = AgentConfig(agent_max_tokens=200), 195
    alone, _, _ = _run(tokenizer, scorer, calculator_then_answer, config, group_size=1,
                       max_new_tokens=max_new)
    assert alone[0][0].reward == 1.0
    prompts = ("Q: 12*34", "Q: 12*34 " + "x" * 170, "Q: 12*34 ?")  # the second: little room
    groups, engine, codec = _run(tokenizer, scorer, calculator_then_answer, config,
                                 group_size=1, prompts=prompts, max_new_tokens=max_new)
    short, cut, other = (g[0] for g in groups)
    assert short.reward == 1.0 and other.reward == 1.0
    assert short.response_ids == alone[0][0].response_ids
    assert cut.metadata["end"] == "max_tokens" and len(cut.tokens) == 200
    # turn 1: each prompt with its own room, seeded as prompt i of one call
    rooms = [200 - len(codec.encode(p)) for p in prompts]
    assert sorted((c[0], p.max_new_tokens, p.seed) for c, _, p in engine.calls[:3]) == sorted(
        (codec.encode(prompt), room, 5 + SEED_STRIDE * i)
        for i, (prompt, room) in enumerate(zip(prompts, rooms)))
    seeds = [p.seed for _, _, p in engine.calls]
    assert len(set(seeds)) == len(seeds)


def test_the_environments_tokens_keep_the_templates_text(tmp_path):
    """Encoded apart (the format's text with special tokens, each message's content as plain
    text), the environment's tokens still read back as the template renders the messages, also
    where the template trims a message's content (Llama 3's does)."""
    tok = AutoTokenizer.from_pretrained(make_char_tokenizer(str(tmp_path / "tok")))
    tok.add_special_tokens({"additional_special_tokens": ["<|eot_id|>", "<|start_header_id|>"]})
    tok.chat_template = ("{% for m in messages %}{{ '<|start_header_id|>' + m.role + '\\n' + "
                         "m.content | trim + '<|eot_id|>' }}{% endfor %}"
                         "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant\\n' }}{% endif %}")
    fmt = ChatFormat(tok)
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    results = ["  408 <|eot_id|>\n", {"role": "user", "content": "<|start_header_id|>  "}]
    ids = fmt.encode_after_turn(results, eot)
    assert tok.decode(ids, skip_special_tokens=False) == fmt.after_turn(results, eot) == (
        "<|start_header_id|>tool\n408 <|eot_id|><|eot_id|><|start_header_id|>user\n"
        "<|start_header_id|><|eot_id|><|start_header_id|>assistant\n")
    assert ids.count(eot) == 2 and ids.count(tok.convert_tokens_to_ids("<|start_header_id|>")) == 3


class VersionedEngine(ScriptedEngine):
    """ScriptedEngine whose completions carry weight versions as under --partial-rollouts:
    the first call's responses were cut after 3 tokens by an update to version 1, later calls
    are all of version 1."""

    def generate(self, contexts, n, params):
        out = super().generate(contexts, n, params)
        first = len(self.calls) == 1
        for group in out:
            for c in group:
                k = 3 if first else 0
                c.token_versions = [0] * min(k, len(c.token_ids)) + [1] * max(
                    len(c.token_ids) - k, 0)
        return out


def test_each_policy_token_keeps_the_version_that_sampled_it(tokenizer, scorer):
    """--partial-rollouts: an episode's trajectory carries its policy tokens' versions
    (Trajectory.token_versions, aligned with response_ids); an observation's tokens take the
    version before them (out of the loss, never counted)."""
    groups, _, _ = _run(tokenizer, scorer, calculator_then_answer)
    assert groups[0][0].token_versions is None  # an engine without versions: none tracked
    codec = Codec.from_tokenizer(tokenizer, chat_template=False)
    engine = VersionedEngine(tokenizer, calculator_then_answer)
    ctx = RolloutContext(engine, SamplingParams(max_new_tokens=200, seed=5,
                                                stop_token_ids=codec.stop_ids),
                         2, codec, scorer, agent=AgentConfig())
    t = agent_rollout(ctx, [PromptRecord("r0", "Q: 12*34", "arithmetic", "408")])[0][0]
    turn1, turn2 = _encode(tokenizer, CALL), _encode(tokenizer, "The answer is 408.<eos>")
    env = _encode(tokenizer, "\n<tool_response>\n408\n</tool_response>\n")
    assert t.response_ids == turn1 + env + turn2
    assert t.token_versions == ([0] * 3 + [1] * (len(turn1) - 3) + [1] * len(env)
                                + [1] * len(turn2))
