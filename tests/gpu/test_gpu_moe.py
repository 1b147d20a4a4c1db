"""A tiny Qwen3-MoE policy on the GPU (megatron-core's router and experts under CUDA): the local
engine's KV-cached decoding through the experts samples tokens whose log-probs equal the
trainer's recompute, returns each token's experts, and those are the experts megatron-core's own
forward picks; replaying them in the recompute changes nothing, replaying others does. fp32."""
import pytest

from gpu_helpers import single_gpu_rank

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]


@pytest.fixture(scope="module")
def moe_policy(tmp_path_factory):
    from megatron_rl.experiments.tiny_model import make_tiny_hf_checkpoint
    from megatron_rl.models import ModelArgs
    from megatron_rl.models.policy import Policy

    path = make_tiny_hf_checkpoint(str(tmp_path_factory.mktemp("tiny_moe_gpu")), "qwen3_moe",
                                   seed=3, norm_topk_prob=True, mlp_only_layers=[1],
                                   decoder_sparse_step=1)
    single_gpu_rank()
    policy = Policy(ModelArgs.from_pretrained(path), trainable=False)
    policy.load_hf(path)
    assert next(policy.parameters()).is_cuda, "the policy was not built on the GPU"
    return policy


def test_kv_decoding_and_routes_on_the_gpu(moe_policy):
    from megatron_rl.batch import pack_rollouts
    from megatron_rl.rollout.single_turn import single_turn_groups
    from megatron_rl.packing import Layout
    from megatron_rl.rollout.base import SamplingParams
    from megatron_rl.rollout.local import LocalEngine

    engine = LocalEngine(moe_policy)
    assert engine.kv_cache
    groups = engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=8, seed=1,
                                                        return_routed_experts=True))
    batch = pack_rollouts(single_turn_groups(PROMPTS, groups, [0.0] * 6), pad_token_id=0)
    mask = batch.loss_mask
    lay = Layout(packed=True)
    own: list = []
    replayed = moe_policy.token_logprobs(batch.tokens.cuda(), lay, seq_lengths=batch.seq_lengths,
                                         routes=batch.routed_experts, own_routes=own).cpu()
    free = moe_policy.token_logprobs(batch.tokens.cuda(), lay,
                                     seq_lengths=batch.seq_lengths).cpu()
    assert float(((free - batch.rollout_logprobs).abs() * mask).max()) < 1e-4
    assert float(((replayed - free).abs() * mask).max()) < 1e-5
    from megatron_rl.metrics import routing_metrics

    assert routing_metrics(own[0], batch.routed_experts,
                           batch.seq_lengths)["routing/differ_tokens"] < 0.05
    other = (batch.routed_experts + 1) % moe_policy.args.num_experts
    moved = moe_policy.token_logprobs(batch.tokens.cuda(), lay, seq_lengths=batch.seq_lengths,
                                      routes=other).cpu()
    assert float(((moved - free).abs() * mask).max()) > 1e-2
