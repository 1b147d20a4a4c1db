"""Tiny random Qwen2 / Llama checkpoints in HF format, for tests, demos and CI.

They are built with `transformers` from a config (nothing is downloaded) and saved as
safetensors + config.json, exactly like a real checkpoint.
"""

from __future__ import annotations

import os

import torch

TINY_DEFAULTS = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                     rms_norm_eps=1e-6, initializer_range=0.1)


def make_tiny_hf_checkpoint(path: str, family: str = "qwen2", *, tie_word_embeddings: bool = False,
                            seed: int = 0, **overrides) -> str:
    """Write a random tiny HF checkpoint of `family` ("qwen2" or "llama") to `path`."""
    import transformers

    kwargs = {**TINY_DEFAULTS, "tie_word_embeddings": tie_word_embeddings, **overrides}
    if family == "qwen2":
        config = transformers.Qwen2Config(rope_theta=1_000_000.0, **kwargs)
        cls = transformers.Qwen2ForCausalLM
    elif family == "llama":
        config = transformers.LlamaConfig(rope_theta=500_000.0, **kwargs)
        cls = transformers.LlamaForCausalLM
    else:
        raise ValueError(f"unknown tiny model family {family!r}; valid: ['llama', 'qwen2']")
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path
