"""--partial-rollouts: a weight update interrupts the generation in flight, which goes on under
the new weights.

- The process engine: a long generate call interrupted by a weight update returns complete
  responses whose tokens each carry the version that sampled them; each version's segment and
  its log-probs are what that version's weights give (transformers on the saved ids), the first
  segment is the uninterrupted call's, and the second a fresh generate of prompt + first
  segment under the new weights with the continuation's seed (no KV kept across the update).
- The trainer: --async-level 1 --partial-rollouts trains and logs the versions of its samples,
  single-turn and agent episodes (the masking of samples beyond --max-token-staleness:
  tests/unit/rollout/test_versions.py)."""
import threading
import time

import pytest

from conftest import read_metrics, train_args, train_cmd, train_env  # tests/e2e/conftest.py
from rollout_checks import hf_logprobs

pytestmark = pytest.mark.distributed  # torch.distributed (world size 1) in subprocesses


def test_interrupted_response_is_each_versions_own(tiny_char_model, tiny_char_ref, tmp_path):
    from megatron_rl.rollout.base import SamplingParams, resume_seed
    from megatron_rl.rollout.process import ProcessConfig, ProcessEngine

    engine = ProcessEngine(ProcessConfig(hf_checkpoint=tiny_char_model, partial_rollouts=True,
                                         work_dir=str(tmp_path / "w")))
    try:
        prompts = [[5 + i, 6, 7 + i] for i in range(16)]
        n, total = 4, 240  # no stop token: every response runs to total tokens
        params = SamplingParams(max_new_tokens=total, seed=11)
        plain = engine.generate(prompts, n, params)  # version 0, not interrupted
        assert all(c.token_versions == [0] * total for g in plain for c in g)
        result: list = []
        worker = threading.Thread(target=lambda: result.append(
            engine.generate(prompts, n, params)))
        worker.start()
        while not engine._lock.locked():  # the request is in the child
            time.sleep(0.01)
        time.sleep(0.3)
        with engine.weight_update(1):  # the reference's weights, as version 1
            engine.load_weights_from_path(tiny_char_ref, 1)
        worker.join(300)
        out = [c for g in result[0] for c in g]
        flat_plain = [c for g in plain for c in g]
        k = out[0].token_versions.count(0)  # tokens sampled before the update
        assert 1 <= k < total, k
        for c in out:
            assert len(c.token_ids) == len(c.rollout_logprobs) == total
            assert c.token_versions == [0] * k + [1] * (total - k)
            assert c.finish_reason == "length"
        # the first segment is the uninterrupted call's, token for token and log-prob
        for c, p in zip(out, flat_plain):
            assert c.token_ids[:k] == p.token_ids[:k]
            assert c.rollout_logprobs[:k] == p.rollout_logprobs[:k]
        # the rest: a fresh generate from prompt + first segment under version 1, seeded
        # resume_seed(seed, 1)
        rows = [prompts[i // n] + c.token_ids[:k] for i, c in enumerate(out)]
        again = engine.generate(rows, 1, SamplingParams(max_new_tokens=total - k,
                                                        seed=resume_seed(11, 1)))
        for c, (a,) in zip(out, again):
            assert c.token_ids[k:] == a.token_ids
            assert c.rollout_logprobs[k:] == a.rollout_logprobs
        # each segment's log-probs are its version's weights' own
        seqs = [prompts[i // n] + c.token_ids for i, c in enumerate(out)]
        starts = [len(prompts[i // n]) for i in range(len(out))]
        v0 = hf_logprobs(tiny_char_model, seqs, starts)
        v1 = hf_logprobs(tiny_char_ref, seqs, starts)
        for c, a, b in zip(out, v0, v1):
            assert c.rollout_logprobs[:k] == pytest.approx(a[:k], abs=1e-4)
            assert c.rollout_logprobs[k:] == pytest.approx(b[k:], abs=1e-4)
            assert c.rollout_logprobs[k:] != pytest.approx(a[k:], abs=1e-2)  # other weights
        assert engine.stats()["rollout/interrupted_responses"] == len(out)
    finally:
        engine.shutdown()


def _train(model, ref, data, save, extra):
    import subprocess

    args = train_args(model, data, save, 4, ["--rollout-engine", "process", "--async-level", "1",
                                             "--partial-rollouts", "--max-new-tokens", "48",
                                             *extra], ref=ref)
    proc = subprocess.run(train_cmd(*args), env=train_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return read_metrics(save)


@pytest.mark.parametrize("function", [
    [], ["--rollout-function", "agent", "--agent-max-turns", "2", "--agent-max-tokens", "120"]],
    ids=["single-turn", "agent"])
def test_trainer_logs_versions_and_drops_stale_samples(tiny_char_model, tiny_char_ref,
                                                       arithmetic_jsonl, tmp_path, function):
    rows = _train(tiny_char_model, tiny_char_ref, arithmetic_jsonl, str(tmp_path / "p"),
                  function)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert 1.0 <= r["rollout/versions_per_sample"] <= 2.0
        assert 0.0 <= r["rollout/token_version_lag"] <= r["rollout/token_version_lag_max"] <= 1.0
        assert r["rollout/stale_dropped"] == 0.0  # no --max-token-staleness
    assert rows[0]["rollout/token_version_lag_max"] == 0.0  # generated by the weights trained
    # the update does not wait for the batch ahead: it interrupts it
    assert all(r["time/rollout_wait"] < 0.05 for r in rows)
    assert all("rollout/interrupted_responses" in r for r in rows)  # the engine's counter


def test_partial_rollouts_flags_are_checked():
    from megatron_rl.config import parse_config

    base = ["--hf-checkpoint", "x", "--train-data", "y", "--partial-rollouts"]
    with pytest.raises(ValueError, match="--partial-rollouts.*--async-level >= 1"):
        parse_config(base + ["--rollout-engine", "process"])
    with pytest.raises(ValueError, match="--partial-rollouts.*--rollout-engine local"):
        parse_config(base + ["--async-level", "1"])
    for engine in ("vllm", "sglang"):  # the servers are cut through their pause endpoints
        parse_config(base + ["--async-level", "1", "--rollout-engine", engine])
    with pytest.raises(ValueError, match="--partial-rollouts with --routing-replay on "
                                         "--rollout-engine sglang"):
        parse_config(base + ["--async-level", "1", "--rollout-engine", "sglang",
                             "--routing-replay"])
    with pytest.raises(ValueError, match="--max-token-staleness.*--partial-rollouts"):
        parse_config(["--hf-checkpoint", "x", "--train-data", "y", "--max-token-staleness", "1"])
    # a token lags at most --async-level updates: a limit at or above it would never drop one
    with pytest.raises(ValueError, match="--max-token-staleness 1: a token lags at most "
                                         "--async-level 1"):
        parse_config(base + ["--async-level", "1", "--rollout-engine", "process",
                             "--max-token-staleness", "1"])
    parse_config(base + ["--async-level", "2", "--rollout-engine", "process",
                         "--max-token-staleness", "1"])
    # the agent loop carries each policy token's version into its trajectories; a function
    # that does not declare it would count a cut call's tokens as the first version's
    parse_config(base + ["--async-level", "1", "--rollout-engine", "process",
                         "--rollout-function", "agent"])
    with pytest.raises(ValueError, match="--partial-rollouts with --rollout-function "
                                         "two_turn_rollout:two_turns: .*token_versions"):
        parse_config(base + ["--async-level", "1", "--rollout-engine", "process",
                             "--rollout-function", "two_turn_rollout:two_turns"])
    with pytest.raises(ValueError, match="--partial-rollouts with --deterministic-mode"):
        parse_config(base + ["--async-level", "1", "--rollout-engine", "process",
                             "--deterministic-mode"])
