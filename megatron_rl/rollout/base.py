"""The rollout engine contract: what the trainer asks of any generator (local, vLLM, SGLang).

Token ids in, token ids and the sampled tokens' log-probs out. Engines never see text.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Sampling settings. temperature 1.0 / top_p 1.0 / top_k -1 samples the policy itself,
    which on-policy RL requires (the paper uses exactly that)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None


@dataclasses.dataclass
class Completion:
    """One sampled response.

    token_ids: the response tokens (prompt excluded), length T.
    rollout_logprobs: log pi_rollout(token_t | prefix) of each sampled token, length T, as the
        engine computed them (under its own numerics and sampling temperature).
    finish_reason: "stop" (a stop token, included in token_ids) or "length".
    """

    token_ids: list[int]
    rollout_logprobs: list[float]
    finish_reason: str


class RolloutEngine(Protocol):
    """Any rollout engine. `generate` returns, per prompt, `n` completions."""

    weight_version: int

    def generate(self, prompts: Sequence[Sequence[int]], n: int,
                 params: SamplingParams) -> list[list[Completion]]: ...

    def update_weights(self, version: int) -> None:
        """Make the engine serve the trainer's current weights, tagged `version` (collective
        over all training ranks for engines that read them from the policy)."""
        ...

    def health(self) -> bool: ...

    def shutdown(self) -> None: ...
