"""Operator launches of a packed forward and backward, counted on the CPU against the number of
sequences in the row.

On a GPU every ATen operator the model dispatches is at least one kernel launch (or a view, a
few microseconds of host time either way). A packed row of many short sequences must not cost
launches per sequence: the CUDA path of SDPAttention (models/packed_attention.py) attends the
whole row in one varlen_attn call per layer. Here that path runs on the CPU with
`reference_varlen_attn` in place of varlen_attn (one masked SDPA call, vectorised ops whose
number does not depend on the segments), and a TorchDispatchMode counts the ATen operators of
one forward and backward of a tiny model (2 layers, GQA) over a row of 256 tokens holding 4, 16
or 64 sequences then a padding segment:

- the CUDA path: the same count at every number of sequences;
- the CPU path (one SDPA call per segment) grows by the same number of operators per sequence,
  which shows that the counter sees per-sequence work.
"""
import collections
import inspect

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.launches, pytest.mark.distributed]

TOTAL = 256
SEQUENCES = (4, 16, 64)
TINY = dict(architecture="Qwen2ForCausalLM", vocab_size=96, hidden_size=32,
            intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, qkv_bias=True, max_position_embeddings=TOTAL)


class OpCounter(TorchDispatchMode):
    """Counts the ATen operators dispatched inside it, by name (`counts`), and in all
    (`total`)."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _lengths(n: int) -> list[int]:
    """n unequal sequence lengths (1 to 5 tokens), leaving room for a padding segment."""
    return [1 + (7 * i) % 5 for i in range(n)]


@pytest.fixture
def model(dist_env):
    from megatron_rl.models.config import ModelArgs
    from megatron_rl.models.gpt import build_gpt_model

    torch.manual_seed(0)
    return build_gpt_model(ModelArgs(**TINY), use_te=False)


def _ops_of_a_step(model, n: int) -> OpCounter:
    """The operators of one forward and backward of a row of n sequences (host bounds, as
    make_packed_seq_params gives them), counted on a second step: megatron caches the RoPE
    table per max_seqlen (the padding segment's here, another at each n)."""
    from megatron_rl.models.gpt import make_packed_seq_params

    lens = _lengths(n)
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(0, TINY["vocab_size"], (1, TOTAL), generator=g)
    pos = torch.cat([torch.arange(k) for k in (*lens, TOTAL - sum(lens))])[None]
    params = make_packed_seq_params(lens, TOTAL)

    def step():
        model.zero_grad(set_to_none=True)
        logits = model(ids, pos, None, packed_seq_params=params)
        logits.float().square().mean().backward()

    step()
    with OpCounter() as ops:
        step()
    return ops


def test_cuda_path_launches_do_not_grow_with_the_sequences(model, monkeypatch):
    from megatron_rl.models import packed_attention

    calls = []

    def one_call(*args, **kwargs):
        calls.append(1)
        return packed_attention.reference_varlen_attn(*args, **kwargs)

    one_call.__signature__ = inspect.signature(packed_attention.reference_varlen_attn)
    monkeypatch.setattr(packed_attention, "packed_attention_fn", lambda query: one_call)
    counts = {}
    for n in SEQUENCES:
        calls.clear()
        counts[n] = _ops_of_a_step(model, n).total
        assert len(calls) == 2 * TINY["num_hidden_layers"]  # the CUDA path, once per layer and step
    assert len(set(counts.values())) == 1, f"operators per step by sequences in the row: {counts}"


def test_cpu_path_grows_by_the_same_operators_per_sequence(model):
    """The per-segment loop: what the counter would see of a per-sequence launch."""
    ops = {n: _ops_of_a_step(model, n) for n in SEQUENCES}
    counts = {n: o.total for n, o in ops.items()}
    per_sequence = [(counts[b] - counts[a]) / (b - a) for a, b in zip(SEQUENCES, SEQUENCES[1:])]
    assert per_sequence[0] > 0 and per_sequence[0] == per_sequence[1], counts
    sdpa = {n: sum(c for name, c in o.counts.items() if "attention" in name)
            for n, o in ops.items()}
    assert sdpa[64] > sdpa[16] > sdpa[4], sdpa
