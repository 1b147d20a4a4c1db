"""The arithmetic of the full-state-dict gather's host memory (models.weights.gather_memory),
against hand computations, and which ranks the gather routes through (GatherPlan), on a
megatron-ordered grid of ranks. The gather itself runs in tests/distributed/test_weight_gather.py.
"""
import pytest

from megatron_rl.models.config import ModelArgs
from megatron_rl.models.weights import GatherPlan, Place, gather_memory


def _tiny(**kw) -> ModelArgs:
    """vocab 8, hidden 4, 2 query heads and 1 KV head of dim 2, FFN 6, no biases, untied.
    Elements: embedding 32 and output layer 32 (TP-split), final norm 4; per layer: two norms
    4 + 4 (replicated), qkv [(2 + 2) 2, 4] = 32, proj [4, 4] = 16, fc1 [12, 4] = 48,
    fc2 [4, 6] = 24 (TP-split)."""
    base = dict(architecture="Qwen2ForCausalLM", vocab_size=8, hidden_size=4,
                intermediate_size=6, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=2)
    return ModelArgs(**{**base, **kw})


def test_gather_memory_matches_a_hand_computation_tp2_pp2():
    m = gather_memory(_tiny(), tp=2, pp=2, bytes_per_element=2)
    # full: 32 + 32 + 4 + 2 x (8 + 32 + 16 + 48 + 24) = 324 elements; split kinds: 304
    assert m.full == m.dst == 2 * 324 and m.other == 0 and m.largest == 2 * 48
    # TP-unsplit shards per stage (a replicated tensor counted TP = 2 times): a layer
    # 120 + 2 x 8 = 136; stage 0 = embedding 32 + layer 136 = 168; stage 1 = layer 136 +
    # final norm 2 x 4 + output 32 = 176; M = 344. The worst rank is on stage 1, in the
    # pipeline exchange: its shards 176 + pickled input 176 + output buffer 2 x 176 + the
    # unpickled stages 344 = 1048 (the merge after it: 176 + 344 + 304 = 824)
    assert m.all_gather == 2 * 1048


def test_gather_memory_matches_a_hand_computation_tp1():
    m = gather_memory(_tiny(), bytes_per_element=4)
    # the host copy of the model 324 + what the merge's concatenations create 304
    assert (m.full, m.all_gather) == (4 * 324, 4 * 628)


def test_gather_memory_matches_a_hand_computation_ep2():
    """One sparse layer of 2 experts of FFN 2: router [2, 4] = 8 (replicated), per expert fc1
    [4, 4] = 16 and fc2 [4, 2] = 8."""
    args = _tiny(architecture="Qwen3MoeForCausalLM", num_hidden_layers=1, num_experts=2,
                 num_experts_per_tok=1, moe_intermediate_size=2)
    m = gather_memory(args, ep=2, bytes_per_element=2)
    # non-expert: 32 + 32 + 4 + 4 + 32 + 16 + 4 + 8 = 132, each expert 24: full 180, split 160
    assert m.full == 2 * 180
    # EP rank 0 holds 132 + 24 = 156 and sends all of it; rank 1 sends its expert, 24. Rank 0's
    # expert exchange: its shards 156 + pickled input 156 + output buffer 2 x 156 + unpickled
    # 180 = 804 (the merge: 156 + 180 + 160 = 496)
    assert m.all_gather == 2 * 804


def test_gather_memory_of_qwen2_5_7b_in_the_docs():
    """The table in models/weights.py and docs/rollout.md."""
    args = ModelArgs(architecture="Qwen2ForCausalLM", vocab_size=152064, hidden_size=3584,
                     intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                     num_key_value_heads=4, head_dim=128, qkv_bias=True)
    table = {(1, 1): 30.46, (8, 1): 30.46, (2, 2): 45.69, (8, 2): 45.70, (4, 4): 41.35}
    for (tp, pp), gb in table.items():
        m = gather_memory(args, tp, pp)
        assert (round(m.full / 1e9, 2), round(m.all_gather / 1e9, 2)) == (15.23, gb), (tp, pp)
        assert m.dst == m.full and m.other == 0
    assert round(gather_memory(args).largest / 1e9, 2) == 1.09  # the embedding


def _grid(tp: int, pp: int, dp: int) -> list[Place]:
    """megatron-core's rank order (tp fastest, then dp, then pp), expert parallelism 1."""
    places = []
    for r in range(tp * pp * dp):
        t, d, p = r % tp, r // tp % dp, r // (tp * dp)
        places.append(Place(r, t, p, 0,
                            tp_group=tuple(range(r - t, r - t + tp)),
                            pp_group=tuple(t + tp * d + tp * dp * q for q in range(pp)),
                            ep_group=(r,)))
    return places


@pytest.mark.parametrize("dst", [0, 5])
def test_gather_routes_through_one_replica_to_dst(dst):
    """TP2 x PP2 x DP2 (ranks 0-7): dst leads its TP group, the rank of its pipeline group on
    the other stage leads that one; the other data-parallel replica takes no part."""
    places = _grid(2, 2, 2)
    plans = {r: GatherPlan.build(places, dst, r) for r in range(8)}
    # dst 0 (tp 0, dp 0, stage 0): its pipeline peer is rank 4; dst 5 (tp 1, dp 0, stage 1):
    # rank 1
    peer = {0: 4, 5: 1}[dst]
    assert [p.rank for p in plans[0].leaders] == sorted([dst, peer], key=lambda r: r // 4)
    replica = {0: [0, 1, 4, 5], 5: [0, 1, 4, 5]}[dst]
    for r, plan in plans.items():
        if r in replica:
            assert plan.my_leader == (dst if r // 4 == dst // 4 else peer), r
        else:
            assert plan.my_leader is None, r
    with pytest.raises(ValueError, match="dst 8 is not a global rank"):
        GatherPlan.build(places, 8, 0)


def test_gather_in_the_second_replica_leaves_the_first_out():
    """DP2 at TP1 x PP1: dst 1 gathers alone; rank 0 is another replica."""
    places = _grid(1, 1, 2)
    assert GatherPlan.build(places, 1, 1).my_leader == 1
    assert GatherPlan.build(places, 1, 0).my_leader is None
