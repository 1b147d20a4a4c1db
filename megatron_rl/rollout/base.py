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


def check_completions(out, num_prompts: int, n: int, vocab_size: int | None,
                      max_new_tokens: int) -> None:
    """Raise ValueError, naming the first problem, unless `out` is what a generate call for
    `num_prompts` prompts x `n` must return: n completions per prompt, token ids in
    [0, vocab_size), one finite log-prob <= 0 per token, at most max_new_tokens tokens."""
    if not isinstance(out, list) or len(out) != num_prompts:
        raise ValueError(f"{len(out) if isinstance(out, list) else type(out).__name__} groups "
                         f"for {num_prompts} prompts")
    for i, group in enumerate(out):
        if len(group) != n:
            raise ValueError(f"prompt {i}: {len(group)} completions, asked for n={n}")
        for j, c in enumerate(group):
            where = f"prompt {i} completion {j}"
            if len(c.token_ids) > max_new_tokens:
                raise ValueError(f"{where}: {len(c.token_ids)} tokens > max_new_tokens "
                                 f"{max_new_tokens}")
            if len(c.rollout_logprobs) != len(c.token_ids):
                raise ValueError(f"{where}: {len(c.rollout_logprobs)} log-probs for "
                                 f"{len(c.token_ids)} tokens")
            bad = [t for t in c.token_ids if not isinstance(t, int) or t < 0
                   or (vocab_size is not None and t >= vocab_size)]
            if bad:
                raise ValueError(f"{where}: token id {bad[0]} outside the vocabulary "
                                 f"[0, {vocab_size})")
            lp = [x for x in c.rollout_logprobs if not (x == x and x <= 1e-4 and x > -1e30)]
            if lp:
                raise ValueError(f"{where}: log-prob {lp[0]} is not a finite value <= 0")
            if c.finish_reason not in ("stop", "length"):
                raise ValueError(f"{where}: finish reason {c.finish_reason!r}")
