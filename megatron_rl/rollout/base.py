"""The rollout engine contract: what the trainer asks of any generator (local, vLLM, SGLang).

Token ids in, token ids and the sampled tokens' log-probs out. Engines never see text.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Callable, ClassVar, Protocol, Sequence, TypeVar

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


class ServerError(RuntimeError):
    """The server could not be started, died, or failed a request after a restart."""


class BadAnswer(ServerError):
    """The server answered a generate request, but not with what was asked (malformed JSON,
    fewer completions, token ids outside the vocabulary, no answer within the timeout)."""


@dataclasses.dataclass(kw_only=True)
class EngineConfig:
    """What every engine with weights of its own is configured with.

    work_dir: its logs and disk weight exports live here.
    dtype: the dtype it computes in ("float32", "bfloat16"); synced weights are cast to it.
    seed: its sampling seed where a request brings none.
    sync: how weights reach it (weight_sync.WeightSync: "disk", "tensor", "distributed").
    bucket_bytes: the most bytes one shared-memory or NCCL bucket of a sync names.
    startup_timeout / request_timeout: seconds to wait for it to start / to answer a request.
    partial_rollouts: a weight update cuts the responses in flight, which go on under the new
        weights (--partial-rollouts; rollout/interrupt.py).
    """

    SYNCS: ClassVar[tuple[str, ...]] = ("disk", "tensor", "distributed")  # the engine's modes

    work_dir: str
    dtype: str = "bfloat16"
    seed: int = 0
    sync: str = "disk"
    bucket_bytes: int = 512 << 20
    startup_timeout: float = 600.0
    request_timeout: float = 3600.0
    partial_rollouts: bool = False

    def __post_init__(self) -> None:
        if self.sync not in self.SYNCS:
            raise ValueError(f"{type(self).__name__}.sync {self.sync!r}: this engine takes "
                             + ", ".join(self.SYNCS))


@dataclasses.dataclass(kw_only=True)
class ServerConfig(EngineConfig):
    """What every inference-server engine adds.

    url: attach to a server someone else runs instead of launching one.
    host: the bind address of a launched server (127.0.0.1; 0.0.0.0 to serve other nodes).
    python: the server environment's interpreter (default: the engine's own venv lookup).
    gpus: the CUDA devices a launched server runs on, as indices among the devices this process
        sees (its CUDA_VISIBLE_DEVICES is set to them); (): the devices this process sees.
    max_restarts: how often a launched server that died is started again.
    extra_args: appended to the server's command line.
    """

    url: str | None = None
    host: str = "127.0.0.1"
    python: str | None = None
    gpus: tuple[int, ...] = ()
    max_restarts: int = 3
    extra_args: tuple[str, ...] = ()


def check_sampling(temperature: float, top_p: float) -> None:
    """Raise ValueError naming the flag for a --temperature below 0 (0: greedy, as the local
    engine, vLLM and SGLang take it) or infinite, or a --top-p outside (0, 1]; NaN is refused
    too."""
    if not temperature >= 0:
        raise ValueError(f"--temperature {temperature}: must be >= 0 (0: greedy)")
    if math.isinf(temperature):
        raise ValueError(f"--temperature {temperature}: must be a finite number >= 0 (0: greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"--top-p {top_p}: a probability mass in (0, 1] (1: the whole "
                         "distribution)")


SEED_STRIDE = 1_000_003  # seed step from one prompt of a call to the next (a prime)


def prompt_seed(seed: int | None, index: int) -> int | None:
    """The sampling seed of prompt `index` of a generate call seeded `seed` (None stays None:
    unseeded).

        prompt_seed(seed, i) = seed + 1_000_003 * i,   sample j of it: prompt_seed(seed, i) + j

    Every engine that seeds per request (vLLM, SGLang) gives each prompt of a call its own seed
    this way, so the samples of different prompts draw independent noise (one seed for every
    prompt would make sample j of every prompt draw the same noise, and copies of a prompt in
    one call identical samples), and the n < 1_000_003 samples of a prompt draw their own. A
    sub-call whose first prompt is prompt `index` of the call (a server pool's chunk, an
    evaluation's batch) is seeded prompt_seed(seed, index): each prompt keeps its seed however
    the call is split."""
    return None if seed is None else seed + SEED_STRIDE * index


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
    # mixture-of-experts models: also return each token's chosen experts (Completion's
    # routed_experts), for routing replay in training
    return_routed_experts: bool = False
    # the episode this call continues, then the group it belongs to (most specific first): a
    # ServerPool sends the call to the server that served the first of these keys it remembers
    # (rollout/multi.py, "Routing"); no effect on the samples, nor on a single engine
    route_keys: tuple[str, ...] = ()


@dataclasses.dataclass
class Completion:
    """One sampled response.

    token_ids: the response tokens (prompt excluded), length T.
    rollout_logprobs: log pi_rollout(token_t | prefix) of each sampled token, length T, as the
        engine computed them (under its own numerics and sampling temperature).
    finish_reason: "stop" (a stop token, included in token_ids) or "length".
    token_versions: the weight version that generated each token, length T, where an engine
        interrupted the response at a weight update and continued it under the new weights
        (--partial-rollouts); None: every token from the weights the engine served when the
        call began.
    routed_experts: with SamplingParams.return_routed_experts, the experts the engine's
        mixture-of-experts layers chose for every token it forwarded: [P + T - 1, M, k] integer
        (P prompt tokens, M MoE layers, k experts per token; see megatron_rl.models.routing).
    """

    token_ids: list[int]
    rollout_logprobs: list[float]
    finish_reason: str
    routed_experts: torch.Tensor | None = None
    token_versions: list[int] | None = None


RESUME_SEED_STRIDE = 7_919_009  # seed step of a continuation per weight version (a prime)


def resume_seed(seed: int | None, version: int, row: int = 0) -> int | None:
    """The sampling seed of a continuation, under weight version `version`, of responses a
    generate call seeded `seed` had begun and a weight update cut (--partial-rollouts), the
    first of them its completion `row` (prompt i's sample j: row i * n + j):

        resume_seed(seed, v, row) = (prompt_seed(seed, row) + 7_919_009 * v) mod 2^31

    (None stays None). A function of the call's seed, the version and the row alone, so a cut
    run draws the same continuation for the same (seed, prefixes, weights); each version of a
    call draws its own noise (a call is cut at most once per version: versions only grow), and
    so does each continuation of one version (their first rows differ)."""
    if seed is None:
        return None
    return (prompt_seed(seed, row) + RESUME_SEED_STRIDE * version) % 2 ** 31


class RolloutEngine(Protocol):
    """What the training loop asks of a rollout engine, and all it asks: the loop never looks at
    which engine it has.

    weight_version: the trainer step whose weights the engine serves.
    client_rank: the global rank that sends `generate` requests for the whole batch (a server
        or a child process: one client, the batch is then scattered), or None when every rank
        takes part in generating its own data-parallel share (the in-process engine: each
        replica's model-parallel group generates together).
    holds_own_weights: the engine keeps a copy of the weights of its own (a server, a child
        process), which `update_weights` must refresh; False when it reads the policy itself.
    concurrent_generate: `generate` may be called from several threads of the client rank at
        once, each call served as it comes (a server batches the requests in flight); the agent
        loop then advances each episode on its own (agent/schedule.py). False where one call
        runs at a time (the in-process engine, the process engine's pipe).
    """

    weight_version: int
    client_rank: int | None
    holds_own_weights: bool
    concurrent_generate: bool

    def generate(self, prompts: Sequence[Sequence[int]], n: int,
                 params: SamplingParams) -> list[list[Completion]]:
        """`n` completions per prompt, in prompt order. Called on `client_rank` (every rank
        when it is None)."""
        ...

    def update_weights(self, version: int) -> None:
        """Make the engine serve the trainer's current weights, tagged `version`. Collective
        over all training ranks (the weights are gathered from every model-parallel shard)."""
        ...

    def stats(self) -> dict[str, float]:
        """Counters for the trainer's log ("rollout/..."), read on `client_rank` after a
        generate; {} when the engine has none."""
        ...

    def release_memory(self) -> None:
        """Free the accelerator memory the engine holds (weights offloaded, KV cache dropped) for
        the training phase; a no-op for engines without a memory-saving mode."""
        ...

    def resume_memory(self) -> None:
        """Take back what `release_memory` freed, before the next weight update."""
        ...

    def health(self) -> bool: ...

    def shutdown(self) -> None: ...


def on_client(engine: RolloutEngine, fn: Callable[[], T], what: str) -> T:
    """Collective: `fn()` run on the engine's client rank, its picklable result on every rank
    (the batch a one-client engine generated, scored there, shared with the trainer's ranks).
    The other ranks wait outside the collectives, however long it takes, and a failure there
    reaches them as parallel.RankFailed (parallel.run_on_rank); `what` names the work in it."""
    from megatron_rl.parallel import run_on_rank

    src = engine.client_rank
    assert src is not None, "on_client needs an engine with a client rank"
    return run_on_rank(src, fn, what)


def check_completions(out, num_prompts: int, n: int, vocab_size: int | None,
                      max_new_tokens: int, cut: bool = False) -> None:
    """Raise ValueError, naming the first problem, unless `out` is what a generate call for
    `num_prompts` prompts x `n` must return: n completions per prompt, token ids in
    [0, vocab_size), one finite log-prob <= 0 per token, at most max_new_tokens tokens, each
    finished "stop" or "length" (or "abort": a request a weight update may `cut`,
    --partial-rollouts)."""
    reasons = ("stop", "length", "abort") if cut else ("stop", "length")
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
            if c.finish_reason not in reasons:
                raise ValueError(f"{where}: finish reason {c.finish_reason!r}")
