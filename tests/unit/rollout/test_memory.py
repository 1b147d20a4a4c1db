"""A rollout server's GPU memory budget (megatron_rl.rollout.memory) against a hand computation,
and SGLang's terms for it."""
import pytest

from megatron_rl.rollout.memory import GiB, model_server_memory, server_memory

# Llama-3.1-8B: 32 layers, 8 KV heads of 128, 8,030,261,248 parameters, bf16, on 79 GiB at 0.25
LLAMA_8B = dict(num_layers=32, num_kv_heads=8, head_dim=128, num_params=8_030_261_248,
                dtype_bytes=2)


def test_budget_by_hand():
    plan = server_memory(**LLAMA_8B, gpu_bytes=79 * GiB, utilization=0.25, context_len=3072)
    # share: 0.25 x 79 x 2^30 = 21,206,401,024 B; weights 2 x 8,030,261,248 = 16,060,522,496 B;
    # reserve 3 x 2^30 = 3,221,225,472 B; KV cache 21,206,401,024 - 16,060,522,496
    # - 3,221,225,472 = 1,924,653,056 B; per token 2 x 32 x 8 x 128 x 2 = 131,072 B (128 KiB);
    # 1,924,653,056 // 131,072 = 14,683 tokens (14,683 x 131,072 = 1,924,530,176)
    assert plan.share_bytes == 21_206_401_024
    assert plan.weights_bytes == 16_060_522_496
    assert plan.kv_bytes == 1_924_653_056
    assert plan.kv_bytes_per_token == 131_072
    assert plan.kv_tokens == 14_683
    assert plan.fits  # 14,683 >= 3,072: four requests of full length at a time
    # the model's own length, 131,072 tokens, needs 16 GiB of KV cache: vLLM would refuse
    assert not server_memory(**LLAMA_8B, gpu_bytes=79 * GiB, utilization=0.25,
                             context_len=131_072).fits
    # one token more than the cache holds does not fit; a share below weights + reserve holds none
    assert not server_memory(**LLAMA_8B, gpu_bytes=79 * GiB, utilization=0.25,
                             context_len=14_684).fits
    assert server_memory(**LLAMA_8B, gpu_bytes=79 * GiB, utilization=0.2,
                         context_len=1).kv_tokens == 0


def test_tensor_parallel_splits_weights_and_kv_heads():
    """TP 4: a quarter of the weights; 8 KV heads -> 2 per GPU. TP 16: heads are replicated,
    at least one per GPU."""
    tp4 = server_memory(**LLAMA_8B, gpu_bytes=79 * GiB, utilization=0.25, context_len=1,
                        tp_size=4)
    assert tp4.weights_bytes == 16_060_522_496 // 4
    assert tp4.kv_bytes_per_token == 2 * 32 * 2 * 128 * 2
    tp16 = server_memory(**LLAMA_8B, gpu_bytes=79 * GiB, utilization=0.25, context_len=1,
                         tp_size=16)
    assert tp16.kv_bytes_per_token == 2 * 32 * 1 * 128 * 2


def test_model_args_give_the_checkpoints_numbers():
    """The parameter count comes from the HF checkpoint's tensors: Llama-3.1-8B's 8,030,261,248."""
    from megatron_rl.models import ModelArgs

    args = ModelArgs.from_hf_config({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072})
    assert model_server_memory(args, dtype_bytes=2, gpu_bytes=79 * GiB, utilization=0.25,
                               context_len=3072) == server_memory(
        **LLAMA_8B, gpu_bytes=79 * GiB, utilization=0.25, context_len=3072)


def test_sglang_terms_keep_the_budget():
    """SGLang's pool: min(max_total_tokens, mem_fraction_static x free - weights) / per token.
    With the memory free at its start equal to the share or above, it is the plan's KV cache."""
    plan = server_memory(**LLAMA_8B, gpu_bytes=79 * GiB, utilization=0.25, context_len=3072)
    fraction, tokens = plan.sglang_args()
    assert tokens == plan.kv_tokens == 14_683
    for free in (plan.share_bytes, 79 * GiB):  # a GPU shared with the trainer, or its own
        pool = min(tokens, int(fraction * free - plan.weights_bytes) // plan.kv_bytes_per_token)
        assert pool == tokens
    # (16,060,522,496 + 14,683 x 131,072) / 21,206,401,024 = 0.84808..., rounded up
    assert fraction == pytest.approx(0.8481)
    # a budget that only the reserve's estimate makes short: at least one full request
    short = server_memory(**LLAMA_8B, gpu_bytes=79 * GiB, utilization=0.25, context_len=20_000)
    assert short.sglang_args()[1] == 20_000
