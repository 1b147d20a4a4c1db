"""ServerPool's chunking, per-chunk seeds, reassembly and rotation, without inference servers.

The pool under test is the real one; its members are a deterministic in-test engine (each
completion spells out the prompt, the seed it was sampled with and its sample index) and real
VLLMEngine clients attached to a URL where nothing listens (a real connection refused, the
real ManagedServer path for a failed attached server). The same pool against real vLLM servers:
tests/e2e/test_server_pool.py.
"""
import json
import logging
import threading

import pytest

from megatron_rl.rollout.base import Completion, SamplingParams
from megatron_rl.rollout.base import prompt_seed
from megatron_rl.rollout.multi import ServerPool, split_chunks
from megatron_rl.rollout.base import ServerError
from megatron_rl.rollout.net import ServerRequestError, free_port

PROMPTS = [[10 + i, 1, 2][: 1 + i % 3] for i in range(7)]


class EchoEngine:
    """Completion j of prompt p under seed s: tokens [p[0], s, j]. A pool member's public
    contract (server_engine.ServerBackedEngine's) without a server behind it."""

    weight_version = 0
    server = None
    url = None
    sync = None
    needs_resync = False

    def __init__(self):
        self.calls = []

    def generate(self, prompts, n, params):
        self.calls.append(([tuple(p) for p in prompts], params.seed))
        return [[Completion([p[0], params.seed, j], [-1.0] * 3, "length") for j in range(n)]
                for p in prompts]

    def health(self):
        return True

    def shutdown(self):
        pass


class BadRequestEngine(EchoEngine):
    def generate(self, prompts, n, params):
        raise ServerRequestError("http://bad", 400, "invalid prompt")


def dead_vllm(tmp_path, i):
    """A vLLM engine attached to a port nobody listens on."""
    from megatron_rl.rollout.vllm_engine import VLLMConfig, VLLMEngine

    model = tmp_path / f"model{i}"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    url = f"http://127.0.0.1:{free_port()}"
    return VLLMEngine(str(model), VLLMConfig(work_dir=str(tmp_path / f"w{i}"), url=url),
                      start=False), url


def expected(prompts, n, seed, num_chunks):
    out = []
    for start, end in split_chunks(len(prompts), num_chunks):
        s = prompt_seed(seed, start)
        out += [[[p[0], s, j] for j in range(n)] for p in prompts[start:end]]
    return out


def tokens(out):
    return [[c.token_ids for c in row] for row in out]


def test_split_chunks_is_contiguous_and_balanced():
    assert split_chunks(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert split_chunks(2, 4) == [(0, 1), (1, 2)]
    assert split_chunks(0, 2) == []
    for p in range(0, 20):
        for k in range(1, 6):
            chunks = split_chunks(p, k)
            assert [i for s, e in chunks for i in range(s, e)] == list(range(p))
            sizes = [e - s for s, e in chunks]
            assert not sizes or max(sizes) - min(sizes) <= 1


def test_chunk_seeds():
    assert prompt_seed(None, 3) is None
    assert prompt_seed(42, 0) == 42  # one live server: what a lone engine would send
    seeds = {prompt_seed(s, start) for s in range(50) for start in range(50)}
    assert len(seeds) == 2500


def test_generate_spreads_contiguous_chunks_and_reassembles_in_order():
    engines = [EchoEngine() for _ in range(3)]
    pool = ServerPool(engines, start=False)
    out = pool.generate(PROMPTS, n=2, params=SamplingParams(seed=5))
    assert tokens(out) == expected(PROMPTS, 2, 5, 3)
    for engine, (start, end) in zip(engines, split_chunks(len(PROMPTS), 3)):
        assert engine.calls == [([tuple(p) for p in PROMPTS[start:end]], prompt_seed(5, start))]
    assert [m.served_prompts for m in pool.members] == [3, 2, 2]
    # same seed, same samples; fewer prompts than servers: one prompt each, the rest idle
    assert tokens(pool.generate(PROMPTS, n=2, params=SamplingParams(seed=5))) == tokens(out)
    assert tokens(pool.generate(PROMPTS[:2], 1, SamplingParams(seed=1))) == expected(
        PROMPTS[:2], 1, 1, 2)
    assert pool.generate([], n=2, params=SamplingParams()) == []
    assert pool.stats()["rollout/servers_live"] == 3


def test_dead_server_leaves_rotation_and_its_chunk_keeps_its_seed(tmp_path, caplog):
    echo = EchoEngine()
    dead, url = dead_vllm(tmp_path, 0)
    pool = ServerPool([echo, dead], start=False)
    with caplog.at_level(logging.WARNING, logger="megatron_rl.rollout.multi"):
        out = pool.generate(PROMPTS, n=2, params=SamplingParams(seed=9))
    # the same samples as two healthy servers would give: the chunk moved with its seed
    assert tokens(out) == expected(PROMPTS, 2, 9, 2)
    assert len(echo.calls) == 2
    assert not pool.members[1].live and url in (pool.members[1].last_error or "")
    assert any(url in r.getMessage() and "out of the rotation" in r.getMessage()
               for r in caplog.records)
    assert pool.stats()["rollout/servers_live"] == 1
    # later calls use the live server only (one chunk: the call's own seed)
    assert tokens(pool.generate(PROMPTS, 1, SamplingParams(seed=3))) == expected(PROMPTS, 1, 3, 1)
    assert pool.health()


def test_no_server_left_names_every_server_and_its_error(tmp_path):
    (a, url_a), (b, url_b) = dead_vllm(tmp_path, 0), dead_vllm(tmp_path, 1)
    pool = ServerPool([a, b], start=False)
    with pytest.raises(ServerError, match="no rollout server left") as info:
        pool.generate(PROMPTS, n=1, params=SamplingParams(seed=0))
    msg = str(info.value)
    assert url_a in msg and url_b in msg and "attached, not managed" in msg
    with pytest.raises(ServerError, match="no rollout server left"):
        pool.generate(PROMPTS, n=1, params=SamplingParams(seed=0))


class MeetingEngine(EchoEngine):
    """An EchoEngine whose requests wait, inside generate, until `barrier`'s parties are all
    in some member's generate at once (a BrokenBarrierError after 20 s otherwise)."""

    def __init__(self, barrier):
        super().__init__()
        self.barrier = barrier

    def generate(self, prompts, n, params):
        self.barrier.wait(timeout=20)
        return super().generate(prompts, n, params)


def test_concurrent_calls_are_spread_over_the_servers_and_served_at_once():
    """Single-prompt calls from four threads at once (the agent loop's episodes) on a pool of
    two: two requests in flight on each server at the same time, each call its own answer."""
    barrier = threading.Barrier(4)
    engines = [MeetingEngine(barrier) for _ in range(2)]
    pool = ServerPool(engines, start=False)
    out: dict[int, list] = {}

    def call(i):
        out[i] = tokens(pool.generate([PROMPTS[i]], 1, SamplingParams(seed=i)))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert out == {i: [[[PROMPTS[i][0], i, 0]]] for i in range(4)}
    assert [m.requests for m in pool.members] == [2, 2]
    assert pool.stats()["rollout/generate_calls"] == 4
    # calls one at a time go to the first server, as a lone engine would serve them
    barrier = threading.Barrier(1)
    for e in engines:
        e.barrier = barrier
    pool.generate([PROMPTS[0]], 1, SamplingParams(seed=0))
    assert [m.requests for m in pool.members] == [3, 2]


def test_bad_request_is_raised_and_keeps_the_server():
    pool = ServerPool([EchoEngine(), BadRequestEngine()], start=False)
    with pytest.raises(ServerRequestError, match="HTTP 400"):
        pool.generate(PROMPTS, n=1, params=SamplingParams(seed=0))
    assert all(m.live for m in pool.members)


def test_config_lists_urls_and_counts_servers(tmp_path):
    from megatron_rl.config import parse_config

    base = ["--hf-checkpoint", "m", "--train-data", "d.jsonl", "--rollout-engine", "vllm"]
    cfg = parse_config(base + ["--rollout-url", "http://a:1", "http://b:2"])
    assert cfg.rollout.rollout_url == ["http://a:1", "http://b:2"]
    assert parse_config(base).rollout.rollout_url == []
    assert parse_config(base + ["--rollout-num-servers", "3"]).rollout.rollout_num_servers == 3
    recipe = tmp_path / "r.yaml"
    recipe.write_text("rollout_url: http://a:1\n")  # one URL as a plain string
    assert parse_config(["--config", str(recipe)] + base).rollout.rollout_url == ["http://a:1"]
    with pytest.raises(ValueError, match="give one of them"):
        parse_config(base + ["--rollout-url", "http://a:1", "--rollout-num-servers", "2"])
    with pytest.raises(ValueError, match="needs --rollout-engine"):
        parse_config(base[:4] + ["--rollout-num-servers", "2"])
