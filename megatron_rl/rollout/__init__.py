"""Rollout engines: in-process Megatron (default), vLLM and SGLang servers."""

from megatron_rl.rollout.base import Completion, RolloutEngine, SamplingParams

__all__ = ["Completion", "RolloutEngine", "SamplingParams"]
