"""Host synchronisations of the hot loops, counted against budgets (megatron_rl.hostsync).

On a GPU each synchronisation stalls the host until the device drains its queue; in a loop
over layers, experts or tokens that repeats on every pass. These budgets hold per unit of work,
and none grows with the number of layers, experts or tokens (each is checked at two sizes):

- a decode step of the in-process engine (LocalEngine, KV cache): 1, the flag that says whether
  every sequence has stopped; the KVDecoder's own step: 0, dense and mixture-of-experts alike.
  The prefill, once per generation: 1 per mixture-of-experts layer (its experts' token counts).
- a packed forward of the trainer's model (local spec, SDPAttention, megatron's unfused RoPE):
  1, cu_seqlens read to the host once; 0 when the caller has its values on the host
  (make_packed_seq_params); the backward: 0. The same for both ways SDPAttention attends the
  row: the per-sequence loop, and the one varlen_attn call per layer of the CUDA path (fp16/bf16),
  emulated here by models.packed_attention.reference_varlen_attn.
- the trainer's packed forwards (runner.forward_backward over packing's microbatches: the RL
  loss with its backward, with the reference's forward beside, the scoring of log-probs,
  expert-parallel peers' padding): 0 for the whole call, the microbatches carry their segment
  boundaries on the host ("cu_seqlens_host") and the runner hands them to the attention.
- the RL loss of a microbatch (update.make_rl_loss_fn: Policy.score through the fused log-prob
  op or its torch reference, policy_loss with the KL in the reward, in the loss, or exact),
  forward and backward: 0; the advantages of a batch (build_advantages): 0.

On CPU the counter runs in its CPU mode: every tensor stands for a device tensor, so a read of a
host tensor counts too (the engine's final copy of the finished batch to the host does; the
per-step budget is measured as the difference between two generation lengths). The inputs live
on megatron_rl.parallel.device(), so on a GPU the same tests count what synchronises there.
"""


import pytest
import torch

from megatron_rl.hostsync import HostSyncCounter

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.hostsync, pytest.mark.distributed]

VOCAB = 96
DENSE = dict(architecture="Qwen2ForCausalLM", vocab_size=VOCAB, hidden_size=32,
             intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             qkv_bias=True, max_position_embeddings=64)
MOE = dict(DENSE, architecture="Qwen3MoeForCausalLM", qkv_bias=False, qk_norm=True,
           num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)


def _args(layers: int, experts: int = 0):
    from megatron_rl.models.config import ModelArgs

    if experts:
        return ModelArgs(**MOE, num_hidden_layers=layers, num_experts=experts)
    return ModelArgs(**DENSE, num_hidden_layers=layers)


def _policy(layers: int, experts: int = 0, **kw):
    from megatron_rl.models.policy import Policy

    torch.manual_seed(0)
    return Policy(_args(layers, experts), trainable=False, **kw)


def _dev():
    from megatron_rl.parallel import device

    return device()


def _count(fn) -> HostSyncCounter:
    with HostSyncCounter() as syncs:
        fn()
    return syncs


# -- decoding --------------------------------------------------------------------------------
SIZES = [(2, 0), (4, 0), (2, 2), (2, 4), (4, 4)]  # (layers, experts): dense, then MoE


def _decoder_syncs(policy) -> tuple[HostSyncCounter, HostSyncCounter]:
    """(prefill, one step) of a KVDecoder over a left-padded batch."""
    from megatron_rl.models.decode import KVDecoder

    B, P = 3, 5
    tokens = torch.randint(3, policy.args.vocab_size, (B, P + 1), device=_dev())
    valid = torch.ones(B, P + 1, dtype=torch.bool, device=_dev())
    valid[0, :2] = False  # a shorter prompt, left-padded
    pos = (valid.long().cumsum(-1) - 1).clamp(min=0)
    allowed = torch.ones(P + 1, P + 1, dtype=torch.bool, device=_dev()).tril() & valid[:, None]
    decoder = KVDecoder(policy, B, P + 1)
    prefill = _count(lambda: decoder.forward(tokens[:, :P], pos[:, :P], allowed[:, None, :P, :P],
                                             routes=[]))
    step = _count(lambda: decoder.forward(tokens[:, P:], pos[:, P:], allowed[:, None, P:],
                                          routes=[]))
    return prefill, step


def _engine_step_syncs(policy) -> float:
    """Host synchronisations per decoding step of LocalEngine.generate (sampling with top-k and
    top-p, routed experts recorded for MoE models, no stop token): the difference between 5
    and 2 new tokens, over the 3 extra steps."""
    from megatron_rl.rollout.base import SamplingParams
    from megatron_rl.rollout.local import LocalEngine

    engine = LocalEngine(policy)
    assert engine.kv_cache
    totals = []
    for new in (2, 5):
        params = SamplingParams(max_new_tokens=new, temperature=0.8, top_k=20, top_p=0.9, seed=1,
                                stop_token_ids=[],
                                return_routed_experts=bool(policy.args.num_experts))
        syncs = _count(lambda: engine.generate([[5, 6, 7], [8, 9]], 2, params))
        totals.append(syncs.total)
    return (totals[1] - totals[0]) / 3


def test_decode_step_budget_does_not_grow_with_layers_or_experts(dist_env):
    """KVDecoder step: 0; engine step: 1 (`bool(done)`); prefill: 1 per MoE layer."""
    steps, engine_steps, prefills = {}, {}, {}
    for layers, experts in SIZES:
        policy = _policy(layers, experts)
        prefill, step = _decoder_syncs(policy)
        assert step.total == 0, step.report()
        steps[layers, experts] = step.total
        prefills[layers, experts] = prefill.total
        engine_steps[layers, experts] = _engine_step_syncs(policy)
    assert steps == {size: 0 for size in SIZES}
    assert engine_steps == {size: 1 for size in SIZES}
    assert prefills == {size: size[0] if size[1] else 0 for size in SIZES}


# -- the packed forward ----------------------------------------------------------------------
LENS, TOTAL = [5, 11, 3, 8], 32  # then a padding segment of 5


def _packed_model(layers: int):
    from megatron_rl.models.gpt import build_gpt_model

    torch.manual_seed(0)
    return build_gpt_model(_args(layers), use_te=False)


@pytest.mark.parametrize("path", ["loop", "varlen"])
def test_packed_forward_budget_does_not_grow_with_layers(dist_env, monkeypatch, path):
    """One read of cu_seqlens per forward (the trainer's params, cu_seqlens on the device),
    none with host values (make_packed_seq_params), none in the backward."""
    from megatron_rl.models import packed_attention
    from megatron_rl.models.gpt import make_packed_seq_params, thd_params

    if path == "varlen":
        monkeypatch.setattr(packed_attention, "packed_attention_fn",
                            lambda query: packed_attention.reference_varlen_attn)
    dev = _dev()
    cu = torch.tensor([0, 5, 16, 19, 27, 32], dtype=torch.int32, device=dev)
    ids = torch.randint(0, VOCAB, (1, TOTAL), device=dev)
    pos = torch.cat([torch.arange(n) for n in (*LENS, TOTAL - sum(LENS))])[None].to(dev)
    forwards, hosts, backwards = {}, {}, {}
    for layers in (2, 4):
        model = _packed_model(layers)
        out = []
        fwd = _count(lambda: out.append(model(ids, pos, None,
                                              packed_seq_params=thd_params(cu, 11, dev))))
        assert fwd.total <= 1, fwd.report()
        forwards[layers] = fwd.total
        bwd = _count(lambda: out[0].float().square().mean().backward())
        backwards[layers] = bwd.total
        params = make_packed_seq_params(LENS, TOTAL, device=dev)
        host = _count(lambda: model(ids, pos, None, packed_seq_params=params))
        hosts[layers] = host.total
        assert host.total == 0, host.report()
    assert forwards == {2: 1, 4: 1}
    assert hosts == {2: 0, 4: 0} and backwards == {2: 0, 4: 0}


# -- the trainer's packed forwards -------------------------------------------------------------
@pytest.mark.parametrize("path", ["train", "train-with-reference", "score", "expert-peers"])
def test_trainers_packed_forwards_read_no_segment_bounds_back(dist_env, monkeypatch, path):
    """Packed microbatches as the trainer builds them (packing.Layout, bucketed rows, so they
    carry their boundaries on the host) through the runner's schedule (runner.forward_backward:
    its PackedSeqParams per microbatch, the model, the loss or the collected values): 0 host
    synchronisations for the whole call, so none reads cu_seqlens back. train: the RL loss,
    forward and backward; train-with-reference: the exact KL in the loss, the frozen
    reference's forward beside the policy's; score: Policy.token_logprobs (old and reference
    log-probs); expert-peers: the microbatches first made alike as expert-parallel peers make
    them (runner.match_expert_peers: the shorter row grown by padding segments, and a padding
    microbatch more, as if a peer held three)."""
    from megatron_rl import parallel
    from megatron_rl.kl import KLConfig
    from megatron_rl.loss import LossConfig
    from megatron_rl.models import runner
    from megatron_rl.models.policy import Policy
    from megatron_rl.packing import Layout
    from megatron_rl.update import make_rl_loss_fn

    torch.manual_seed(0)
    policy = Policy(_args(2), trainable=path != "score")
    reference = _policy(2) if path == "train-with-reference" else None
    cfg = LossConfig(kl=KLConfig(placement="loss", estimator="exact")
                     if reference is not None else KLConfig())
    micro = _microbatches(policy, packed=True, bucket=True)
    if path == "expert-peers":
        all_reduce = parallel.all_reduce

        def one_more_microbatch(values, group=None, op=None):  # a peer with one more
            return all_reduce(values, group) + torch.tensor([1.0, 0, 0, 0], device=_dev())

        monkeypatch.setattr(parallel, "all_reduce", one_more_microbatch)
        micro = runner.match_expert_peers(micro, None)
        assert len(micro) == 3 and micro[2]["_dummy"]
        assert len({mb["tokens"].shape for mb in micro}) == 1
    if path == "score":
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, VOCAB, (6, 12), generator=g).to(_dev())
        layout = Layout(packed=True, max_tokens=40, bucket=True)
        syncs = _count(lambda: policy.token_logprobs(tokens, layout,
                                                     seq_lengths=[12, 7, 9, 4, 11, 6]))
    else:
        loss_fn = make_rl_loss_fn(policy, cfg, 40.0, 6.0, reference=reference)
        syncs = _count(lambda: policy.forward_backward(micro, loss_fn, reference=reference,
                                                       for_scoring=True))
    assert syncs.total == 0, syncs.report()
    for mb in micro:  # the host boundaries are those of the device tensor
        assert mb["cu_seqlens"].tolist() == list(mb["cu_seqlens_host"])
        assert mb["cu_seqlens_host"][-1] == mb["tokens"].shape[1]


# -- the RL loss -----------------------------------------------------------------------------
def _microbatches(policy, packed: bool, bucket: bool = False):
    """Two microbatches of a batch of 6 sequences in the trainer's layout, as update.py hands
    them to the loss function (without the model outputs); `bucket`: packed rows of bucketed
    lengths (packing.bucketed_length)."""
    from megatron_rl.packing import Layout

    g, dev = torch.Generator().manual_seed(0), _dev()
    B, L = 6, 12
    lengths = [12, 7, 9, 4, 11, 6]
    tokens = torch.randint(0, policy.args.vocab_size, (B, L), generator=g).to(dev)
    loss_mask = torch.zeros(B, L - 1)
    for i, n in enumerate(lengths):
        loss_mask[i, 2:n - 1] = 1.0
    old = torch.randn(B, L - 1, generator=g) - 3
    ref = torch.randn(B, L - 1, generator=g) - 3
    advantages = torch.randn(B, generator=g)
    loss_mask, old, ref, advantages = (t.to(dev) for t in (loss_mask, old, ref, advantages))
    layout = Layout(packed=packed, micro_batch_size=3, max_tokens=40, bucket=bucket)
    out = []
    for m in layout.microbatches(tokens, lengths, pad_multiple=8):
        out.append({**m.inputs, "layout": m, "loss_mask": loss_mask[m.rows],
                    "old_logprobs": old[m.rows], "advantages": advantages[m.rows],
                    "ref_logprobs": ref[m.rows]})
    assert len(out) == 2
    return out


@pytest.mark.parametrize("backend", ["auto", "torch"], ids=["fused", "reference"])
@pytest.mark.parametrize("kl", ["reward-k1", "loss-k3", "loss-exact"])
@pytest.mark.parametrize("head", ["logits", "fused-lm-head"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_rl_loss_of_a_microbatch_has_no_host_sync(dist_env, monkeypatch, backend, kl, head,
                                                   packed):
    """The loss function the pipeline schedule calls on the model's output (the logits, or
    with --fused-lm-head the final hidden states) and its backward."""
    from megatron_rl.kl import KLConfig
    from megatron_rl.loss import LossConfig
    from megatron_rl.models.config import ModelOptions
    from megatron_rl.ops import logprob_kl
    from megatron_rl.update import make_rl_loss_fn

    # auto: the compiled kernel for the device (megatron_rl._C) where built, else torch
    monkeypatch.setenv(logprob_kl.BACKEND_ENV_VAR, backend)
    placement, estimator = kl.split("-")
    cfg = LossConfig(kl=KLConfig(placement=placement, estimator=estimator))
    policy = _policy(2, options=ModelOptions(fused_lm_head=head == "fused-lm-head"))
    loss_fn = make_rl_loss_fn(policy, cfg, 40.0, 6.0,
                              reference=policy if cfg.kl.exact_kl_in_loss else None)
    width = policy.args.hidden_size if policy.fused_lm_head else policy.args.vocab_size
    g = torch.Generator().manual_seed(1)
    for mb in _microbatches(policy, packed):
        shape = (*mb["tokens"].shape, width)
        out = torch.randn(shape, generator=g).to(_dev()).requires_grad_()
        extra = (torch.randn(shape, generator=g).to(_dev()),) if cfg.kl.exact_kl_in_loss else ()
        got = []
        fwd = _count(lambda: got.append(loss_fn(mb, out, *extra)))
        loss, metrics = got[0]
        bwd = _count(lambda: loss.backward())
        assert fwd.total == 0, fwd.report()
        assert bwd.total == 0, bwd.report()
        assert out.grad is not None and float(out.grad.abs().sum()) > 0
        assert torch.isfinite(loss) and "kl_k1" in metrics


@pytest.mark.parametrize("estimator", ["rloo", "grpo", "dr_grpo", "reinforce"])
@pytest.mark.parametrize("kl", ["reward", "reward-to-go"])
def test_advantages_of_a_batch_have_no_host_sync(estimator, kl):
    from megatron_rl.kl import KLConfig
    from megatron_rl.loss import LossConfig, build_advantages

    g = torch.Generator().manual_seed(0)
    B, T = 8, 10
    cfg = LossConfig(advantage_estimator=estimator,
                     kl=KLConfig(placement="reward", reward_to_go=kl == "reward-to-go"))
    rewards, logprobs, ref = (torch.rand(B, generator=g), torch.randn(B, T, generator=g),
                              torch.randn(B, T, generator=g))
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    rewards, logprobs, ref, mask = (t.to(_dev()) for t in (rewards, logprobs, ref, mask))
    syncs = _count(lambda: build_advantages(rewards, logprobs, ref, mask, cfg, 4))
    assert syncs.total == 0, syncs.report()
