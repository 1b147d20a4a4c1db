"""Policy models: megatron-core GPT built from HF configs, and the HF <-> Megatron mapping."""

from megatron_rl.models.config import ModelArgs, transformer_config
from megatron_rl.models.gpt import build_gpt_model, layer_spec

__all__ = ["ModelArgs", "transformer_config", "build_gpt_model", "layer_spec"]
