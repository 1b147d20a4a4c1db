"""What the vLLM and SGLang engines share: a server process on global rank 0 (launched or
attached), its URL on every rank, generate requests checked and asked again on a bad answer,
memory release, and where a server's Python environment is."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
import urllib.error
from typing import Any, Callable, ClassVar, Generic, Iterator, Mapping, Sequence, TypeVar

from megatron_rl.parallel import run_on_rank
from megatron_rl.rollout.base import (BadAnswer, Completion, SamplingParams, ServerConfig,
                                      ServerError, check_completions, resume_seed)
from megatron_rl.rollout.interrupt import Ticket, UpdateGate, continue_interrupted, label
from megatron_rl.rollout.managed_server import ManagedServer
from megatron_rl.rollout.net import http_json, stream_events
from megatron_rl.rollout.weight_sync import WeightSync

log = logging.getLogger(__name__)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def server_python(env_var: str, venv: str) -> str | None:
    """A server's interpreter: $<env_var>, else <repo>/<venv>/bin/python; None when neither
    exists."""
    path = os.environ.get(env_var) or os.path.join(REPO_ROOT, venv, "bin", "python")
    return path if os.path.exists(path) else None


def read_hf_config(model_path: str) -> dict:
    """The config.json of an HF checkpoint directory ({} when there is none)."""
    path = os.path.join(model_path, "config.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def visible_devices(gpus: Sequence[int], environ: Mapping[str, str] = os.environ) -> str:
    """CUDA_VISIBLE_DEVICES for a child process that should run on `gpus`, indices among the
    devices this process sees: through this process's own CUDA_VISIBLE_DEVICES (in `environ`)
    where it restricts them."""
    shown = [d.strip() for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if not shown:
        return ",".join(str(g) for g in gpus)
    beyond = [g for g in gpus if not 0 <= g < len(shown)]
    if beyond:
        raise ValueError(f"CUDA device {beyond[0]}: this process sees {len(shown)} "
                         f"(CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']})")
    return ",".join(shown[g] for g in gpus)


C = TypeVar("C", bound=ServerConfig)
T = TypeVar("T")


class ServerBackedEngine(Generic[C]):
    """What the vLLM and SGLang engines share: the server process (`self.server`, a
    ManagedServer on rank 0 or None elsewhere), its URL (`self.url`, on every rank), and
    `generate`: one request (the engine's `_request`), its answer checked
    (`base.check_completions`), retried on a bad answer."""

    NAME = "server"
    client_rank = 0            # the server is launched (or attached) and driven by global rank 0
    holds_own_weights = True
    concurrent_generate = True  # each call is its own HTTP request; the server batches them
    SHARED_MEMORY = False          # tensor sync through shared-memory buckets, or the tensors
    config: C
    weight_version: int
    server: "ManagedServer | None"
    sync: WeightSync
    url: str | None
    vocab_size: int | None = None  # token ids at or above it are a bad answer
    max_bad_answers: int = 2       # retries of a generate request whose answer is bad
    request_timeout: float = 3600.0
    num_generate_calls: int = 0  # generate requests answered (the trainer makes one per batch)
    _count_lock: ClassVar[threading.Lock] = threading.Lock()  # generate runs on several threads
    needs_resync = False        # restarted from the initial weights: no request until a sync

    gate: UpdateGate | None = None  # --partial-rollouts: a weight update cuts the requests
    num_interrupted: int = 0        # responses cut by a weight update and continued, over the run

    def generate(self, prompts: Sequence[Sequence[int]], n: int,
                 params: SamplingParams) -> list[list[Completion]]:
        """`n` samples per prompt; callable from several threads at once (each call its own
        request: concurrent_generate). A bad answer (BadAnswer from `_request`, a failed check) is
        asked again with the same request (same seed) up to `max_bad_answers` times, then raises
        BadAnswer naming the server, the request and every failure; the caller's batch is
        untouched, so the step can be generated again. No answer within `request_timeout` is not
        asked again (a hung server would hang again: the wait stays one timeout, and a pool
        re-dispatches the prompts to its other servers). Under --partial-rollouts (`gate`) a
        weight update cuts the call's responses, which go on under the new weights
        (rollout/interrupt.py)."""
        if not prompts:
            return []
        if self.needs_resync:
            raise ServerError(f"{self.NAME} server {self.url} restarted from the initial "
                              "checkpoint; call update_weights before generating")
        prompts = [[int(t) for t in p] for p in prompts]
        made = 0
        if self.gate is None:
            out = self._checked(prompts, n, params, None)
        else:
            out = self._checked(prompts, n, params, self.gate.enter())
            made = continue_interrupted(prompts, [c for g in out for c in g], n,
                                        params.max_new_tokens,
                                        lambda ask, budget, row: self._resume(ask, budget, row,
                                                                              params),
                                        concurrent=True)
        with self._count_lock:
            self.num_generate_calls += 1
            self.num_interrupted += made
        return out

    def _resume(self, ask: list[list[int]], budget: int, row: int,
                params: SamplingParams) -> list[list[Completion]]:
        """--partial-rollouts: one sample of each of `ask` (prompts and the tokens a weight update
        cut) under the weights loaded after the cut, seeded resume_seed (rollout/interrupt.py)."""
        assert self.gate is not None
        ticket = self.gate.enter()
        cont = dataclasses.replace(params, max_new_tokens=budget,
                                   seed=resume_seed(params.seed, ticket.version, row))
        return self._checked(ask, 1, cont, ticket)

    def _checked(self, prompts: list[list[int]], n: int, params: SamplingParams,
                 ticket: Ticket | None) -> list[list[Completion]]:
        """`generate`'s request, checked and asked again on a bad answer. With a `ticket`
        (--partial-rollouts) a cut response ends "abort" with the tokens read before the cut,
        each labelled with the ticket's version."""
        what = (f"generate {len(prompts)} prompts x n={n}, seed {params.seed}, "
                f"max_new_tokens {params.max_new_tokens}")
        failures = []
        for attempt in range(1 + self.max_bad_answers):
            try:
                out = self._request(prompts, n, params, ticket)
                if self.needs_resync:  # restarted during the request: the initial weights
                    raise ServerError(f"{self.NAME} server {self.url} restarted from the initial "
                                      f"checkpoint during {what}; its samples are not the "
                                      "policy's (call update_weights before generating)")
                check_completions(out, len(prompts), n, self.vocab_size, params.max_new_tokens,
                                  cut=ticket is not None)
            except ValueError as e:  # BadAnswer is a ServerError, not a ValueError
                failures.append(f"bad answer: {e}")
            except BadAnswer as e:
                failures.append(str(e))
            except (TimeoutError, urllib.error.URLError) as e:
                if isinstance(e, urllib.error.URLError) and not isinstance(e.reason, TimeoutError):
                    raise
                failures.append(f"no answer within {self.request_timeout:.0f} s (not asked again)")
                break
            else:
                if ticket is not None:
                    label(out, ticket.version)
                return out
            if attempt < self.max_bad_answers:
                log.warning("%s server %s: %s (%s); asking again", self.NAME, self.url,
                            failures[-1], what)
        raise BadAnswer(f"{self.NAME} server {self.url}: {what}: {len(failures)} bad answer(s): "
                        + "; ".join(failures))

    def _read_live(self, url: str, path: str, payload: dict, ticket: Ticket,
                   take: Callable[[dict], None]) -> bool:
        """`payload` to `url + path` as a streamed request (server-sent events), each event
        handed to `take` while `ticket` is live (rollout/interrupt.py); whether a weight update
        cut the reading. A request the cut came before is not sent; leaving the stream at the cut
        closes the connection, which makes the server drop the request if it still runs it."""
        assert self.gate is not None
        with self.gate.reading(ticket) as live:
            if not live:
                return True
        with stream_events(url + path, {**payload, "stream": True},
                           self.request_timeout) as events:
            for event in events:
                if "error" in event:
                    raise BadAnswer(f"error in the stream: {str(event)[:300]!r}")
                with self.gate.reading(ticket) as live:
                    if not live:
                        return True
                    take(event)
        return False

    def _on_server(self, read: Callable[[str], T]) -> T:
        """read(base URL): through the ManagedServer on rank 0 (a dead server restarted and
        `read` called again), directly elsewhere; a malformed answer raises BadAnswer."""
        try:
            return self.server.call(read) if self.server is not None else read(self.url)
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise BadAnswer(f"malformed stream ({type(e).__name__}: {e})") from None

    # (path, payload) of the server's endpoints that stop the requests in flight (each answers
    # with its tokens so far) and hold new ones, and that serve them again
    PAUSE: tuple[str, Any] = ("", None)
    UNPAUSE: tuple[str, Any] = ("", None)

    @contextlib.contextmanager
    def _loading(self) -> Iterator[None]:
        """The block loads new weights into the server and sets `weight_version`. Under
        --partial-rollouts the requests in flight are cut and the server paused first (no request
        runs while the weights change), then unpaused (rollout/interrupt.py)."""
        if self.gate is None:
            yield
            return
        with self.gate.updating():
            self.gate.cut()
            self._post(*self.PAUSE)
            try:
                yield
            except BaseException:
                try:  # the load's own error is the one raised
                    self._post(*self.UNPAUSE)
                except Exception as e:  # noqa: BLE001
                    log.warning("%s server %s: unpausing after a failed weight load failed too: "
                                "%s", self.NAME, self.url, e)
                raise
            self._post(*self.UNPAUSE)  # a server left paused would hold every request

    def _use_gate(self) -> None:
        """Under --partial-rollouts (config.partial_rollouts) weight updates cut the requests in
        flight through `gate` (rollout/interrupt.py)."""
        self.gate = UpdateGate(lambda: self.weight_version) if self.config.partial_rollouts \
            else None

    def _device_env(self) -> dict[str, str]:
        """The launch environment's device part: CUDA_VISIBLE_DEVICES for config.gpus."""
        gpus = self.config.gpus
        return {"CUDA_VISIBLE_DEVICES": visible_devices(gpus)} if gpus else {}

    def _use_weight_sync(self) -> None:
        """The weight sync that `config` (sync, bucket_bytes, dtype, work_dir) describes."""
        c = self.config
        self.sync = WeightSync(c.sync, c.work_dir, dtype=c.dtype, bucket_bytes=c.bucket_bytes,
                               shared_memory=self.SHARED_MEMORY)
        self.exporter, self.last_sync_seconds = self.sync.exporter, self.sync.last_seconds

    def set_weight_sync(self, sync: str, bucket_bytes: int | None = None) -> None:
        """How the weights reach the server from the next update_weights on (--weight-sync,
        --weight-sync-bucket-mb in bytes); collective-free, call it on every rank."""
        changes: dict = {"sync": sync}
        if bucket_bytes is not None:
            changes["bucket_bytes"] = bucket_bytes
        self.config = dataclasses.replace(self.config, **changes)  # checks the mode
        self.sync.close()
        self._use_weight_sync()

    def server_weight_version(self) -> int | None:
        """The weight version the server reports (None: untagged, or it cannot tell)."""
        raise NotImplementedError

    def _request(self, prompts: list[list[int]], n: int, params: SamplingParams,
                 ticket: Ticket | None = None) -> list[list[Completion]]:
        """One generate request and its parsed answer (BadAnswer when it cannot be parsed). With
        a `ticket` (--partial-rollouts) the request streams, keeps only what it reads while the
        ticket is live (UpdateGate.reading) and ends a response the cut stopped "abort"."""
        raise NotImplementedError

    # (path, payload) of the server's endpoints that free and retake its GPU memory
    RELEASE: tuple[str, Any] = ("", None)
    RESUME: tuple[str, Any] = ("", None)

    def release_memory(self) -> None:
        """A server on the trainer's GPUs frees its GPU memory for the training phase (weights
        offloaded to host memory, KV cache dropped); `resume_memory` takes it back. The server
        must run with its memory-saving mode on (VLLMConfig.sleep_mode, SGLangConfig.
        memory_saver). Rank 0, which owns the server; a no-op elsewhere."""
        if self.server is not None:
            self._post(*self.RELEASE)

    def resume_memory(self) -> None:
        if self.server is not None:
            self._post(*self.RESUME)

    def stats(self) -> dict[str, float]:
        """Metrics for the trainer's log (global rank 0, the one client): generate requests so
        far and, under --partial-rollouts, the responses a weight update cut and continued (one
        cut twice counts twice)."""
        out = {"rollout/generate_calls": float(self.num_generate_calls)}
        if self.gate is not None:
            out["rollout/interrupted_responses"] = float(self.num_interrupted)
        return out

    def start(self, wait: bool = True) -> None:
        """Start the server (rank 0) and share its URL with every rank (collective when
        distributed; the other ranks wait for the startup outside the collectives, and a failed
        one raises on every rank: parallel.run_on_rank). wait=False only launches the process
        (to boot several servers at once); call start() again to wait for it (wait=False is not
        collective: no rank waits)."""
        if not wait:
            if self.server is not None:
                self.server.start(wait=False)
            return

        def boot() -> str | None:
            if self.server is None:
                return self.url
            self.server.start()
            return self.server.url

        self.url = run_on_rank(self.client_rank, boot, f"starting the {self.NAME} server")

    def _post(self, path: str, payload, timeout: float = 600.0):
        """POST to the server: through the ManagedServer on rank 0 (restart and retry on a dead
        process), directly elsewhere."""
        if self.server is not None:
            return self.server.post(path, payload, timeout)
        return http_json("POST", self.url + path, payload, timeout)

    def health(self) -> bool:
        """True when the server answers; a managed server that does not is restarted first."""
        if self.server is None:
            return True
        if self.server.healthy():
            return True
        if self.server.managed:
            self.server.ensure_healthy()
        return self.server.healthy()

    def _stop_server(self) -> None:
        if self.server is not None and self.server.managed:
            self.server.close()
