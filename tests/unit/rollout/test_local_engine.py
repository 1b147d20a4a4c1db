"""LocalEngine: the KV-cached decoding path against the full-recompute path at TP=1.

Both paths run on the same Policy object in one process (gloo, world size 1): for the same seed
they must draw the same tokens (same generator use) with log-probs within 1e-5, on prompts of
unequal length (left padding), with stop tokens and with max_new_tokens.
"""
import dataclasses
import os

import pytest
import torch

pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def policy(tiny_qwen2):
    from megatron_rl.models.config import ModelArgs
    from megatron_rl.models.policy import Policy
    from megatron_rl.parallel import ParallelConfig, destroy_distributed, init_distributed

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    init_distributed(ParallelConfig())
    try:
        args = ModelArgs.from_pretrained(tiny_qwen2)
        pol = Policy(args, trainable=True)
        pol.load_hf(tiny_qwen2)
        yield pol
    finally:
        destroy_distributed()


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in (1, 4, 9, 6)]


def _both(policy, prompts, n, params):
    from megatron_rl.rollout.local import LocalEngine

    kv_engine, full_engine = LocalEngine(policy), LocalEngine(policy, kv_cache=False)
    assert kv_engine.kv_cache and not full_engine.kv_cache
    return kv_engine.generate(prompts, n, params), full_engine.generate(prompts, n, params)


def _assert_same(kv, full):
    assert len(kv) == len(full)
    for g_kv, g_full in zip(kv, full):
        assert len(g_kv) == len(g_full)
        for a, b in zip(g_kv, g_full):
            assert a.token_ids == b.token_ids
            assert a.finish_reason == b.finish_reason
            torch.testing.assert_close(torch.tensor(a.rollout_logprobs),
                                       torch.tensor(b.rollout_logprobs), rtol=0, atol=1e-5)


@pytest.mark.distributed
def test_sampling_unequal_prompts_max_new_tokens(policy):
    from megatron_rl.rollout.base import SamplingParams

    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=5)
    kv, full = _both(policy, _prompts(), 3, params)
    _assert_same(kv, full)
    comps = [c for g in kv for c in g]
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in comps)
    # the samples of a group differ (the generator is really used)
    assert len({tuple(c.token_ids) for c in kv[2]}) > 1


@pytest.mark.distributed
def test_stop_tokens_and_truncated_sampling(policy):
    from megatron_rl.rollout.base import SamplingParams

    prompts = _prompts()
    params = SamplingParams(max_new_tokens=10, temperature=0.8, top_k=50, top_p=0.9, seed=3)
    # stop on tokens this very sampling draws without stop tokens: with the same seed the run
    # with them draws the same tokens until its first stop, so some sequences stop early
    # (whatever the device's random stream)
    probe = _both(policy, prompts, 2, params)[0]
    drawn = [t for g in probe for c in g for t in c.token_ids[1:6]]
    stop = sorted(set(drawn[::7]))[:4]
    params = dataclasses.replace(params, stop_token_ids=stop)
    kv, full = _both(policy, prompts, 2, params)
    _assert_same(kv, full)
    comps = [c for g in kv for c in g]
    assert any(c.finish_reason == "stop" for c in comps)
    for c in comps:
        if c.finish_reason == "stop":
            assert c.token_ids[-1] in stop and len(c.token_ids) <= 10
            assert not set(c.token_ids[:-1]) & set(stop)


@pytest.mark.distributed
def test_greedy_and_single_token(policy):
    from megatron_rl.rollout.base import SamplingParams

    prompts = _prompts()
    kv, full = _both(policy, prompts, 1, SamplingParams(max_new_tokens=8, temperature=0.0))
    _assert_same(kv, full)
    kv, full = _both(policy, prompts, 2, SamplingParams(max_new_tokens=1, seed=1))
    _assert_same(kv, full)
    assert all(len(c.token_ids) == 1 for g in kv for c in g)


@pytest.mark.distributed
def test_kv_logprobs_match_teacher_forced_forward(policy):
    """The KV path's rollout log-probs (T=1, no truncation) are the policy's own log-probs of
    the drawn tokens, as computed by one teacher-forced forward of prompt + response."""
    from megatron_rl.rollout.base import SamplingParams
    from megatron_rl.rollout.local import LocalEngine

    prompt = _prompts()[2]
    (group,) = LocalEngine(policy).generate([prompt], 2, SamplingParams(max_new_tokens=7, seed=9))
    for c in group:
        seq = torch.tensor([prompt + c.token_ids])
        lp = policy.token_logprobs(seq, 1)[0, len(prompt) - 1:].cpu()
        torch.testing.assert_close(lp, torch.tensor(c.rollout_logprobs), rtol=0, atol=1e-5)


@pytest.mark.distributed
def test_selection(policy, monkeypatch):
    from megatron_rl.rollout.local import LocalEngine

    from megatron_rl.models.decode import unsupported_reason

    assert unsupported_reason(policy) is None
    assert LocalEngine(policy).kv_cache
    monkeypatch.setenv("MEGATRON_RL_LOCAL_KV_CACHE", "0")
    assert not LocalEngine(policy).kv_cache
    assert LocalEngine(policy, kv_cache=True).kv_cache


@pytest.mark.distributed
def test_kv_path_matches_full_recompute_in_train_and_eval_mode(policy):
    """Generation does not depend on the module's train/eval mode, and the default KV path
    leaves that mode as it found it. In each mode the KV-cached path and the full-recompute path
    draw the same tokens with log-probs within 1e-5 (same seed), and both modes give the same
    samples (no dropout or other train-mode behaviour leaks into sampling)."""
    from megatron_rl.rollout.base import SamplingParams
    from megatron_rl.rollout.local import LocalEngine

    prompts = _prompts()
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=11)
    by_mode = {}
    try:
        for mode in (True, False):
            policy.model[0].train(mode)
            kv = LocalEngine(policy, kv_cache=True).generate(prompts, 3, params)
            # the KV path reads the weights directly: it must not switch the modules' mode
            assert all(m.training == mode for m in policy.model[0].modules())
            full = LocalEngine(policy, kv_cache=False).generate(prompts, 3, params)
            _assert_same(kv, full)
            assert len({tuple(c.token_ids) for g in kv for c in g}) > len(prompts)  # sampled
            by_mode[mode] = kv
        _assert_same(by_mode[True], by_mode[False])
    finally:
        policy.model[0].train(True)
