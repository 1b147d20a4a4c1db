"""Several rollout servers behind one engine: `ServerPool`.

A `ServerPool` holds N server engines of one kind (`VLLMEngine` or `SGLangEngine`, each driving
one server: started by us or attached by URL) and implements the same contract as any engine
(rollout/base.py), so the trainer does not know how many servers there are.

Generation. One `generate` call is split into contiguous chunks of prompts, one per live server
(sizes differ by at most one), sent in parallel (persistent threads per server) and reassembled
in prompt order. Calls may come from several threads at once (the agent loop's episodes:
concurrent_generate): each chunk goes to the server with the fewest requests of the pool in
flight (the lower index on a tie, so that calls one at a time use the servers in order), up to
`requests_per_server` requests in flight per server. Chunk c, starting at prompt index s, is
sampled with

    seed_c = prompt_seed(params.seed, s) = params.seed + 1_000_003 * s   (None: unseeded)

so a chunk's samples depend only on the call's seed, the chunk and the weights, not on the
server that serves it: a chunk that is re-dispatched after a failure keeps its seed and (vLLM,
which honours per-request seeds) gives the same samples. This is base.prompt_seed, by which the
engines seed each prompt of a call: every prompt is sampled with the seed it would have in one
call to a lone engine, so the samples depend neither on the number of live servers nor on how
the call was chunked.

Routing (`routing`, --rollout-routing). A multi-turn episode sends its whole context again at
every turn; a server with prefix caching prefills only the new tokens when the context's KV is
still in its cache, which it is only on the server that served the episode's previous turn.
"least-loaded" sends every chunk to the server with the fewest requests in flight, so a turn
lands where its prefix is by chance (77-79% of the turns on two vLLM CPU servers, where a
finished request leaves its server the least loaded; benchmarks/RESULTS.md, "Routing
multi-turn episodes"; less with more servers). "sticky" (the default) sends
a call that names its episode (SamplingParams.route_keys: the episode, then its group, most
specific first; the agent loop's concurrent schedule names them, agent/schedule.py) back to the
server that served the first of its keys the pool remembers, unless that server has more than
`sticky_slack` requests in flight over the least-loaded usable one:

    server = home(key)   if inflight(home) - min_s inflight(s) <= sticky_slack
             least-loaded otherwise (and when no key is remembered, or its server is not usable)

and remembers the call's first key -> the server it went to. So an episode's later turns go
where its previous turn went, and its first own turn where its group's first turn (one request
with n samples: the prompt's KV) went; a turn that moves for load stays on its new server. The
memory is an LRU of the `route_memory` most recent keys; a server taken out of the rotation is
forgotten by its keys (their next calls go to the least-loaded server). A keyed call is one
episode's (or one group's) and is sent whole to one server, one chunk; calls without keys (a
single-turn batch, an evaluation) are chunked over the servers as above. Routing never changes
the samples: every prompt keeps its seed (prompt_seed) on whichever server and in whichever
chunk it is drawn. `stats()` counts the keyed calls sent back to a remembered server
(`rollout/routed_back`) and those moved off it for load (`rollout/routed_moved`), since the pool started.

Failures. A managed server that dies is restarted by its ManagedServer and the request retried
(managed_server.py, at most `max_restarts` times). A request that still fails with a server failure
(ServerError, a transport error, HTTP 5xx; an attached URL's first failure) takes that server
out of the rotation, with a logged warning naming it; its chunk goes to the least-loaded
remaining server, and the call goes on. A managed server out of the rotation is stopped.

Rejoining. At each `update_weights`, a server out of the rotation is brought back up in the
background (a managed one booted again, on CPU only: on GPUs it shares the trainer's memory; an
attached one asked for its health; at most `max_rejoins` times each); the first weight update after it is up loads the current weights
into it with the others, and once its version checks out it is back in the rotation (logged).
It never serves before that: it would serve stale weights. An HTTP 4xx is the request's fault:
it is raised and the server stays. When no server is left, `ServerError` names every server
and its last error. An SGLang server restarted from its initial checkpoint (tensor/NCCL sync)
sits out until the next `update_weights` resyncs it.

Weights. `update_weights(version)` (collective over the training ranks) gathers/exports the
policy once and loads it into every live server in parallel, then reads each server's version
back; a server that fails the load or reports another version is taken out as above. The HF
exports (disk sync) live under the first member's `<work_dir>/weights`; every restart serves the
newest. With servers on other nodes, disk sync needs that directory on a shared filesystem
(vLLM only syncs from disk; SGLang's tensor sync is for colocated servers only). A load waits
for the generate calls in flight, except under --partial-rollouts: then each server's load cuts
its requests in flight, which go on on that server under the new weights (rollout/interrupt.py).

`stats()` gives `rollout/servers_live` (and the restart count) for the trainer's metrics; it is
meaningful on global rank 0, the client that owns the servers.

SGLang's router (`sglang-router`) or vLLM's data-parallel mode are alternatives for spreading
requests; see docs/rollout.md for why this pool is built in and how to put a router in front.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import threading
import time
from collections import OrderedDict, deque
from typing import Any, Sequence

from megatron_rl.rollout.base import Completion, SamplingParams, prompt_seed
from megatron_rl.parallel import dist_rank, run_on_rank
from megatron_rl.rollout.base import ServerError
from megatron_rl.rollout.net import ServerRequestError, TRANSPORT_ERRORS
from megatron_rl.rollout.server_engine import ServerBackedEngine
from megatron_rl.rollout.threads import BackgroundThreads
from megatron_rl.rollout.weight_sync import Payload, WeightSync, load_payload

log = logging.getLogger(__name__)

def split_chunks(num_prompts: int, num_servers: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges covering num_prompts, one per server (fewer when there
    are fewer prompts), sizes differing by at most one (the first ones larger)."""
    if num_servers < 1:
        raise ValueError("need at least one server")
    k = min(num_servers, num_prompts)
    if k == 0:
        return []
    base, extra = divmod(num_prompts, k)
    out, start = [], 0
    for i in range(k):
        end = start + base + (i < extra)
        out.append((start, end))
        start = end
    return out


def is_server_failure(exc: BaseException) -> bool:
    """Whether `exc` says the server is gone or broken (take it out of the rotation), as opposed
    to a bad request (raise it to the caller)."""
    if isinstance(exc, ServerRequestError):
        return exc.status >= 500
    return isinstance(exc, (ServerError, *TRANSPORT_ERRORS))


ROUTINGS = ("sticky", "least-loaded")  # --rollout-routing (module docstring, "Routing")


class _SitOut(Exception):
    """Internal: the member may not serve this chunk (out of the rotation, or needs a resync)."""


@dataclasses.dataclass
class _Member:
    index: int
    engine: ServerBackedEngine[Any]
    executor: BackgroundThreads
    live: bool = True
    last_error: str | None = None
    served_prompts: int = 0
    requests: int = 0
    stopping: threading.Thread | None = None   # the stop of a managed server taken out
    rejoin: cf.Future | None = None            # its background bring-up
    rejoins: int = 0                           # bring-ups started so far
    boot_path: str | None = None               # the checkpoint a bring-up boots from


class ServerPool:
    """RolloutEngine over several server engines (see module docstring).

    engines: VLLMEngine / SGLangEngine objects of one kind, each with its own work_dir
        (built with start=False to boot them concurrently here).
    policy: the trainer's Policy, needed by update_weights.
    """

    client_rank = 0
    holds_own_weights = True
    concurrent_generate = True  # calls in flight at once are spread over the servers

    def __init__(self, engines: Sequence, policy=None, start: bool = True, max_rejoins: int = 3,
                 reboot_managed: bool = True, requests_per_server: int = 64,
                 routing: str = "sticky", sticky_slack: int = 4, route_memory: int = 1 << 16):
        if not engines:
            raise ValueError("ServerPool needs at least one engine")
        if routing not in ROUTINGS:
            raise ValueError(f"--rollout-routing {routing!r}: one of {', '.join(ROUTINGS)}")
        if sticky_slack < 0:
            raise ValueError(f"--rollout-sticky-slack {sticky_slack}: must be >= 0")
        self.routing, self.sticky_slack, self.route_memory = routing, sticky_slack, route_memory
        # route key -> the member that served its last call, least recently used first (under
        # _cond)
        self._routes: OrderedDict[str, _Member] = OrderedDict()
        self.num_routed_back = 0   # keyed calls sent to their remembered server
        self.num_routed_moved = 0  # keyed calls whose remembered server was over the slack
        self.policy = policy
        self.rank = dist_rank()
        self.max_rejoins = max_rejoins
        # managed servers share the trainer's GPUs: one booting while the trainer trains would
        # take its memory share mid-step (runtime passes False on GPUs)
        self.reboot_managed = reboot_managed
        self.num_rejoined = 0
        self._shut_down = False
        # daemon threads per server (requests in flight to it at most, from concurrent calls): a
        # request stuck on one never holds the trainer's exit
        self.members = [_Member(i, e, BackgroundThreads(requests_per_server,
                                                        name=f"rollout-server-{i}"))
                        for i, e in enumerate(engines)]
        self._inflight = [0] * len(self.members)  # requests in flight per member (under _cond)
        for m in self.members:  # never pruned, unlike the exports (the weights come after)
            server = m.engine.server
            m.boot_path = server.model_path if server is not None else None
        first = engines[0]
        self.weight_version = first.weight_version
        self.last_sync_seconds: dict[str, float] = {}
        # each generate call is served by one weight version: a weight load waits for the calls
        # in flight, and calls wait for a load in progress (under --partial-rollouts a load cuts
        # them instead: partial_rollouts)
        self._cond = threading.Condition()
        self._active_calls = 0
        self.num_generate_calls = 0  # pool-level calls (each spread over the servers)
        self._loading = False
        if start:
            self.start()

    @property
    def partial_rollouts(self) -> bool:
        """--partial-rollouts (the members' gates): a load cuts the calls in flight, each member
        its own, and they go on under the new weights (rollout/interrupt.py); nothing waits for
        them."""
        return getattr(self.members[0].engine, "gate", None) is not None

    @property
    def sync(self) -> WeightSync | None:
        """The first member's weight sync serves the pool: one export (or gather) per update,
        under its work_dir, loaded into every server."""
        return self.members[0].engine.sync

    @property
    def exporter(self):
        return self.sync.exporter if self.sync is not None else None

    # -- membership ------------------------------------------------------------------------------
    @property
    def engines(self) -> list:
        return [m.engine for m in self.members]

    def name(self, member: _Member) -> str:
        """How warnings and errors name a server: its index and URL."""
        e = member.engine
        url = e.url
        if url is None and e.server is not None:
            try:
                url = e.server.url
            except ServerError:
                url = None
        kind = e.server.name if e.server is not None else type(e).__name__
        return f"{kind} server {member.index}" + (f" at {url}" if url else "")

    def live_members(self) -> list[_Member]:
        return [m for m in self.members if m.live]

    def _usable(self) -> list[_Member]:
        """Live servers that may generate now (an SGLang server restarted from its initial
        checkpoint waits for the next update_weights)."""
        return [m for m in self.members if m.live and not m.engine.needs_resync]

    def _take_out(self, member: _Member, exc: BaseException | str) -> None:
        with self._cond:  # generate's chunk threads and update_weights may race to take it out
            if not member.live:
                return
            member.live = False
            member.last_error = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
            left = len(self.live_members())
            for key in [k for k, m in self._routes.items() if m is member]:
                del self._routes[key]  # its episodes go to the least-loaded server next
        if self.rank == 0:  # the client (every rank learns of a failed boot, one logs it)
            log.warning("rollout: %s failed and is out of the rotation (%d of %d servers left): "
                        "%s", self.name(member), left, len(self.members),
                        member.last_error[:2000])
        server = member.engine.server
        if server is not None and server.managed:
            # free its resources, without waiting (a hung request may still hold the server)
            member.stopping = threading.Thread(target=_quiet_shutdown, args=(member.engine,),
                                               daemon=True,
                                               name=f"stop-rollout-server-{member.index}")
            member.stopping.start()

    def _start_rejoins(self) -> None:
        """Rank 0: bring each server out of the rotation back up in the background (see the
        module docstring); the next update_weights loads and re-admits the ones that are up."""
        for m in self.members:
            managed = m.engine.server is not None and m.engine.server.managed
            if (m.live or m.rejoin is not None or m.rejoins >= self.max_rejoins
                    or (managed and not self.reboot_managed)):
                continue
            m.rejoins += 1
            m.rejoin = m.executor.submit(self._bring_up, m)

    def _bring_up(self, member: _Member) -> None:
        if member.stopping is not None:  # the stop of the failed process first
            member.stopping.join()
        if self._shut_down:  # the pool shut down meanwhile: boot nothing
            raise ServerError("the pool was shut down")
        e = member.engine
        server = e.server
        if server is None:
            raise ServerError("no server to bring up")
        if server.managed:
            # the initial checkpoint: an export may be pruned while it boots; the next weight
            # update loads the current weights before it serves
            server.model_path = member.boot_path or server.model_path
            server.reopen()  # taken out with close(): restarts are allowed again
            server.start()
        elif not server.healthy():
            raise ServerError("does not answer its health check")
        e.url = server.url

    def _rejoin_candidates(self) -> list[_Member]:
        """Servers out of the rotation whose bring-up has finished well (a failed one records
        its error and is tried again at a later update)."""
        ready = []
        for m in self.members:
            if m.live or m.rejoin is None or not m.rejoin.done():
                continue
            exc, m.rejoin = m.rejoin.exception(), None
            if exc is None:
                ready.append(m)
            else:
                m.last_error = f"rejoin {m.rejoins}: {type(exc).__name__}: {exc}"
                log.warning("rollout: %s could not come back: %s", self.name(m), m.last_error)
        return ready

    def _no_server_left(self, what: str) -> ServerError:
        lines = [f"  {self.name(m)}: {m.last_error or 'not usable (needs a weight resync)'}"
                 for m in self.members]
        return ServerError(f"no rollout server left for {what}; all {len(self.members)} "
                           "failed:\n" + "\n".join(lines))

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Boot every managed server at once, wait for each (collective when distributed: every
        rank learns every URL and which servers came up; the others wait for rank 0 outside the
        collectives, parallel.run_on_rank). A server that fails to boot is out of the rotation
        with a warning; none booting is an error."""
        for m in self.members:
            m.engine.start(wait=False)
        for m in self.members:
            e = m.engine
            status = run_on_rank(0, lambda: _boot(e), f"starting {self.name(m)}")
            if status is None:  # no server object on any rank (not a server engine)
                continue
            if status[0] == "ok":
                e.url = status[1]
            else:
                self._take_out(m, "startup: " + status[1])
        if not self.live_members():
            raise self._no_server_left("startup")

    def shutdown(self) -> None:
        self._shut_down = True
        for m in self.members:
            _quiet_shutdown(m.engine)
        if self.sync is not None:  # the first member's, already closed by its shutdown
            self.sync.close()
        for m in self.members:
            m.executor.shutdown(wait=False, cancel_futures=True)

    def health(self) -> bool:
        """True when at least one server answers; each live one is checked (a dead managed one
        is restarted first) and taken out of the rotation if it does not answer."""
        futures = {m.executor.submit(m.engine.health): m for m in self.live_members()}
        for fut, m in futures.items():
            try:
                ok = fut.result()
            except Exception as exc:  # noqa: BLE001 - a failed restart: out of the rotation
                if not is_server_failure(exc):
                    raise
                self._take_out(m, exc)
                continue
            if not ok:
                self._take_out(m, "health check failed")
        return bool(self.live_members())

    def stats(self) -> dict[str, float]:
        """Metrics for the trainer's log (global rank 0 holds the servers)."""
        restarts = sum(m.engine.server.num_restarts for m in self.members
                       if m.engine.server is not None)
        return {"rollout/generate_calls": float(self.num_generate_calls),
                "rollout/servers_live": float(len(self.live_members())),
                "rollout/servers_total": float(len(self.members)),
                "rollout/server_restarts": float(restarts),
                "rollout/server_rejoins": float(self.num_rejoined),
                "rollout/routed_back": float(self.num_routed_back),
                "rollout/routed_moved": float(self.num_routed_moved),
                **({"rollout/interrupted_responses": float(sum(
                    m.engine.num_interrupted for m in self.members))}
                   if self.partial_rollouts else {})}

    def route_of(self, key: str) -> int | None:
        """The index of the server the pool would send `key`'s next call back to (the one that
        served its last call), or None when the key is not remembered."""
        with self._cond:
            member = self._routes.get(key)
            return None if member is None else member.index

    # -- generation ------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], n: int,
                 params: SamplingParams) -> list[list[Completion]]:
        prompts = [list(p) for p in prompts]
        if not prompts:
            return []
        with self._cond:
            self._cond.wait_for(lambda: not self._loading)
            self._active_calls += 1
        try:
            out = self._generate(prompts, n, params)
            with self._cond:
                self.num_generate_calls += 1
            return out
        finally:
            with self._cond:
                self._active_calls -= 1
                self._cond.notify_all()

    def _generate(self, prompts: list[list[int]], n: int,
                  params: SamplingParams) -> list[list[Completion]]:
        keys = params.route_keys if self.routing == "sticky" else ()
        if keys:  # one episode's (or group's) call: whole, to one server
            chunks = [(0, len(prompts))]
        else:
            chunks = split_chunks(len(prompts), max(1, len(self._usable())))
        results: list[list[list[Completion]] | None] = [None] * len(chunks)
        inflight: dict[cf.Future, tuple[int, _Member]] = {}

        def dispatch(ci: int) -> _Member | None:
            """Chunk ci to the usable server with the fewest requests in flight, or a keyed
            call to its remembered server (_route; that server; None when no server is
            usable)."""
            with self._cond:
                usable = self._usable()
                if not usable:
                    return None
                member = self._route(usable, keys)
                self._inflight[member.index] += 1
            start, end = chunks[ci]
            chunk_params = dataclasses.replace(params, seed=prompt_seed(params.seed, start))
            fut = member.executor.submit(self._generate_on, member, prompts[start:end], n,
                                         chunk_params)
            inflight[fut] = (ci, member)
            return member

        for ci in range(len(chunks)):
            if dispatch(ci) is None:
                raise self._no_server_left("generate")
        queue: deque[int] = deque()
        error: BaseException | None = None
        while inflight:
            done, _ = cf.wait(inflight, return_when=cf.FIRST_COMPLETED)
            for fut in done:
                ci, member = inflight.pop(fut)
                with self._cond:
                    self._inflight[member.index] -= 1
                try:
                    out = fut.result()
                except _SitOut:
                    queue.append(ci)
                    continue
                except Exception as exc:  # noqa: BLE001 - sorted below
                    if not is_server_failure(exc):
                        error = error or exc
                        continue
                    self._take_out(member, exc)
                    queue.append(ci)
                    continue
                start, end = chunks[ci]
                with self._cond:
                    member.served_prompts += end - start
                    member.requests += 1
                results[ci] = out
            if error is not None:
                continue  # let the requests in flight finish, then raise
            while queue:
                ci = queue.popleft()
                member = dispatch(ci)
                if member is None:
                    error = self._no_server_left("generate")
                    break
                log.warning("rollout: re-dispatched prompts [%d, %d) to %s", *chunks[ci],
                            self.name(member))
        if error is not None:
            raise error
        return [row for chunk in results for row in chunk]

    def _route(self, usable: list[_Member], keys: tuple[str, ...]) -> _Member:
        """Under _cond: the server for a call with route `keys` (module docstring, "Routing"):
        the remembered server of the first key it remembers among the usable ones, unless it has
        more than sticky_slack requests in flight over the least-loaded one; else the
        least-loaded (the lower index on a tie). Remembers keys[0] -> the server chosen."""
        least = min(usable, key=lambda m: (self._inflight[m.index], m.index))
        if not keys:
            return least
        member = least
        usable_ids = {id(m) for m in usable}
        for key in keys:
            home = self._routes.get(key)
            if home is None or id(home) not in usable_ids:
                continue  # not remembered, or its server may not serve now: the next key
            if self._inflight[home.index] - self._inflight[least.index] <= self.sticky_slack:
                member = home
                self.num_routed_back += 1
            else:
                self.num_routed_moved += 1
            break
        self._routes[keys[0]] = member
        self._routes.move_to_end(keys[0])
        while len(self._routes) > self.route_memory:
            self._routes.popitem(last=False)
        return member

    def _generate_on(self, member: _Member, prompts, n: int, params: SamplingParams):
        """In the member's thread: one chunk on one server, checked."""
        if not member.live or member.engine.needs_resync:
            raise _SitOut()
        out = member.engine.generate(prompts, n, params)
        if member.engine.needs_resync:
            # restarted from the initial checkpoint during the request: stale weights
            raise _SitOut()
        if len(out) != len(prompts) or any(len(row) != n for row in out):
            raise ServerError(f"{self.name(member)} returned {[len(r) for r in out]} "
                              f"completions for {len(prompts)} prompts x n={n}")
        return out

    # -- weights ---------------------------------------------------------------------------------
    def update_weights(self, version: int) -> None:
        """Collective over all training ranks: the policy's weights into every live server,
        tagged `version` (gathered or exported once, loaded in parallel), versions checked."""
        if self.policy is None or self.sync is None:
            raise ValueError("update_weights needs the policy: ServerPool(..., policy=policy), "
                             "over engines with a weight sync")
        t0 = time.perf_counter()
        payload = self.sync.prepare(self.policy, version)
        self.last_sync_seconds.update(self.sync.last_seconds)
        run_on_rank(0, lambda: self._load_all(payload, version, t0),
                    f"loading weights version {version} into the servers")
        self._set_version(version)

    def _load_all(self, payload: Payload | None, version: int, t0: float) -> None:
        """Rank 0: `payload` into every live server and into those coming back, in parallel."""
        assert payload is not None
        t1 = time.perf_counter()
        with self._cond:  # between generate calls (see __init__)
            self._cond.wait_for(lambda: not self._loading)
            self._loading = True
            if not self.partial_rollouts:
                self._cond.wait_for(lambda: self._active_calls == 0)
        try:
            back = self._rejoin_candidates()
            members = self.live_members() + back
            if payload.kind == "distributed":  # one NCCL broadcast at a time
                outcomes = [self._load_into(m, payload) for m in members]
            else:
                futures = [m.executor.submit(self._load_into, m, payload) for m in members]
                outcomes = [f.result() for f in futures]
            for m, exc in zip(members, outcomes):
                if m in back:
                    self._readmit(m, exc, version)
                elif exc is not None:
                    if not is_server_failure(exc):
                        raise exc
                    self._take_out(m, exc)
            if not self.live_members():
                raise self._no_server_left(f"weight update {version}")
            self._set_version(version)
            self._start_rejoins()
        finally:
            with self._cond:
                self._loading = False
                self._cond.notify_all()
        self.sync.prune(payload)
        self.last_sync_seconds["load"] = time.perf_counter() - t1
        self.last_sync_seconds["total"] = time.perf_counter() - t0

    def _readmit(self, member: _Member, exc: BaseException | None, version: int) -> None:
        """A server that came back up got the weights of `version`: back in the rotation, or
        (the load failed) out again until a later bring-up."""
        if exc is not None:
            member.last_error = f"rejoin {member.rejoins}: {type(exc).__name__}: {exc}"
            log.warning("rollout: %s came back up but failed the weight load: %s",
                        self.name(member), member.last_error)
            _quiet_shutdown(member.engine)
            return
        with self._cond:
            member.live, member.last_error = True, None
            left = len(self.live_members())
        self.num_rejoined += 1
        log.warning("rollout: %s is back in the rotation with weight version %d (%d of %d "
                    "servers live)", self.name(member), version, left, len(self.members))

    def _set_version(self, version: int) -> None:
        for m in self.members:
            m.engine.weight_version = version
        self.weight_version = version

    @staticmethod
    def _load_into(member: _Member, payload: Payload) -> BaseException | None:
        """In the member's thread: load and read the version back; the error, if any."""
        e, version = member.engine, payload.version
        try:
            load_payload(e, payload)
            got = e.server_weight_version()
            # in memory, a server restarted mid-load reports no version (the initial weights)
            if (got is not None or payload.kind != "disk") and got != version:
                raise ServerError(f"reports weight version {got} after loading {version}")
            e.needs_resync = False
            return None
        except Exception as exc:  # noqa: BLE001 - the caller sorts it
            return exc

    def release_memory(self) -> None:
        """Every live server frees its GPU memory (see ServerBackedEngine.release_memory)."""
        self._on_every_server("release_memory")

    def resume_memory(self) -> None:
        self._on_every_server("resume_memory")

    def _on_every_server(self, method: str) -> None:
        if self.rank != 0:
            return
        members = self.live_members()
        futures = [m.executor.submit(getattr(m.engine, method)) for m in members]
        for m, f in zip(members, futures):
            try:
                f.result()
            except Exception as exc:  # noqa: BLE001 - a broken server leaves the rotation
                if not is_server_failure(exc):
                    raise
                self._take_out(m, exc)
        if not self.live_members():
            raise self._no_server_left(method)

    def server_weight_versions(self) -> dict[str, int | None]:
        """Each live server's reported weight version, by name."""
        return {self.name(m): m.engine.server_weight_version() for m in self.live_members()}


def _boot(engine) -> tuple[str, str] | None:
    """Rank 0: wait for a launched server (ServerBackedEngine.start(wait=False)) to come up:
    ("ok", its URL), ("failed", why), or None for an engine without a server process."""
    if engine.server is None:
        return None
    try:
        engine.server.start()
        return ("ok", engine.server.url)
    except ServerError as exc:
        return ("failed", f"{type(exc).__name__}: {exc}")


def _quiet_shutdown(engine) -> None:
    try:
        engine.shutdown()
    except Exception as exc:  # noqa: BLE001 - stopping a broken server must not raise
        log.warning("rollout: stopping %s failed: %s", type(engine).__name__, exc)
