"""The agent loop under the chat templates that models ship: Qwen3 (hybrid thinking), Llama 3.1
and Llama 3.2, the Jinja text of their tokenizer_config.json (fixtures/README.md says where
each comes from), on the character tokenizer with each model's special tokens, EOS and
generation_config.json, so that the tests run offline.

Each episode runs through agent_rollout with test_agent_loop's scripted engine (the text a rule
picks for each context, the stop ids and token limits honoured, log-prob -(t + 1) / 100 for the
t-th token of a turn) and the real tools, environments and scorer. What a user relies on: the
policy's tokens are what the engine sampled, and the environment's text between turns is what
the model's template writes there, with one end of turn, whatever the template renders before.
"""
import datetime
import json
from dataclasses import dataclass
from pathlib import Path

from test_agent_loop import ScriptedEngine

from megatron_rl.agent.env import Environment, StepResult
from megatron_rl.agent.loop import agent_rollout
from megatron_rl.agent.settings import AgentConfig, tool_registry
from megatron_rl.data.prompts import Codec, PromptRecord, load_tokenizer
from megatron_rl.experiments.tiny_model import make_char_tokenizer
from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout.functions import RolloutContext

FIXTURES = Path(__file__).parent / "fixtures"
HERE = __name__


@dataclass(frozen=True)
class Shipped:
    """What a model ships that the loop reads: its chat template (a file of fixtures/), its
    special tokens, its other added tokens (one token each), BOS and EOS, and the EOS ids of
    its generation_config.json."""

    template: str
    special: tuple[str, ...]
    added: tuple[str, ...]
    bos: str | None
    eos: str
    generation_eos: tuple[str, ...]


LLAMA3_SPECIAL = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>")
LLAMA3_EOS = ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")
SHIPPED = {
    "qwen3": Shipped("qwen3.jinja", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
                     ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                      "<think>", "</think>"), None, "<|im_end|>", ("<|im_end|>", "<|endoftext|>")),
    "llama3.1": Shipped("llama3.1.jinja", LLAMA3_SPECIAL, (), "<|begin_of_text|>", "<|eot_id|>",
                        LLAMA3_EOS),
    "llama3.2": Shipped("llama3.2.jinja", LLAMA3_SPECIAL, (), "<|begin_of_text|>", "<|eot_id|>",
                        LLAMA3_EOS),
}


def shipped_tokenizer(path: Path, name: str):
    """A checkpoint directory's tokenizer as a run loads it: the character tokenizer with model
    `name`'s template, tokens, BOS and EOS, beside its generation_config.json."""
    s = SHIPPED[name]
    tok = load_tokenizer(make_char_tokenizer(str(path), special=s.special))
    tok.add_tokens(list(s.added))
    tok.chat_template = (FIXTURES / s.template).read_text()
    tok.eos_token, tok.bos_token = s.eos, s.bos
    tok.save_pretrained(str(path))
    (path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [tok.convert_tokens_to_ids(t) for t in s.generation_eos]}))
    return load_tokenizer(path)


def _episode(tok, scorer, policy, config: AgentConfig, prompt: str):
    """One episode of `policy` on `prompt`: its trajectory and the scripted engine."""
    codec = Codec.from_tokenizer(tok, chat_template=True)
    engine = ScriptedEngine(tok, policy)
    ctx = RolloutContext(engine, SamplingParams(max_new_tokens=200, seed=5,
                                                stop_token_ids=codec.stop_ids),
                         1, codec, scorer, agent=config)
    (t,), = agent_rollout(ctx, [PromptRecord("r", prompt, "arithmetic", "408")])
    return t, engine


def _segments(tok, t) -> list[tuple[int, str]]:
    """The trajectory's response as (mask, text) runs: the policy's turns (1) and the
    environment's text (0), special tokens kept."""
    runs: list[tuple[int, list[int]]] = []
    for i, m in zip(t.response_ids, t.response_mask):
        if runs and runs[-1][0] == m:
            runs[-1][1].append(i)
        else:
            runs.append((m, [i]))
    return [(m, tok.decode(ids, skip_special_tokens=False)) for m, ids in runs]


def _sampled(t) -> bool:
    """Whether every policy token carries the engine's log-prob (-(k + 1) / 100 for the k-th
    token of its turn) and every environment token 0."""
    k, ok = 0, True
    for m, lp in zip(t.response_mask, t.rollout_logprobs):
        k = k + 1 if m else 0
        ok &= lp == (-k / 100 if m else 0.0)
    return ok


def _prompt(tok, config: AgentConfig) -> str:
    return tok.apply_chat_template([{"role": "user", "content": "What is 12*34?"}],
                                   tools=tool_registry(config).schemas(), tokenize=False,
                                   add_generation_prompt=True)


def test_qwen3_a_tool_response_follows_a_thinking_turn(tmp_path, scorer):
    """Qwen3's template gives the last assistant message an empty think block that it drops
    once a tool message follows; the text between the turns is still the template's."""
    tok = shipped_tokenizer(tmp_path, "qwen3")
    config = AgentConfig()
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'

    def policy(context, _):
        if "<tool_response>" not in context:
            return "<think>\nMultiply.\n</think>\n\n" + call + "<|im_end|>"
        return "<think>\n\n</think>\n\nThe answer is 408.<|im_end|>"

    t, _ = _episode(tok, scorer, policy, config, _prompt(tok, config))
    assert _segments(tok, t) == [
        (1, "<think>\nMultiply.\n</think>\n\n" + call),  # stopped at </tool_call>
        (0, "<|im_end|>\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n"),
        (1, "<think>\n\n</think>\n\nThe answer is 408.<|im_end|>")]
    assert _sampled(t)
    assert (t.reward, t.metadata["end"]) == (1.0, "answer")


def test_llama31_a_tool_call_turn_ends_at_eom_with_one_end_of_turn(tmp_path, scorer):
    """Llama 3.1 ends a tool-call turn with <|eom_id|>, an EOS id of its generation_config.json
    but not its tokenizer's: generation stops there, and the tool's message follows it
    without a second end of turn (<|eot_id|>)."""
    tok = shipped_tokenizer(tmp_path, "llama3.1")
    config = AgentConfig(tool_call_format="llama3")
    call = '{"name": "calculator", "parameters": {"expression": "12*34"}}'

    def policy(context, _):
        if "ipython<|end_header_id|>\n\n\"408\"" not in context:
            return call + "<|eom_id|>more text<|eot_id|>"
        return "The answer is 408.<|eot_id|>"

    t, engine = _episode(tok, scorer, policy, config, _prompt(tok, config))
    assert tok.convert_tokens_to_ids("<|eom_id|>") in engine.calls[0][2].stop_token_ids
    assert _segments(tok, t) == [
        (1, call + "<|eom_id|>"),
        (0, '<|start_header_id|>ipython<|end_header_id|>\n\n"408"<|eot_id|>'
            "<|start_header_id|>assistant<|end_header_id|>\n\n"),
        (1, "The answer is 408.<|eot_id|>")]
    assert _sampled(t)
    assert (t.reward, t.metadata["end"]) == (1.0, "answer")


def test_the_stop_ids_are_the_generation_configs_eos_ids(tmp_path):
    ids = {}
    for name in ("qwen3", "llama3.1"):
        tok = shipped_tokenizer(tmp_path / name, name)
        ids[name] = (Codec.from_tokenizer(tok, chat_template=True).stop_ids,
                     tuple(sorted(tok.convert_tokens_to_ids(list(SHIPPED[name].generation_eos)))))
    assert ids["qwen3"][0] == ids["qwen3"][1]  # <|im_end|> (the tokenizer's EOS), <|endoftext|>
    assert ids["llama3.1"][0] == ids["llama3.1"][1]  # <|end_of_text|>, <|eom_id|>, <|eot_id|>


class Higher(Environment):
    """"higher" until the policy's turn says 42 (reward 1, done)."""

    def reset(self, record):
        return None

    def step(self, turn):
        if "42" in turn:
            return StepResult(reward=1.0, done=True)
        return StepResult("higher")


def test_a_turn_cut_after_a_less_than_sign_still_gets_its_end_of_turn(tmp_path, scorer):
    """The end of a turn is told by token: a turn that ran out of tokens after "<" is closed
    by the environment with the whole <|eot_id|>."""
    tok = shipped_tokenizer(tmp_path, "llama3.1")
    config = AgentConfig(agent_environment=f"{HERE}:Higher")
    turns = ["7 <", "42<|eot_id|>"]
    prompt = tok.apply_chat_template([{"role": "user", "content": "Guess:"}], tokenize=False,
                                     add_generation_prompt=True)
    t, _ = _episode(tok, scorer, lambda _, call: turns[call], config, prompt)
    assert _segments(tok, t) == [
        (1, "7 <"),
        (0, "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nhigher<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n"),
        (1, "42<|eot_id|>")]
    assert (t.reward, t.metadata["end"]) == (1.0, "answer")


class Clock:
    """transformers' datetime as the chat template's strftime_now reads it: now() is `today`."""

    today = datetime.datetime(2026, 11, 28, 23, 59, 59)

    @classmethod
    def now(cls, tz=None):
        return cls.today


class PastMidnight(Higher):
    """Higher, each step taking the clock to the next day."""

    def step(self, turn):
        Clock.today += datetime.timedelta(days=1)
        return super().step(turn)


def test_llama32_an_episode_that_crosses_midnight(tmp_path, scorer, monkeypatch):
    """Llama 3.2's template writes today's date in the system header; an episode whose
    environment answers after midnight still gets the template's text between the turns."""
    from transformers.utils import chat_template_utils

    monkeypatch.setattr(chat_template_utils, "datetime", Clock)
    monkeypatch.setattr(Clock, "today", Clock.today)
    tok = shipped_tokenizer(tmp_path, "llama3.2")
    config = AgentConfig(agent_environment=f"{HERE}:PastMidnight")
    turns = ["7<|eot_id|>", "42<|eot_id|>"]
    prompt = tok.apply_chat_template([{"role": "user", "content": "Guess:"}], tokenize=False,
                                     add_generation_prompt=True)
    assert "Today Date: 28 Nov 2026" in prompt
    t, _ = _episode(tok, scorer, lambda _, call: turns[call], config, prompt)
    assert _segments(tok, t) == [
        (1, "7<|eot_id|>"),
        (0, "<|start_header_id|>user<|end_header_id|>\n\nhigher<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n"),
        (1, "42<|eot_id|>")]
    assert Clock.today.day == 30 and (t.reward, t.metadata["end"]) == (1.0, "answer")

