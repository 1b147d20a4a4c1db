"""ServerPool's sticky routing (rollout/multi.py, "Routing") without inference servers.

The pool is the real one, over a deterministic in-test engine that seeds each prompt of a call
as every engine does (base.prompt_seed) and spells it out in its completions (the prompt, the
prompt's seed, the sample index), and holds chosen requests in flight until the test releases
them, so that a server's load is the test's to set. Episodes are driven by the agent loop's real concurrent schedule
(agent/schedule.py) over a minimal EpisodeTurns whose contexts grow by each completion and an
observation token. The same routing against two real vLLM servers:
tests/e2e/test_server_pool_routing.py.
"""
import dataclasses
import threading
import time
import typing

import pytest

from megatron_rl.agent import schedule
from megatron_rl.rollout.base import Completion, SamplingParams, ServerError, prompt_seed
from megatron_rl.rollout.multi import ServerPool
from test_pool_chunking import PROMPTS, EchoEngine, tokens

HOLD = 999  # a prompt starting with this token is held in flight until released


class HoldingEngine(EchoEngine):
    """Completion j of prompt i of a call seeded s: [prompt[0], prompt_seed(s, i), j], as an
    engine seeding per prompt draws it. Records each request (its prompts and seed: calls; its
    route keys: keys), waits `delay` seconds per request (so that concurrent requests
    overlap), holds prompts starting with HOLD until `release` is set, and fails with a
    ServerError once `broken` is set."""

    def __init__(self, delay: float = 0.0):
        super().__init__()
        self.delay, self.broken = delay, False
        self.release = threading.Event()
        self.keys: list[tuple[str, ...]] = []

    def generate(self, prompts, n, params):
        if self.broken:
            raise ServerError("server broken by the test")
        self.keys.append(params.route_keys)
        if prompts[0][0] == HOLD:
            assert self.release.wait(20), "held request never released"
        time.sleep(self.delay)
        self.calls.append(([tuple(p) for p in prompts], params.seed))
        return [[Completion([p[0], prompt_seed(params.seed, i), j], [-1.0] * 3, "length")
                 for j in range(n)] for i, p in enumerate(prompts)]


def engines(pool: ServerPool) -> list[HoldingEngine]:
    return [typing.cast(HoldingEngine, m.engine) for m in pool.members]


def drawn(prompts, n, seed):
    """What a call of `prompts` seeded `seed` draws on any HoldingEngine, whole or chunked."""
    return [[[p[0], prompt_seed(seed, i), j] for j in range(n)] for i, p in enumerate(prompts)]


def hold(pool: ServerPool, keys: tuple[str, ...] = ()) -> threading.Thread:
    """A request held in flight on the server the pool routes it to (returns once the server
    has it)."""
    def received():
        return sum(len(e.keys) for e in engines(pool))

    before = received()
    t = threading.Thread(target=pool.generate, args=([[HOLD]], 1, SamplingParams(
        seed=0, route_keys=keys)), daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while received() == before and time.monotonic() < deadline:
        time.sleep(0.001)
    return t


def release(pool: ServerPool, threads: list[threading.Thread]) -> None:
    for e in engines(pool):
        e.release.set()
    for t in threads:
        t.join(20)


def server_of(pool: ServerPool, keys: tuple[str, ...]) -> int:
    """The server a keyed one-prompt call goes to (the call is made)."""
    counts = [len(e.calls) for e in engines(pool)]
    pool.generate([[1]], 1, SamplingParams(seed=0, route_keys=keys))
    (index,) = [i for i, e in enumerate(engines(pool)) if len(e.calls) > counts[i]]
    return index


@dataclasses.dataclass
class Episode:
    tokens: list[int]
    end: str | None = None


class Turns:
    """schedule.EpisodeTurns over a pool: a context is the episode's tokens; a policy turn
    appends the completion, an environment turn the token 7."""

    def __init__(self, pool):
        self.pool = pool

    def generate(self, contexts, n, params):
        return [c for row in self.pool.generate(contexts, n, params) for c in row]

    def context(self, e):
        return list(e.tokens)

    def policy_turn(self, e, completion):
        e.tokens += completion.token_ids
        return True

    def environment_turn(self, episodes, turn):
        for e in episodes:
            e.tokens.append(7)


def run_episodes(pool: ServerPool, groups: int = 4, n: int = 2, turns: int = 4):
    """groups x n episodes of `turns` policy turns under the concurrent schedule; their
    tokens."""
    episodes = [Episode([40 + g]) for g in range(groups) for _ in range(n)]
    schedule.concurrent(Turns(pool), episodes, [[40 + g] for g in range(groups)], n,
                        SamplingParams(seed=3), turns, workers=groups * n)
    return [e.tokens for e in episodes]


def served(pool: ServerPool) -> dict[str, set[int]]:
    """Route key (a request's first) -> the servers that served a request naming it."""
    out: dict[str, set[int]] = {}
    for i, e in enumerate(engines(pool)):
        for keys in filter(None, e.keys):
            out.setdefault(keys[0], set()).add(i)
    return out


def test_episode_turns_stay_on_the_server_of_their_group():
    """8 episodes (4 groups of 2) x 4 turns at once on two servers, within the slack: each
    episode's turns all go to the server of its group's first turn (its prompt's KV), the
    groups are spread over both servers, and every keyed call after a group's first turn went
    back to its remembered server."""
    pool = ServerPool([HoldingEngine(delay=0.1) for _ in range(2)], start=False,
                      sticky_slack=100)
    run_episodes(pool)
    where = served(pool)
    episodes = {k: v for k, v in where.items() if "/episode" in k}
    groups = {k: v for k, v in where.items() if "/group" in k}
    assert len(episodes) == 8 and len(groups) == 4
    assert all(len(v) == 1 for v in where.values()), where
    for key, servers in episodes.items():
        tag, name = key.split("/")
        assert servers == groups[f"{tag}/group{int(name[len('episode'):]) // 2}"]
    assert set().union(*groups.values()) == {0, 1}  # the groups' first turns spread
    stats = pool.stats()
    assert stats["rollout/routed_back"] == 8 * 3 and stats["rollout/routed_moved"] == 0
    # each rollout names its episodes afresh: a second one shares no key with the first
    run_episodes(pool)
    assert len(served(pool)) == 2 * 12


def test_least_loaded_routing_ignores_the_keys_and_gives_the_same_samples():
    """Routing never changes a sample: the same episodes sticky and least-loaded (each request
    keeps its seed)."""
    sticky = ServerPool([HoldingEngine(delay=0.1) for _ in range(2)], start=False)
    loaded = ServerPool([HoldingEngine(delay=0.1) for _ in range(2)], start=False,
                        routing="least-loaded")
    assert run_episodes(sticky) == run_episodes(loaded)
    assert loaded.stats()["rollout/routed_back"] == 0
    # a keyed call of several prompts goes whole to one server, with the samples the chunked
    # call gives
    keyed = sticky.generate(PROMPTS, 2, SamplingParams(seed=5, route_keys=("batch",)))
    assert tokens(keyed) == drawn(PROMPTS, 2, 5)
    home = sticky.route_of("batch")
    assert home is not None
    assert engines(sticky)[home].calls[-1][0] == [tuple(p) for p in PROMPTS]
    assert tokens(loaded.generate(PROMPTS, 2, SamplingParams(seed=5, route_keys=("batch",)))
                  ) == tokens(keyed)
    assert [len(e.calls[-1][0]) for e in engines(loaded)] == [4, 3]  # chunked


def test_a_turn_moves_when_its_server_is_over_the_slack():
    """An episode stays on its server while that server has at most --rollout-sticky-slack
    requests in flight over the least-loaded one; one more and its next turn goes to the
    least-loaded server, where it then stays."""
    pool = ServerPool([HoldingEngine() for _ in range(2)], start=False, sticky_slack=2)
    assert server_of(pool, ("ep",)) == 0  # nothing in flight: the first server
    held = [hold(pool, ("load",))]  # "load" homes on server 0 too
    held += [hold(pool, ("load",)) for _ in range(2)]  # 2, 3 in flight there (0 on server 1)
    assert [len(e.keys) for e in engines(pool)] == [4, 0]  # all held on server 0
    # 3 over the least-loaded: ep moves to server 1 and is remembered there
    assert server_of(pool, ("ep",)) == 1 and pool.route_of("ep") == 1
    assert pool.stats()["rollout/routed_moved"] == 1
    held.append(hold(pool))  # unkeyed: the least-loaded server, 1
    assert server_of(pool, ("ep",)) == 1  # stays on its new server
    # a new key follows its second key's server, 3 - 1 = 2 in flight over server 1's: within
    assert server_of(pool, ("other", "load")) == 0
    release(pool, held)
    assert server_of(pool, ("ep",)) == 1
    assert pool.route_of("other") == 0


def test_a_key_whose_server_left_the_rotation_goes_to_the_least_loaded_one():
    """A server taken out of the rotation is forgotten by its keys: their next call goes to
    the least-loaded live server (not the lowest index when that one is busy), and is
    remembered there. The remembered keys are the most recent route_memory ones."""
    pool = ServerPool([HoldingEngine() for _ in range(3)], start=False, route_memory=2)
    assert server_of(pool, ("ep",)) == 0
    engines(pool)[0].broken = True
    # an unkeyed call fails there; its chunk moves, seed and all
    assert tokens(pool.generate(PROMPTS, 1, SamplingParams(seed=1))) == drawn(PROMPTS, 1, 1)
    assert not pool.members[0].live and pool.route_of("ep") is None
    held = [hold(pool)]  # server 1 busy
    assert server_of(pool, ("ep",)) == 2 and pool.route_of("ep") == 2
    release(pool, held)
    # a keyed call whose server fails during it moves to another and is remembered there
    engines(pool)[2].broken = True
    assert server_of(pool, ("ep",)) == 1 and pool.route_of("ep") == 1
    # an LRU of 2 keys: the least recently used is forgotten
    server_of(pool, ("a",))
    server_of(pool, ("ep",))
    server_of(pool, ("b",))
    assert pool.route_of("a") is None and pool.route_of("ep") == 1


def test_routing_settings_are_checked():
    with pytest.raises(ValueError, match="--rollout-routing"):
        ServerPool([EchoEngine()], start=False, routing="random")
    with pytest.raises(ValueError, match="--rollout-sticky-slack"):
        ServerPool([EchoEngine()], start=False, sticky_slack=-1)
    from megatron_rl.config import parse_config

    base = ["--hf-checkpoint", "m", "--train-data", "d.jsonl", "--rollout-engine", "vllm",
            "--rollout-num-servers", "2"]
    r = parse_config(base).rollout
    assert (r.rollout_routing, r.rollout_sticky_slack) == ("sticky", 4)
    r = parse_config(base + ["--rollout-routing", "least-loaded", "--rollout-sticky-slack",
                             "0"]).rollout
    assert (r.rollout_routing, r.rollout_sticky_slack) == ("least-loaded", 0)
    with pytest.raises(ValueError, match="--rollout-sticky-slack"):
        parse_config(base + ["--rollout-sticky-slack", "-1"])
