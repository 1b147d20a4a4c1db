"""megatron-rl: RL post-training of LLMs with correct KL regularization, on megatron-core."""

__version__ = "0.1.0"
