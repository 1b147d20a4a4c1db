"""Interrupting generation at a weight update (--partial-rollouts), for the engines that hold
weights of their own: the process engine, a vLLM or SGLang server, a pool of them.

A weight update does not wait for the responses in flight. On the engine's client:

  1. the update closes the engine's `UpdateGate` (`updating()`): a generate request not yet
     sent waits for the new weights;
  2. `cut()`: no request sent before reads another token, and the engine stops the requests in
     flight through its own mechanism (the process engine's abort flag; vLLM's
     `POST /pause?mode=abort`; SGLang's `POST /pause_generation` with mode "abort"), so each
     answers with what it has, finish reason "abort";
  3. the new weights are loaded and the engine's version set; the engine resumes and the gate
     opens;
  4. each generate call whose responses were cut continues them (`continue_interrupted`): the
     prompt and the tokens so far are the new prompt, the rest of --max-new-tokens the budget,
     `base.resume_seed(seed, version, row)` the seed. Nothing of the KV cache is kept across
     the update: the continuation prefills the whole prefix under the new weights. An engine
     that serves one request at a time continues the responses cut after the same number of
     tokens in one request; a server continues each in a request of its own, all at once (the
     server batches them: one request per length would run the lengths one after another).

Why each token's version is exact: a request enters the gate (`enter`, a `Ticket`: the epoch
and the weight version then served) before it is sent, and keeps a token only while its epoch
is current (`reading`). The epoch moves on (`cut`) before the engine is stopped and the weights
change, so every token kept was sampled by the ticket's version. A token sampled after the cut
is not kept, whatever became of its request: one that reached a server only after the pause
waits there and runs under the new weights after the resume, unread (its client closes it).

A response's tokens, log-probs (each the engine's own under the weights that sampled it, the mu
of that version) and `Completion.token_versions` are the concatenation of its segments, so a
generate call still returns complete responses (docs/results.md "Mixed versions": what the
KL's gradient is over such samples; rollout/versions.py: their metrics and
--max-token-staleness).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import threading
from typing import Callable, Iterator, Sequence

import torch

from megatron_rl.rollout.base import Completion


# Tokens per streamed event of a server's request (vLLM's --stream-interval, SGLang's
# stream_interval): an event per token costs a vLLM CPU server sharing one core with its API
# process ~1.4x the generate time of an unstreamed request, every 8 tokens ~1.03x. A cut loses
# the tokens sampled since the last event (fewer than this many per response): the continuation
# samples them again under the new weights.
STREAM_INTERVAL = 8

MAX_CONCURRENT = 256  # continuation requests in flight at once (a server queues the rest)


@dataclasses.dataclass(frozen=True)
class Ticket:
    """A request's pass through the gate: the cut epoch it was sent in, and the weight version
    that samples its tokens."""

    epoch: int
    version: int


class UpdateGate:
    """What a weight update shares with the generate requests of one engine (module docstring).
    `version()`: the weight version the engine serves (read under the gate's lock)."""

    def __init__(self, version: Callable[[], int]):
        self._cond = threading.Condition()
        self._updating = False
        self._epoch = 0
        self._version = version

    def enter(self) -> Ticket:
        """Wait until no update is under way; the ticket of a request sent now."""
        with self._cond:
            self._cond.wait_for(lambda: not self._updating)
            return Ticket(self._epoch, self._version())

    @contextlib.contextmanager
    def updating(self) -> Iterator[None]:
        """The block is a weight update: requests wait at `enter` until it ends (after the new
        version is set, inside the block)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._updating)
            self._updating = True
        try:
            yield
        finally:
            with self._cond:
                self._updating = False
                self._cond.notify_all()

    def cut(self) -> None:
        """From now on no request sent before reads another token."""
        with self._cond:
            self._epoch += 1

    @contextlib.contextmanager
    def reading(self, ticket: Ticket) -> Iterator[bool]:
        """`with gate.reading(ticket) as live:` keep what the request just read only when
        `live` (no cut since it was sent); a cut waits for the block."""
        with self._cond:
            yield self._epoch == ticket.epoch

    @property
    def updating_now(self) -> bool:
        """Whether an update is under way (a request about to be sent may check it again once it
        holds its engine's channel: the process engine's pipe)."""
        with self._cond:
            return self._updating


def label(completions: Sequence[Sequence[Completion]], version: int) -> None:
    """Tag every token of `completions` (one request's answer) with the weight version that
    sampled it."""
    for group in completions:
        for c in group:
            c.token_versions = [version] * len(c.token_ids)


# resume(prompts, max_new_tokens, row) -> one completion per prompt (n=1), each token labelled
# with its version: the engine waits for the weights loaded after the cut and samples with
# base.resume_seed(seed, version, row), `row` the first of the prompts' completions
Resume = Callable[[list[list[int]], int, int], list[list[Completion]]]


def continue_interrupted(prompts: Sequence[Sequence[int]], flat: list[Completion], n: int,
                         max_new_tokens: int, resume: Resume, concurrent: bool = False) -> int:
    """Complete, in place, each of `flat` (prompt i // n's completion i, its tokens labelled)
    that a weight update cut (finish reason "abort"), with `resume`; a continuation cut again is
    continued again. `concurrent` (an engine that batches requests in flight): each response in
    a request of its own, all at once; else the responses cut after the same number of tokens
    in one request, one request at a time. The number of continuations made (a response cut
    twice counts twice)."""
    made = 0
    while True:
        cut = []
        for i, c in enumerate(flat):
            if c.finish_reason == "abort":
                if len(c.token_ids) >= max_new_tokens:  # its budget spent when it was cut
                    c.finish_reason = "length"
                else:
                    cut.append(i)
        if not cut:
            return made
        made += len(cut)
        if concurrent:
            calls = [[i] for i in cut]
        else:
            by_length: dict[int, list[int]] = {}
            for i in cut:
                by_length.setdefault(len(flat[i].token_ids), []).append(i)
            calls = [rows for _, rows in sorted(by_length.items())]
        asks = [[list(prompts[i // n]) + flat[i].token_ids for i in rows] for rows in calls]

        def call(k: int) -> list[list[Completion]]:
            rows = calls[k]
            return resume(asks[k], max_new_tokens - len(flat[rows[0]].token_ids), rows[0])

        if concurrent and len(calls) > 1:
            with cf.ThreadPoolExecutor(min(len(calls), MAX_CONCURRENT),
                                       thread_name_prefix="continue") as pool:
                answers = list(pool.map(call, range(len(calls))))
        else:
            answers = [call(k) for k in range(len(calls))]
        for rows, ask, got in zip(calls, asks, answers):
            for i, p, (c,) in zip(rows, ask, got):
                old = flat[i]
                old.token_ids = old.token_ids + c.token_ids
                old.rollout_logprobs = old.rollout_logprobs + c.rollout_logprobs
                old.token_versions = (old.token_versions or []) + (c.token_versions or [])
                old.finish_reason = c.finish_reason
                if old.routed_experts is not None and c.routed_experts is not None:
                    # each position is routed once, when fed in: the prefix's last token is
                    # first fed in by the continuation
                    old.routed_experts = torch.cat(
                        [old.routed_experts, c.routed_experts[len(p) - 1:]])
