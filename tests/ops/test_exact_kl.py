"""The exact per-position KL op (megatron_rl.ops.exact_kl) and the `--kl-estimator exact` wiring.

KL_t = sum_v p_v (log p_v - log q_v), p = softmax(policy logits), q = softmax(reference logits);
d KL_t / d z_v = p_v (log p_v - log q_v - KL_t); the reference gets no gradient.

Accuracy rule, as in test_logprob_kl.py: against an fp64 oracle (log_softmax in float64 of the
same input values, differentiated by autograd), each backend may have at most 2x the error of
PyTorch's own computation in the input dtype (its fp32 computation where the input dtype
overflows), plus a floor relative to the largest exact value.
"""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from megatron_rl.kl import KLConfig
from megatron_rl.loss import LossConfig, build_advantages, policy_loss_per_token
from megatron_rl.ops import exact_kl, extension_backends, token_logprobs_and_kl
from megatron_rl.ops import logprob_kl
from megatron_rl.ops.reference import naive_exact_kl
from tp2_harness import TP2_SPLITS, run_two_ranks

CPU_BACKENDS = ["torch", pytest.param("cpu", marks=pytest.mark.skipif(
    "cpu" not in extension_backends(), reason="megatron_rl._C built without the CPU kernel"))]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
VALUE_FLOOR = 2e-6
GRAD_FLOOR = {torch.float32: 1e-7, torch.bfloat16: 1e-6, torch.float16: 1e-6}


def _pair(rows, vocab, dtype, scale=3.0, ref_noise=1.0, seed=0):
    """Policy and reference logits: the reference a noisy copy of the policy (KL ~ 0.1 - 1)."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * scale
    noise = torch.randn(rows, vocab, generator=gen, dtype=torch.float64)
    r = z + noise * ref_noise * scale
    return z.to(dtype), r.to(dtype)


def _value_and_grad(fn, z, r, weights):
    x = z.detach().clone().requires_grad_(True)
    kl = fn(x, r)
    (grad,) = torch.autograd.grad((kl.double() * weights).sum(), x)
    return kl.detach().double(), grad.double()


def _err(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,vocab,scale", [
    (1, 1000, 3.0), (37, 1031, 3.0), (5, 17, 2.0), (3, 1, 1.0), (8, 4099, 1e4), (2, 2049, 3.0)])
def test_values_and_grads_vs_fp64(backend, dtype, rows, vocab, scale):
    z, r = _pair(rows, vocab, dtype, scale)
    w = torch.randn(rows, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    exact, exact_grad = _value_and_grad(lambda x, y: naive_exact_kl(x, y, torch.float64), z, r, w)
    ours, ours_grad = _value_and_grad(lambda x, y: exact_kl(x, y, backend=backend), z, r, w)
    pt, pt_grad = _value_and_grad(lambda x, y: naive_exact_kl(x, y, dtype), z, r, w)
    pt32, pt32_grad = _value_and_grad(lambda x, y: naive_exact_kl(x, y, torch.float32), z, r, w)

    def bar(mine, fp32, truth):  # PyTorch's error in the input dtype, its fp32 one on overflow
        e = _err(mine, truth)
        return e if math.isfinite(e) else _err(fp32, truth)

    assert ours.shape == (rows,) and ours.dtype == torch.float64
    floor = VALUE_FLOOR * max(1.0, exact.abs().max().item())
    assert _err(ours, exact) <= 2 * bar(pt, pt32, exact) + floor
    floor = GRAD_FLOOR[dtype] * max(1.0, exact_grad.abs().max().item())
    assert _err(ours_grad, exact_grad) <= 2 * bar(pt_grad, pt32_grad, exact_grad) + floor


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_fp32_accuracy_and_gradient_formula(backend):
    """Statistics accumulate in fp32 whatever the input dtype; the gradient is
    p (log p - log q - KL) (checked in fp64 against the closed form and autograd)."""
    z, r = _pair(64, 4099, torch.bfloat16)
    exact = naive_exact_kl(z, r, torch.float64)
    assert _err(exact_kl(z, r, backend=backend).double(), exact) < 2e-5
    z64, r64 = _pair(9, 301, torch.float64, ref_noise=0.3)
    x = z64.clone().requires_grad_(True)
    w = torch.randn(9, dtype=torch.float64)
    (exact_kl(x, r64, backend=backend) * w).sum().backward()
    p, logp, logq = torch.softmax(z64, -1), torch.log_softmax(z64, -1), torch.log_softmax(r64, -1)
    kl = (p * (logp - logq)).sum(-1, keepdim=True)
    torch.testing.assert_close(x.grad, w[:, None] * p * (logp - logq - kl), rtol=1e-10, atol=1e-14)
    y = z64.clone().requires_grad_(True)
    (naive_exact_kl(y, r64) * w).sum().backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_gradcheck_fp64_and_frozen_reference(backend):
    z, r = _pair(3, 7, torch.float64, scale=1.5)
    assert torch.autograd.gradcheck(lambda x: exact_kl(x, r, backend=backend),
                                    (z.clone().requires_grad_(True),))
    ref = r.clone().requires_grad_(True)
    x = z.clone().requires_grad_(True)
    exact_kl(x, ref, backend=backend).sum().backward()
    assert ref.grad is None and x.grad is not None  # the reference is frozen


def test_zero_when_equal_and_shapes():
    z, _ = _pair(2 * 3 * 5, 64, torch.float32)
    out = exact_kl(z.view(2, 3, 5, 64), (z + 4.0).view(2, 3, 5, 64))  # a shift: same softmax
    assert out.shape == (2, 3, 5) and out.abs().max() < 1e-5
    with pytest.raises(ValueError, match="ref_logits shape"):
        exact_kl(z, z[:, :10])
    # a reference in another dtype is cast to the policy's
    bf = exact_kl(z.bfloat16(), z.float() * 0.5)
    torch.testing.assert_close(bf, exact_kl(z.bfloat16(), (z * 0.5).bfloat16()))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_fused_with_the_logprob_op_shares_one_gradient(backend, dtype):
    """token_logprobs_and_kl(..., ref_logits=...) returns the same KL and, through the in-place
    accumulation into the log-prob gradient's buffer, the gradient of the two ops used apart
    (and of the fp64 oracle); with only the KL used, the KL's gradient alone."""
    z, r = _pair(29, 1031, dtype, seed=5)
    targets = torch.randint(0, 1031, (29,), generator=torch.Generator().manual_seed(6))
    w = [torch.randn(29, dtype=torch.float64, generator=torch.Generator().manual_seed(k))
         for k in range(3)]

    def run(fused, use_logprobs=True):
        x = z.detach().clone().requires_grad_(True)
        if fused:
            out = token_logprobs_and_kl(x, targets, return_entropy=True, backend=backend,
                                        ref_logits=r)
            kl = out.exact_kl
        else:
            out = token_logprobs_and_kl(x, targets, return_entropy=True, backend=backend)
            kl = exact_kl(x, r, backend=backend)
        loss = (kl.double() * w[0]).sum()
        if use_logprobs:
            loss = loss + (out.logprobs.double() * w[1] + out.entropy.double() * w[2]).sum()
        loss.backward()
        return kl.detach().double(), x.grad.double()

    kl_f, g_f = run(True)
    kl_s, g_s = run(False)
    torch.testing.assert_close(kl_f, kl_s, rtol=0, atol=0)
    zd = z.detach().double().clone().requires_grad_(True)
    lp = torch.log_softmax(zd, -1)
    oracle = ((naive_exact_kl(zd, r.double()) * w[0]).sum()
              + (lp.gather(1, targets[:, None])[:, 0] * w[1]).sum()
              + (-(lp.exp() * lp).sum(-1) * w[2]).sum())
    oracle.backward()
    tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(g_f, zd.grad, rtol=tol, atol=tol * float(zd.grad.abs().max()))
    # fused: one rounding of the sum; apart: two roundings and autograd's sum
    torch.testing.assert_close(g_f, g_s, rtol=tol, atol=tol * float(g_s.abs().max()))
    kl_only, g_only = run(True, use_logprobs=False)
    _, g_ref = _value_and_grad(lambda x, y: exact_kl(x, y, backend=backend), z, r, w[0])
    torch.testing.assert_close(g_only, g_ref, rtol=0, atol=0)
    with pytest.raises(ValueError, match="temperature 1"):
        token_logprobs_and_kl(z, targets, temperature=0.5, ref_logits=r)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_chunks_and_threads_do_not_change_results(backend, monkeypatch):
    z, r = _pair(33, 1031, torch.float32)
    full = exact_kl(z, r, backend=backend)
    monkeypatch.setattr("megatron_rl.ops.reference.CHUNK_ELEMENTS", 1031 * 4 + 5)
    torch.testing.assert_close(exact_kl(z, r, backend=backend), full, rtol=0, atol=0)


@pytest.mark.skipif("cpu" not in extension_backends(), reason="no CPU kernel in megatron_rl._C")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_isa_variants_agree(dtype):
    from megatron_rl import _C
    z, r = _pair(19, 1031, dtype)
    w = torch.randn(19, dtype=torch.float64)
    previous, results = _C.cpu_isa(), {}
    try:
        for isa in ("default", "avx2"):
            try:
                _C.set_cpu_isa(isa)
            except RuntimeError:
                continue
            results[isa] = _value_and_grad(lambda x, y: exact_kl(x, y, backend="cpu"), z, r, w)
    finally:
        _C.set_cpu_isa(previous)
    if len(results) < 2:
        pytest.skip("only one CPU kernel variant runs on this machine")
    (va, ga), (vb, gb) = results["default"], results["avx2"]
    torch.testing.assert_close(va, vb, rtol=1e-5, atol=1e-6)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ga, gb, rtol=tol, atol=tol * 1e-2)


def test_stale_extension_falls_back_to_torch(monkeypatch):
    class _Old:  # an extension built before the exact-KL kernels
        pass
    monkeypatch.setattr(logprob_kl, "_ext", _Old())
    monkeypatch.setattr(logprob_kl, "_warned_fallback", set())
    with pytest.warns(UserWarning, match="exact-KL kernel"):
        assert logprob_kl._exact_backend("cpu") == "torch"


def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        z = torch.empty(6, 50, dtype=torch.bfloat16)
        parts = torch.ops.megatron_rl.exact_kl_partials(z, z, "cpu")
        assert [tuple(p.shape) for p in parts] == [(6,)] * 5 and parts[0].dtype == torch.float32
        v = torch.empty(6)
        g = torch.ops.megatron_rl.exact_kl_grad(z, z, v, v, v, v, v, v, "cpu")
        assert g.shape == z.shape and g.dtype == torch.bfloat16
        torch.ops.megatron_rl.exact_kl_grad_accumulate_(g, z, z, v, v, v, v, v, v, "cpu")


# ---------------------------------------------------------------------------------------------
# Tensor parallel over gloo: vocab shards on two ranks reproduce the full-vocab values and grads.
# ---------------------------------------------------------------------------------------------


def _tp2_case(split):
    z, r = _pair(23, sum(split), torch.float32, seed=3)
    targets = torch.randint(0, sum(split), (23,), generator=torch.Generator().manual_seed(8))
    # one shard far below the other in some rows, for both models: the cross-rank rescaling of
    # the sums (and of the KL partial) is exercised, not only equal maxima
    z[:5, split[0]:] -= 30.0
    r[3:9, :split[0]] -= 25.0
    w = torch.randn(23, generator=torch.Generator().manual_seed(4))
    return z, r, w, targets


def _tp2_case_on_rank(rank, split, backend, dtype, group):
    """tp2_harness case: this rank's shard of the exact KL and of the fused path (log-probs of
    the targets, KL, one gradient buffer); both must give the same KL bit for bit."""
    z, r, w, targets = _tp2_case(split)
    start = sum(split[:rank])
    x = z[:, start:start + split[rank]].to(dtype).requires_grad_(True)
    y = r[:, start:start + split[rank]].to(dtype)
    kl = exact_kl(x, y, tp_group=group, backend=backend)
    fused = token_logprobs_and_kl(x, targets, tp_group=group, vocab_start=start,
                                  backend=backend, ref_logits=y)
    torch.testing.assert_close(fused.exact_kl, kl, rtol=0, atol=0)
    (kl * w + fused.exact_kl * w + fused.logprobs).sum().backward()
    return kl.detach(), x.grad


@pytest.mark.distributed
def test_tp2_matches_tp1():
    backends = ["torch"] + (["cpu"] if "cpu" in extension_backends() else [])
    results = run_two_ranks(_tp2_case_on_rank, backends)
    assert len(results) == len(TP2_SPLITS) * len(backends) * 2
    for (split, backend, dtype), (kl, grad) in results.items():
        z, r, w, targets = _tp2_case(split)
        assert (targets < split[0]).any() and (targets >= split[0]).any()
        x = z.to(dtype).requires_grad_(True)
        tp1 = exact_kl(x, r.to(dtype), backend=backend)
        fused = token_logprobs_and_kl(x, targets, backend=backend, ref_logits=r.to(dtype))
        (tp1 * w + fused.exact_kl * w + fused.logprobs).sum().backward()
        torch.testing.assert_close(kl, tp1.detach(), rtol=1e-5, atol=1e-5)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(grad.float(), x.grad.float(), rtol=tol, atol=tol * 1e-1)


# ---------------------------------------------------------------------------------------------
# The trainer's loss with --kl-estimator exact is the toy's proven `exact` estimator.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("placement", ["reward", "loss", "reward+loss"])
@pytest.mark.parametrize("correction", ["none", "token-is", "seq-is"])
def test_trainer_loss_equals_the_toys_exact_estimator(placement, correction):
    """build_advantages + policy_loss_per_token with KLConfig("exact") give the gradient (in the
    log-probs and in KL_t) of megatron_rl.experiments.toy's exact estimator with the later-positions return,
    the one whose reward+loss placement the toy proves unbiased by enumeration."""
    from megatron_rl.experiments.toy import ExactKL, exact_kl_loss_per_token

    g = torch.Generator().manual_seed(0)
    B, T = 6, 7
    logprobs = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    old = (logprobs.detach() - 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
           if correction != "none" else logprobs.detach())
    kl = torch.rand(B, T, generator=g, dtype=torch.float64).requires_grad_(True)
    mask = (torch.rand(B, T, generator=g) < 0.8).double()
    mask[:, 0] = 1.0

    def grads(loss):
        return torch.autograd.grad(loss, (logprobs, kl), allow_unused=True)

    toy_cfg = ExactKL(placement, "later", correction)
    toy = grads((exact_kl_loss_per_token(logprobs, old, kl, mask, toy_cfg) * mask).sum())
    cfg = LossConfig(clip_low=1.0, clip_high=math.inf, aggregation="seq-mean-token-sum",
                     kl=KLConfig("exact", placement, coef=1.0, off_policy_correction=correction),
                     advantage_estimator="reinforce")
    adv = build_advantages(torch.zeros(B, dtype=torch.float64), old, None, mask, cfg, 1,
                           token_kl=kl.detach())
    per_token, metrics = policy_loss_per_token(logprobs, old, adv, mask, cfg, token_kl=kl)
    ours = grads((per_token * mask).sum())
    for a, b in zip(toy, ours):
        if a is None or b is None:
            assert a is None or float(a.abs().max()) == 0.0
            assert b is None or float(b.abs().max()) == 0.0
        else:
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-14)
    assert "kl_exact" in metrics


def test_exact_configuration_and_errors():
    from megatron_rl.config import parse_config
    from megatron_rl.kl import get_estimator
    from megatron_rl.loss import compute_rewards_with_kl

    for placement in ("reward", "loss", "reward+loss", "none"):
        KLConfig("exact", placement)
    assert KLConfig("exact", "reward+loss").exact_kl_in_loss
    assert not KLConfig("exact", "reward").exact_kl_in_loss
    assert KLConfig("exact", "reward", off_policy_correction="seq-is").exact_kl_in_loss
    cfg = parse_config(["--hf-checkpoint", "x", "--train-data", "y", "--kl-estimator", "exact",
                        "--kl-placement", "reward+loss"])
    assert cfg.loss.kl.estimator == "exact"
    with pytest.raises(ValueError, match="computed from logits"):
        get_estimator("exact")
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match="needs token_kl"):
        compute_rewards_with_kl(torch.zeros(2), mask, mask, mask, KLConfig("exact", "reward"))
    with pytest.raises(ValueError, match="token_kl"):
        policy_loss_per_token(mask, mask, torch.zeros(2), mask,
                              LossConfig(kl=KLConfig("exact", "loss")), ref_logprobs=mask)
    # the reward side charges token t with the later positions only: sum_{s>t} KL_s
    kl = torch.tensor([[1.0, 2.0, 4.0], [8.0, 16.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    out = compute_rewards_with_kl(torch.tensor([1.0, 0.0]), m, m, m,
                                  KLConfig("exact", "reward", coef=0.5), token_kl=kl)
    torch.testing.assert_close(out, torch.tensor([[1 - 3.0, 1 - 2.0, 1.0], [-8.0, 0.0, 0.0]]))


# ---------------------------------------------------------------------------------------------
# A short train() run with --kl-estimator exact --kl-placement reward+loss.
# ---------------------------------------------------------------------------------------------
@pytest.mark.distributed  # torch.distributed (world size 1) in a subprocess
def test_train_runs_with_exact_kl_in_reward_and_loss(tmp_path):
    from megatron_rl.data.records import TaskExample, write_jsonl

    from megatron_rl.experiments.tiny_model import make_char_model

    model, ref = make_char_model(str(tmp_path / "m"), 0), make_char_model(str(tmp_path / "r"), 1)
    data = tmp_path / "train.jsonl"
    write_jsonl(data, [TaskExample(f"Calculate {a}+{b}.", str(a + b), "arithmetic")
                       for a in range(4) for b in range(4)])
    save = str(tmp_path / "run")
    args = ["--hf-checkpoint", model, "--ref-checkpoint", ref, "--train-data", str(data),
            "--save", save, "--train-iters", "2", "--num-prompts-per-step", "4",
            "--group-size", "2", "--max-new-tokens", "3", "--lr", "1e-2",
            "--micro-batch-size", "4", "--prompt-template", "{prompt}=",
            "--no-task-instruction", "--seed", "3", "--kl-estimator", "exact",
            "--kl-placement", "reward+loss", "--kl-coef", "1.0"]
    subprocess.run([sys.executable, "-m", "megatron_rl.train", *args], check=True,
                   env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, timeout=300)
    with open(os.path.join(save, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        # a different reference: a clearly positive exact KL, a real update, finite numbers
        assert r["kl_exact"] > 1e-3 and math.isfinite(r["kl_k1"])
        assert r["grad_norm"] > 1e-4 and r["skipped_update"] == 0.0
    assert rows[1]["kl_exact"] != rows[0]["kl_exact"]
