"""Non-finite logits, in every backend: -inf masks an entry, NaN poisons its row.

What a user relies on:
- a logit mask (-inf where a token is not allowed: a constrained vocabulary, padded vocab
  entries) gives the log-probs, entropy, exact KL and gradients of the masked softmax, as if the
  masked entries were not there, and exactly zero gradient at them. Masks that cover a whole
  kernel block (the CPU kernel's first 2048 entries, the CUDA threads' first vectors) or a whole
  tensor-parallel shard included;
- a NaN logit (a diverging run) makes its row's outputs and gradient NaN, never a finite number
  computed without it, so the trainer's non-finite check sees it; other rows are untouched.
The oracle is fp64 on the unmasked entries only.
"""
import pytest
import torch

from megatron_rl.ops import exact_kl, extension_backends, token_logprobs_and_kl
from tp2_harness import run_two_ranks

NEG_INF, NAN = float("-inf"), float("nan")
BACKENDS = [
    "torch",
    pytest.param("cpu", marks=pytest.mark.skipif(
        "cpu" not in extension_backends(), reason="megatron_rl._C built without the CPU kernel")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
GRAD_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}


def masked_case(vocab: int = 3000, seed: int = 0):
    """(z, r, targets) in fp64: policy and reference logits sharing a mask, one row per shape of
    mask, and a target that is never masked."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(6, vocab, generator=g, dtype=torch.float64) * 3
    r = z + torch.randn(6, vocab, generator=g, dtype=torch.float64)
    mask = torch.zeros(6, vocab, dtype=torch.bool)
    mask[0, :min(2100, vocab - 100)] = True                   # the CPU kernel's first block
    mask[1] = torch.rand(vocab, generator=g) < 0.3            # scattered
    mask[2, -1] = True                                        # the last entry
    mask[3, 1:] = True                                        # one entry left: p = 1
    mask[4, ::2] = True                                       # every other entry (each vector)
    # row 5: no mask
    z, r = z.masked_fill(mask, NEG_INF), r.masked_fill(mask, NEG_INF)
    targets = torch.stack([torch.nonzero(~m)[-1, 0] for m in mask])
    return z, r, targets


def oracle(z, r, targets, weights):
    """fp64 per-row (logprob, entropy, KL) on the unmasked entries, and the gradient of
    sum(weights * [logprob, entropy, KL]) w.r.t. z (zero at masked entries)."""
    values, grad = [], torch.zeros_like(z)
    for i in range(z.shape[0]):
        keep = torch.isfinite(z[i])
        zi = z[i, keep].clone().requires_grad_(True)
        logp = torch.log_softmax(zi, 0)
        logq = torch.log_softmax(r[i, keep], 0)
        lp = logp[torch.nonzero(keep)[:, 0].tolist().index(int(targets[i]))]
        ent = -(logp.exp() * logp).sum()
        kl = (logp.exp() * (logp - logq)).sum()
        out = torch.stack([lp, ent, kl])
        (g,) = torch.autograd.grad((out * weights[i]).sum(), zi)
        grad[i, keep] = g
        values.append(out.detach())
    return torch.stack(values), grad


def run_op(z, r, targets, weights, backend, dtype):
    """The fused op (log-prob + entropy + exact KL, one gradient buffer) and the standalone
    exact_kl: per-row [logprob, entropy, KL] and the gradients of both."""
    device = "cuda" if backend == "cuda" else "cpu"
    if backend == "cuda":  # a build without the kernel would fall back to torch and pass
        assert "cuda" in extension_backends(), "megatron_rl._C was built without CUDA kernels"
    x = z.to(dtype).to(device).requires_grad_(True)
    ref = r.to(dtype).to(device)
    w = weights.to(device)
    out = token_logprobs_and_kl(x, targets.to(device), return_entropy=True, ref_logits=ref,
                                backend=backend)
    values = torch.stack([out.logprobs, out.entropy, out.exact_kl], dim=1)
    (grad,) = torch.autograd.grad((values * w).sum(), x)
    x2 = z.to(dtype).to(device).requires_grad_(True)
    kl = exact_kl(x2, ref, backend=backend)
    (kl_grad,) = torch.autograd.grad((kl * w[:, 2]).sum(), x2)
    return values.double().cpu(), grad.double().cpu(), kl.double().cpu(), kl_grad.double().cpu()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_entries_give_the_masked_softmax(backend, dtype):
    z, r, targets = masked_case()
    z, r = z.to(dtype).double(), r.to(dtype).double()  # the oracle sees the rounded inputs
    weights = torch.randn(z.shape[0], 3, generator=torch.Generator().manual_seed(1),
                          dtype=torch.float64)
    want, want_grad = oracle(z, r, targets, weights)
    values, grad, kl, kl_grad = run_op(z, r, targets, weights, backend, dtype)
    torch.testing.assert_close(values, want, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(kl, want[:, 2], rtol=1e-5, atol=2e-5)
    masked = ~torch.isfinite(z)
    assert (grad[masked] == 0).all() and (kl_grad[masked] == 0).all()
    rtol = GRAD_RTOL[dtype]  # rounding to the dtype, and fp32 cancellation between terms
    torch.testing.assert_close(grad, want_grad, rtol=rtol, atol=rtol * want_grad.abs().max())
    kl_only = torch.zeros_like(weights)
    kl_only[:, 2] = weights[:, 2]
    _, want_kl_grad = oracle(z, r, targets, kl_only)
    torch.testing.assert_close(kl_grad, want_kl_grad, rtol=rtol,
                               atol=rtol * want_kl_grad.abs().max())


@pytest.mark.parametrize("backend", BACKENDS)
def test_policy_mass_where_the_reference_is_masked_makes_the_kl_infinite(backend):
    z, r, targets = masked_case()
    r[5, 7] = NEG_INF  # the policy's entry 7 of row 5 is finite: KL(p || q) = +inf
    z[4, 1] = NEG_INF  # policy masked, reference not: adds 0 (row 4 already masks entry 0)
    _, _, kl, _ = run_op(z, r, targets, torch.ones(6, 3, dtype=torch.float64), backend,
                         torch.float32)
    assert kl[5] == float("inf")
    keep = torch.isfinite(z[4])
    logp, logq = torch.log_softmax(z[4, keep], 0), torch.log_softmax(r[4], 0)[keep]
    torch.testing.assert_close(kl[4], (logp.exp() * (logp - logq)).sum(), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("below", [95, 200])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_improbable_policy_entries_where_the_reference_is_masked_make_the_kl_infinite(
        backend, dtype, below):
    """KL(p || q) is +inf wherever p > 0 = q, however small p: a policy entry 95 or 200 below
    the row's max (e^(z - max) is 0 in fp32) where the reference is -inf still makes the KL
    +inf, in every backend and whatever the order (here the low entries fill the CPU kernel's
    whole first block, where one of them is the block's own max at first). Other rows keep
    finite values and gradients."""
    z, r, targets = masked_case()
    z[5, 2500] = z[5].max() + 5
    low = torch.zeros(z.shape[1], dtype=torch.bool)
    low[:2048] = low[2990:] = True
    z[5, low] = z[5, 2500] - below
    clean = run_op(z, r, targets, torch.ones(6, 3, dtype=torch.float64), backend, dtype)
    r[5, 100:110] = r[5, 2995:] = NEG_INF
    values, grad, kl, kl_grad = run_op(z, r, targets, torch.ones(6, 3, dtype=torch.float64),
                                       backend, dtype)
    assert kl[5] == float("inf") and values[5, 2] == float("inf")
    assert torch.isfinite(clean[2][5])  # the same row with the reference finite there
    assert torch.isfinite(kl[:5]).all() and torch.isfinite(kl_grad[:5]).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_nan_logit_makes_its_row_nan(backend, dtype):
    z, r, targets = masked_case()
    clean = run_op(z, r, targets, torch.ones(6, 3, dtype=torch.float64), backend, dtype)
    z_bad, r_bad = z.clone(), r.clone()
    z_bad[0, 2500] = NAN  # after the masked block
    z_bad[1, 0] = NAN     # the first entry (the CUDA kernels' prefix / first thread)
    z_bad[2, -2] = NAN    # the row tail
    r_bad[4, 1] = NAN     # the reference's
    bad = run_op(z_bad, r_bad, targets, torch.ones(6, 3, dtype=torch.float64), backend, dtype)
    values, grad, kl, kl_grad = bad
    for row in (0, 1, 2):
        assert values[row].isnan().all(), (row, values[row])
        assert grad[row].isnan().all() and kl[row].isnan() and kl_grad[row].isnan().all()
    unmasked = torch.isfinite(z[4])  # masked policy entries keep p = 0 and a zero gradient
    assert values[4, 2].isnan() and kl[4].isnan() and kl_grad[4, unmasked].isnan().all()
    assert torch.isfinite(values[4, :2]).all()  # the reference only enters the KL
    for a, b in zip(bad, clean):                # rows 3 and 5: untouched, bitwise
        assert torch.equal(a[[3, 5]], b[[3, 5]])


# ---- two tensor-parallel ranks: a shard with nothing but masked entries, a NaN in one shard --
def _tp2_inputs(split):
    vocab = sum(split)
    z, r, _ = masked_case(vocab, seed=3)
    z, r = z[5:].repeat(5, 1), r[5:].repeat(5, 1)  # five unmasked rows to start from
    z[0, :split[0] + 7] = NEG_INF                   # rank 0's shard all masked
    r[0, :split[0] + 7] = NEG_INF
    z[1, split[0] + 3] = NAN                        # a NaN on rank 1 only
    z[3], r[3] = z[0] - 100, r[0] - 100             # the same, every logit below -88:
                                                    # e^(0 - max) overflows if not guarded
    z[4, :split[0]] = z[4].max() - 200              # rank 0: improbable policy entries where
    r[4, :10] = NEG_INF                             # the reference is masked: KL +inf
    targets = torch.tensor([vocab - 1, 0, split[0] + 1, vocab - 1, vocab - 1])
    weights = torch.tensor([[1.0, 0.5, 2.0]], dtype=torch.float64).repeat(5, 1)
    return z, r, targets, weights


def _tp2_case_on_rank(rank, split, backend, dtype, group):
    z, r, targets, weights = _tp2_inputs(split)
    lo = 0 if rank == 0 else split[0]
    x = z[:, lo:lo + split[rank]].to(dtype).contiguous().requires_grad_(True)
    ref = r[:, lo:lo + split[rank]].to(dtype).contiguous()
    out = token_logprobs_and_kl(x, targets, return_entropy=True, ref_logits=ref, backend=backend,
                                vocab_start=lo, tp_group=group)
    values = torch.stack([out.logprobs, out.entropy, out.exact_kl], dim=1)
    (grad,) = torch.autograd.grad((values * weights.to(values.dtype)).sum(), x)
    return values.detach(), grad


@pytest.mark.distributed
def test_tp2_masked_shard_and_nan_equal_tp1():
    backends = ["torch"] + (["cpu"] if "cpu" in extension_backends() else [])
    results = run_two_ranks(_tp2_case_on_rank, backends)
    for (split, backend, dtype), (values, grad) in results.items():
        z, r, targets, weights = _tp2_inputs(split)
        tp1_values, tp1_grad, _, _ = run_op(z, r, targets, weights, backend, dtype)
        torch.testing.assert_close(values.double(), tp1_values, rtol=1e-5, atol=2e-5,
                                   equal_nan=True)
        assert values[1].isnan().all() and torch.isfinite(values[[0, 2, 3]]).all()
        assert values[4, 2] == float("inf") and torch.isfinite(values[4, :2]).all()
        assert (grad[0, :split[0]] == 0).all()
        rtol = GRAD_RTOL[dtype]  # (row 4's gradient is not finite: its KL is +inf)
        torch.testing.assert_close(grad[:4].double(), tp1_grad[:4], rtol=rtol, equal_nan=True,
                                   atol=rtol * tp1_grad[:4].nan_to_num().abs().max())
