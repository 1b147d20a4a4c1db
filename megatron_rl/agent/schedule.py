"""How the agent loop's episodes are scheduled: which generate calls are made, when, and from
which thread. What one turn of one episode does (the policy's turn appended, its environment
stepped, the answer appended) is the loop's (agent/loop.py), reached through `EpisodeTurns`.

Two schedules, chosen by the engine's declared capability (RolloutEngine.concurrent_generate):

turn_synchronous (the in-process and process engines: one generate call at a time)
    Every episode still running takes its turn together: one generate call per turn for all of
    them, then every episode's environment step at once (for the built-in tools: every tool
    call of the turn). A slow tool holds every episode until the slowest call of the turn
    returns, and the next generate call waits for it.

concurrent (servers: vLLM, SGLang, a pool of them; generate may be called from several
threads at once and the server batches the requests in flight)
    Each episode advances on its own, on a pool of `workers` daemon threads
    (--agent-concurrency): a thread generates an episode's turn, steps its environment (runs
    its tool calls), and generates its next turn, while the other threads' episodes generate
    or wait for their own environments. The first turn of a group is one request per prompt with n = group size, so the
    server prefills each prompt once; every later turn is one request per episode, its whole
    context re-sent (a server with prefix caching finds the context's KV up to the last turn's
    tokens and prefills the new tokens only).

Seeds. The turn-synchronous schedule samples turn t of all episodes with seed + 1_000_003**2 * t
(one call, whose prompt i an engine seeds + 1_000_003 * i: base.prompt_seed; the turn's stride
is the prompt stride squared, so no prompt of one turn shares a seed with one of another). The concurrent schedule samples each request with a seed of its own, a function of
the call's seed, the turn and the episode's index (`episode_seed`), so that a rerun at a fixed
seed makes the same requests with the same seeds, whatever order the threads run in; an engine
whose samples are a function of (seed, prompt, weights) then gives the same episodes. The two
schedules draw different samples (different calls), the same in distribution.

Routing. The concurrent schedule names each request's episode (SamplingParams.route_keys): a
group's first turn its group, every later request its episode and then its group, under a tag
unique to the rollout in this process. A server pool sends a request back to the server that
served its episode (or its group's first turn), where the context's KV is in the prefix cache
(rollout/multi.py, "Routing"); the keys change no sample. The turn-synchronous schedule's calls
hold every episode and name none.

Order: the episodes are the caller's list, prompt-major (group g's episodes are g * n ...
g * n + n - 1) in both schedules; the schedule fills them in place.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import itertools
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from megatron_rl.rollout.base import SEED_STRIDE
from megatron_rl.rollout.threads import BackgroundThreads

if TYPE_CHECKING:
    from megatron_rl.rollout.base import Completion, SamplingParams

TURN_STRIDE = SEED_STRIDE ** 2  # seed step from one turn to the next: past any prompt's
EPISODE_STRIDE = 10_007    # seed step from one episode to the next (concurrent schedule)
_ROLLOUTS = itertools.count()  # numbers the concurrent schedule's rollouts: their route keys


class Episode(Protocol):
    """What a schedule reads of an episode: why it ended (None while it runs)."""

    end: str | None


class EpisodeTurns(Protocol):
    """One rollout's turns, as the schedules drive them.

    generate(contexts, n, params): n completions of each context (token ids), flat, in order.
    context(e): the token ids episode `e` continues from (its prompt and everything after).
    policy_turn(e, completion): append the policy's turn to `e`; whether its environment is to
        answer it (False: the turn ended `e`).
    environment_turn(episodes, turn): step the environments of `episodes` (all at once) on
        their policy turn `turn` and apply their answers (an observation appended, or the end).
    """

    def generate(self, contexts: list[list[int]], n: int,
                 params: SamplingParams) -> list[Completion]: ...

    def context(self, e: Any) -> list[int]: ...

    def policy_turn(self, e: Any, completion: Completion) -> bool: ...

    def environment_turn(self, episodes: list, turn: int) -> None: ...


def turn_seed(params: SamplingParams, turn: int) -> SamplingParams:
    """The params of the turn-synchronous schedule's turn `turn` (all episodes in one call)."""
    if params.seed is None:
        return params
    return dataclasses.replace(params, seed=params.seed + TURN_STRIDE * turn)


def episode_seed(params: SamplingParams, turn: int, index: int) -> SamplingParams:
    """The params of the concurrent schedule's request for episode `index`'s turn `turn` (the
    first turn of a group of n: its first episode's index). Distinct for every (turn, index)
    with index < 10**8."""
    if params.seed is None:
        return params
    return dataclasses.replace(params, seed=params.seed + TURN_STRIDE * turn
                               + EPISODE_STRIDE * index)


def routed(params: SamplingParams, keys: tuple[str, ...]) -> SamplingParams:
    """`params` naming the request's episode and group (SamplingParams.route_keys)."""
    return dataclasses.replace(params, route_keys=keys)


def turn_synchronous(turns: EpisodeTurns, episodes: Sequence[Episode],
                     prompts: list[list[int]] | None, n: int, params: SamplingParams,
                     max_turns: int) -> None:
    """All running episodes take each turn together (see the module docstring): `episodes` are
    n per prompt, prompt-major; `prompts`: each group's shared prompt (its first turn one call
    with n completions), None where an episode's prompt is its own (its environment's reset
    gave it). Episodes already ended (an environment that failed to start) take no turn."""
    for turn in range(max_turns):
        active = [e for e in episodes if e.end is None]
        if not active:
            break
        seeded = turn_seed(params, turn)
        if turn == 0 and prompts is not None:  # each prompt prefilled once
            completions = turns.generate(prompts, n, seeded)
            completions = [c for e, c in zip(episodes, completions) if e.end is None]
        else:
            completions = turns.generate([turns.context(e) for e in active], 1, seeded)
        stepping = [e for e, c in zip(active, completions) if turns.policy_turn(e, c)]
        turns.environment_turn(stepping, turn)


def concurrent(turns: EpisodeTurns, episodes: Sequence[Episode],
               prompts: list[list[int]] | None, n: int, params: SamplingParams, max_turns: int,
               workers: int) -> None:
    """Each episode advances on its own on `workers` threads (see the module docstring):
    `episodes` and `prompts` as in turn_synchronous. The first error of any turn is raised at
    once: the turns not started are cancelled, those in flight end on their daemon threads (a
    request stuck on a server holds nothing). Each request names its episode and group (module
    docstring, "Routing")."""
    tag = f"rollout{next(_ROLLOUTS)}"

    def keys(i: int) -> tuple[str, ...]:
        """Episode i's route keys: itself, then its group (whose first turn was served first)."""
        own = (f"{tag}/episode{i}",)
        return own if prompts is None else own + (f"{tag}/group{i // n}",)

    def first_turn(g: int) -> list[Completion]:
        assert prompts is not None
        return turns.generate([prompts[g]], n, routed(episode_seed(params, 0, g * n),
                                                      (f"{tag}/group{g}",)))

    def own_first_turn(i: int) -> Completion:
        return turns.generate([turns.context(episodes[i])], 1,
                              routed(episode_seed(params, 0, i), keys(i)))[0]

    def advance(i: int, completion: Completion, turn: int) -> Completion | None:
        """Episode i's policy turn `turn` and its environment's answer, then the completion of
        its next turn; None when it has ended."""
        e = episodes[i]
        if turns.policy_turn(e, completion):
            turns.environment_turn([e], turn)
        if e.end is not None or turn + 1 >= max_turns:
            return None
        return turns.generate([turns.context(e)], 1,
                              routed(episode_seed(params, turn + 1, i), keys(i)))[0]

    threads = BackgroundThreads(max(1, min(workers, len(episodes))), name="agent-episodes")
    # future -> (turn, index): turn -1 a group's first turn (index: the group), -2 an episode's
    # own first turn, else the episode's turn
    pending: dict[cf.Future, tuple[int, int]] = {}
    try:
        if prompts is not None:
            for g in range(len(prompts)):
                pending[threads.submit(first_turn, g)] = (-1, g)
        else:
            for i, e in enumerate(episodes):
                if e.end is None:
                    pending[threads.submit(own_first_turn, i)] = (-2, i)
        while pending:
            done, _ = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
            for future in done:
                turn, index = pending.pop(future)
                result = future.result()
                if turn == -1:  # a group's first turn: each episode goes on its own
                    for j, c in enumerate(result):
                        i = index * n + j
                        if episodes[i].end is None:
                            pending[threads.submit(advance, i, c, 0)] = (0, i)
                elif turn == -2:
                    pending[threads.submit(advance, index, result, 0)] = (0, index)
                elif result is not None:
                    pending[threads.submit(advance, index, result, turn + 1)] = (turn + 1, index)
    except BaseException:
        threads.shutdown(wait=False, cancel_futures=True)
        raise
    threads.shutdown(wait=True)
