"""Tiny random Qwen2 / Qwen3 / Qwen3-MoE / Llama checkpoints in HF format, for tests, demos and CI.

They are built with `transformers` from a config (nothing is downloaded) and saved as
safetensors + config.json, exactly like a real checkpoint.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch

TINY_DEFAULTS = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                     rms_norm_eps=1e-6, initializer_range=0.1)
# qwen3_moe: 4 experts of 48, top-2 renormalised, layer 1 (of the 4 default layers) dense
TINY_MOE_DEFAULTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                         norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1])


def make_tiny_hf_checkpoint(path: str, family: str = "qwen2", *, tie_word_embeddings: bool = False,
                            seed: int = 0, **overrides) -> str:
    """Write a random tiny HF checkpoint of `family` ("qwen2", "qwen3", "qwen3_moe" or "llama")
    to `path`. qwen3_moe takes TINY_MOE_DEFAULTS unless overridden: sparse and dense layers
    mixed, so that both kinds are covered."""
    import transformers

    kwargs = {**TINY_DEFAULTS, "tie_word_embeddings": tie_word_embeddings, **overrides}
    # transformers 5 takes rope_theta through **kwargs (into rope_parameters); its signatures no
    # longer name it, hence the pyright ignores below
    if family == "qwen2":
        config = transformers.Qwen2Config(
            rope_theta=1_000_000.0, **kwargs)  # pyright: ignore[reportCallIssue]
        cls = transformers.Qwen2ForCausalLM
    elif family == "qwen3":  # q/k norms, no qkv bias, head_dim independent of hidden / heads
        kwargs.setdefault("head_dim", 2 * kwargs["hidden_size"] // kwargs["num_attention_heads"])
        config = transformers.Qwen3Config(
            rope_theta=1_000_000.0, **kwargs)  # pyright: ignore[reportCallIssue]
        cls = transformers.Qwen3ForCausalLM
    elif family == "qwen3_moe":  # qwen3 attention; a router and experts in the sparse layers
        kwargs = {**TINY_MOE_DEFAULTS, **kwargs}
        kwargs.setdefault("head_dim", 2 * kwargs["hidden_size"] // kwargs["num_attention_heads"])
        config = transformers.Qwen3MoeConfig(
            rope_theta=1_000_000.0, **kwargs)  # pyright: ignore[reportCallIssue]
        cls = transformers.Qwen3MoeForCausalLM
    elif family == "llama":
        config = transformers.LlamaConfig(
            rope_theta=500_000.0, **kwargs)  # pyright: ignore[reportCallIssue]
        cls = transformers.LlamaForCausalLM
    else:
        raise ValueError(f"unknown tiny model family {family!r}; valid: ['llama', 'qwen2', "
                         "'qwen3', 'qwen3_moe']")
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


CHAR_SPECIALS = ("<pad>", "<eos>", "<unk>")


# the tests' end-to-end model: small enough for a 2-core CI, TP2-splittable (4 heads, 2 KV groups)
CHAR_MODEL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                  eos_token_id=1, pad_token_id=0)


def make_char_model(path: str, seed: int = 0, family: str = "qwen2", **overrides) -> str:
    """A random tiny model of `family` (CHAR_MODEL's sizes, with `overrides`; "qwen3_moe" adds
    its experts) and the character tokenizer at `path`."""
    kwargs = {**CHAR_MODEL, **overrides}
    tied = kwargs.pop("tie_word_embeddings")
    make_tiny_hf_checkpoint(path, family, tie_word_embeddings=tied, seed=seed, **kwargs)
    make_char_tokenizer(path, vocab_size=kwargs["vocab_size"])
    return path


def make_char_tokenizer(path: str, vocab_size: int = 128, special: Sequence[str] = ()) -> str:
    """Save a character-level HF tokenizer (printable ASCII + newline, one token per character;
    <pad>=0, <eos>=1, <unk>=2) to `path`, padded to `vocab_size` entries. `special`: strings
    that are one token each, after the characters (e.g. "</tool_call>", so that generation can
    stop on it as on Qwen's).

    It is a byte-level BPE without merges, the kind of tokenizer Qwen2's is: transformers loads
    a directory whose config.json says qwen2 as Qwen2Tokenizer whatever tokenizer_config.json
    names, and Qwen2Tokenizer rebuilds the byte-level pre-tokenizer and decoder around the
    saved vocabulary. Each character's token is its byte in the byte-level alphabet (" " is
    "Ġ", "\n" is "Ċ"), so that tokenizer, like the one saved here, keeps every space and
    newline and gives each character the same id."""
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_char = bytes_to_unicode()
    chars = sorted(set(string.printable) - set("\t\r\x0b\x0c"))
    vocab = {t: i for i, t in enumerate(CHAR_SPECIALS)}
    for c in chars:
        vocab[byte_char[ord(c)]] = len(vocab)
    for t in special:
        vocab[t] = len(vocab)
    if len(vocab) > vocab_size:
        raise ValueError(f"character vocabulary needs {len(vocab)} entries > {vocab_size}")
    for i in range(len(vocab), vocab_size):
        vocab[f"<unused{i}>"] = i
    tok = Tokenizer(models.BPE(vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")
    if special:
        fast.add_special_tokens({"additional_special_tokens": list(special)})
    os.makedirs(path, exist_ok=True)
    fast.save_pretrained(path)
    return path


def make_demo_model(path: str, special: Sequence[str] = (), seed: int = 0) -> str:
    """The CPU demos' untrained model at `path`: a Qwen2-architecture model of 4 layers, hidden
    128, 4 heads over 2 KV groups, 256 positions, tied embeddings, initialised with `seed`, with
    the character tokenizer (and `special`, see make_char_tokenizer)."""
    make_tiny_hf_checkpoint(path, "qwen2", vocab_size=128, hidden_size=128, intermediate_size=384,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=256, initializer_range=0.02,
                            tie_word_embeddings=True, eos_token_id=1, pad_token_id=0, seed=seed)
    make_char_tokenizer(path, special=special)
    return path


TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


def make_tool_caller_model(path: str, tool: str, *, margin: float = 20.0,
                           max_position_embeddings: int = 1024) -> str:
    """A tiny Qwen2 model (and its character tokenizer) at `path` that calls `tool` (no
    arguments) at every turn, in the qwen format: after "=" (a prompt's end), "\\n" or ">" (the
    end of a tool response) it writes "<tool_call>", then '{"name": <tool>, "arguments": {}}', then
    "</tool_call>", each one token (special tokens of the tokenizer), and after any other token
    it writes <eos>.

    The weights make it a bigram machine: the attention and MLP outputs are zero, so the last
    hidden state is the current token's embedding; the embeddings are orthonormal (vocabulary
    128 = hidden size), and the untied output layer gives the next token of the rule a logit
    `margin` above all others (0), so it is sampled with probability 1 - 127 exp(-margin) at
    temperature 1. A policy whose episodes are fixed, for measuring and testing how episodes
    are scheduled (tools/bench_agent.py) on the real decoder."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    body = '{"name": "%s", "arguments": {}}' % tool
    vocab = hidden = 128
    make_tiny_hf_checkpoint(path, "qwen2", vocab_size=vocab, hidden_size=hidden,
                            intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2,
                            max_position_embeddings=max_position_embeddings,
                            tie_word_embeddings=False, eos_token_id=1, pad_token_id=0)
    make_char_tokenizer(path, vocab_size=vocab, special=(TOOL_CALL_OPEN, body, TOOL_CALL_CLOSE))
    tok = AutoTokenizer.from_pretrained(path)
    ids = {s: tok.convert_tokens_to_ids(s) for s in (TOOL_CALL_OPEN, body, TOOL_CALL_CLOSE)}
    rule = {tok(c, add_special_tokens=False)["input_ids"][0]: ids[TOOL_CALL_OPEN] for c in "=\n>"}
    rule.update({ids[TOOL_CALL_OPEN]: ids[body], ids[body]: ids[TOOL_CALL_CLOSE]})
    weights_path = os.path.join(path, "model.safetensors")
    state = load_file(weights_path)
    torch.manual_seed(0)
    emb = torch.linalg.qr(torch.randn(hidden, hidden))[0][:vocab]  # orthonormal rows
    head = torch.zeros(vocab, hidden)
    for x in range(vocab):  # RMSNorm(e_x) = sqrt(hidden) e_x: logit_y = margin where y = next(x)
        head[rule.get(x, 1)] += margin / hidden ** 0.5 * emb[x]
    for name in state:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            state[name] = torch.zeros_like(state[name])
    state["model.embed_tokens.weight"], state["lm_head.weight"] = emb.contiguous(), head
    save_file(state, weights_path, metadata={"format": "pt"})
    return path
