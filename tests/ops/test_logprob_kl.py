"""Tests of the fused token log-prob / log-ratio / K3 / entropy op (megatron_rl.ops).

Accuracy rule (as in flash-attention / Liger-Kernel): against an fp64 oracle (log_softmax in
float64 of the same input values), each backend may have at most ~2x the error of PyTorch's own
computation in the input dtype, plus a few-ulp floor so exact ties do not make the test flaky.
"""
import os
import tempfile

import pytest
import torch

from megatron_rl.ops import (BACKEND_ENV_VAR, extension_backends, resolve_backend,
                             token_logprobs_and_kl, vocab_parallel_logprobs)
from megatron_rl.ops import logprob_kl
from megatron_rl.ops.reference import naive_token_logprobs_and_kl
from tp2_harness import TP2_SPLITS, run_two_ranks

CPU_BACKENDS = ["torch", pytest.param("cpu", marks=pytest.mark.skipif(
    "cpu" not in extension_backends(), reason="megatron_rl._C built without the CPU kernel"))]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Floors on the absolute error (added to 2x PyTorch's error), per dtype of the logits.
VALUE_FLOOR = {torch.float32: 2e-6, torch.bfloat16: 2e-6, torch.float16: 2e-6}
GRAD_FLOOR = {torch.float32: 1e-7, torch.bfloat16: 1e-6, torch.float16: 1e-6}


def _inputs(num_rows, vocab, dtype, scale=3.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(num_rows, vocab, generator=gen) * scale).to(dtype)
    targets = torch.randint(0, vocab, (num_rows,), generator=gen)
    return logits, targets


def _outputs_and_grad(fn, logits, targets, ref, weights):
    """Run fn -> (logprobs, log_ratio, k3, entropy); grad of sum_k w_k * out_k w.r.t. logits."""
    x = logits.detach().clone().requires_grad_(True)
    outs = fn(x, targets, ref)
    loss = sum((w * o.double()).sum() for w, o in zip(weights, outs))
    (grad,) = torch.autograd.grad(loss, x)
    return [o.detach().double() for o in outs], grad.double()


def _ours(backend, temperature):
    def fn(x, t, ref):
        o = token_logprobs_and_kl(x, t, ref_logprobs=ref, temperature=temperature,
                                  return_entropy=True, backend=backend)
        return o.logprobs, o.log_ratio, o.k3, o.entropy
    return fn


def _naive(dtype, temperature):
    def fn(x, t, ref):
        return naive_token_logprobs_and_kl(x, t, ref, temperature=temperature, dtype=dtype)
    return fn


def _max_err(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_rows,vocab,scale,temperature", [
    (1, 1000, 3.0, 1.0),
    (37, 1031, 3.0, 1.0),
    (16, 1031, 3.0, 0.7),
    (8, 4099, 1e4, 1.0),     # logits of +-1e4
    (5, 17, 2.0, 1.3),
])
def test_values_and_grads_vs_fp64(backend, dtype, num_rows, vocab, scale, temperature):
    logits, targets = _inputs(num_rows, vocab, dtype, scale)
    oracle_lp = naive_token_logprobs_and_kl(logits, targets, temperature=temperature,
                                            dtype=torch.float64)[0]
    # A reference policy close to the current one, as in RL (log-ratio of order 0.1 - 1).
    ref = (oracle_lp + 0.3 * torch.randn(num_rows, generator=torch.Generator().manual_seed(1))
           ).float()
    weights = [torch.randn(num_rows, dtype=torch.float64,
                           generator=torch.Generator().manual_seed(2 + k)) for k in range(4)]

    exact, exact_grad = _outputs_and_grad(_naive(torch.float64, temperature), logits, targets,
                                          ref, weights)
    torch_dt, torch_grad = _outputs_and_grad(_naive(dtype, temperature), logits, targets, ref,
                                             weights)
    torch_fp32, torch_fp32_grad = _outputs_and_grad(_naive(torch.float32, temperature), logits,
                                                    targets, ref, weights)
    ours, ours_grad = _outputs_and_grad(_ours(backend, temperature), logits, targets, ref, weights)

    def baseline(in_dtype, in_fp32, exact_value):
        # PyTorch in bf16/fp16 overflows to NaN on +-1e4 logits; then its fp32 path is the bar.
        err = _max_err(in_dtype, exact_value)
        return err if err == err and err != float("inf") else _max_err(in_fp32, exact_value)

    names = ("logprobs", "log_ratio", "k3", "entropy")
    for name, o, t, t32, e in zip(names, ours, torch_dt, torch_fp32, exact):
        assert o.shape == e.shape
        scale_floor = VALUE_FLOOR[dtype] * max(1.0, e.abs().max().item())
        assert _max_err(o, e) <= 2 * baseline(t, t32, e) + scale_floor, name
    grad_floor = GRAD_FLOOR[dtype] * max(1.0, exact_grad.abs().max().item())
    assert (_max_err(ours_grad, exact_grad)
            <= 2 * baseline(torch_grad, torch_fp32_grad, exact_grad) + grad_floor)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_fp32_absolute_accuracy(backend):
    """Whatever the input dtype, statistics accumulate in fp32: fp32-level errors on values."""
    logits, targets = _inputs(64, 4099, torch.bfloat16)
    exact = naive_token_logprobs_and_kl(logits, targets, dtype=torch.float64)
    out = token_logprobs_and_kl(logits, targets, return_entropy=True, backend=backend)
    assert _max_err(out.logprobs.double(), exact[0]) < 2e-5
    assert _max_err(out.entropy.double(), exact[3]) < 2e-5


@pytest.mark.skipif("cpu" not in extension_backends(), reason="no CPU kernel in megatron_rl._C")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_isa_variants_agree(dtype):
    """The baseline-x86 and AVX2 builds of the CPU kernel give the same numbers (to ~ulps)."""
    from megatron_rl import _C
    logits, targets = _inputs(19, 1031, dtype)
    ref = torch.randn(19) - 7.0
    weights = [torch.randn(19, dtype=torch.float64) for _ in range(4)]
    previous = _C.cpu_isa()
    results = {}
    try:
        for isa in ("default", "avx2"):
            try:
                _C.set_cpu_isa(isa)
            except RuntimeError:
                continue  # this CPU has no AVX2 variant
            results[isa] = _outputs_and_grad(_ours("cpu", 0.9), logits, targets, ref, weights)
    finally:
        _C.set_cpu_isa(previous)
    if len(results) < 2:
        pytest.skip("only one CPU kernel variant runs on this machine")
    (outs_a, grad_a), (outs_b, grad_b) = results["default"], results["avx2"]
    for a, b in zip(outs_a, outs_b):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(grad_a, grad_b, rtol=tol, atol=tol * 1e-2)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_gradcheck_fp64(backend):
    logits, targets = _inputs(3, 7, torch.float64, scale=1.5)
    ref = torch.randn(3, dtype=torch.float64) - 2.0

    def fn(x):
        o = token_logprobs_and_kl(x, targets, ref_logprobs=ref, temperature=0.8,
                                  return_entropy=True, backend=backend)
        return o.logprobs, o.log_ratio, o.k3, o.entropy

    assert torch.autograd.gradcheck(fn, (logits.requires_grad_(True),))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_leading_dims_and_optional_outputs(backend):
    logits, targets = _inputs(2 * 3 * 5, 64, torch.float32)
    logits, targets = logits.view(2, 3, 5, 64), targets.view(2, 3, 5)
    out = token_logprobs_and_kl(logits, targets, backend=backend)
    assert out.logprobs.shape == (2, 3, 5) and out.logprobs.dtype == torch.float32
    assert out.log_ratio is None and out.k3 is None and out.entropy is None
    flat = vocab_parallel_logprobs(logits.view(-1, 64), targets.view(-1))
    torch.testing.assert_close(out.logprobs.view(-1), flat)
    # Only logprobs used: K3 / entropy branches are not needed for the gradient.
    x = logits.clone().requires_grad_(True)
    vocab_parallel_logprobs(x, targets).sum().backward()
    assert x.grad.shape == x.shape and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_chunking_matches_unchunked(backend, monkeypatch):
    """Chunk boundaries (torch backend) and row partitions (threads) do not change results."""
    logits, targets = _inputs(33, 1031, torch.float32)
    full = token_logprobs_and_kl(logits, targets, return_entropy=True, backend=backend)
    monkeypatch.setattr("megatron_rl.ops.reference.CHUNK_ELEMENTS", 1031 * 4 + 5)
    chunked = token_logprobs_and_kl(logits, targets, return_entropy=True, backend=backend)
    torch.testing.assert_close(full.logprobs, chunked.logprobs, rtol=0, atol=0)
    torch.testing.assert_close(full.entropy, chunked.entropy, rtol=0, atol=0)


def test_vocab_shard_without_group_matches_full():
    """A shard that holds every target (vocab_start > 0) behaves like a full vocab."""
    logits, targets = _inputs(9, 100, torch.float32)
    out = token_logprobs_and_kl(logits, targets + 500, vocab_start=500)
    torch.testing.assert_close(out.logprobs, token_logprobs_and_kl(logits, targets).logprobs)


def test_user_errors():
    logits, targets = _inputs(4, 10, torch.float32)
    with pytest.raises(ValueError, match="valid: auto, torch, cpu, cuda"):
        token_logprobs_and_kl(logits, targets, backend="triton")
    with pytest.raises(ValueError, match="targets shape"):
        token_logprobs_and_kl(logits, targets[:3])
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs_and_kl(logits, targets, temperature=0.0)
    with pytest.raises(ValueError, match="must lie in"):
        token_logprobs_and_kl(logits, targets + 10)
    with pytest.raises(ValueError, match="integer"):
        token_logprobs_and_kl(logits, targets.float())
    with pytest.raises(ValueError, match="cannot run on cpu"):
        token_logprobs_and_kl(logits, targets, backend="cuda")


def test_env_var_backend(monkeypatch):
    dev = torch.device("cpu")
    monkeypatch.setenv(BACKEND_ENV_VAR, "torch")
    assert resolve_backend("auto", dev) == "torch"
    monkeypatch.setenv(BACKEND_ENV_VAR, "bogus")
    with pytest.raises(ValueError, match="valid"):
        resolve_backend("auto", dev)
    monkeypatch.delenv(BACKEND_ENV_VAR)
    expected = "cpu" if "cpu" in extension_backends() else "torch"
    assert resolve_backend("auto", dev) == expected
    # the CUDA kernels take no float64 (gradcheck on a GPU): "auto" gives it to "torch"
    assert resolve_backend("auto", torch.device("cuda"), torch.float64) == "torch"


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_no_rows_with_entropy(backend):
    out = token_logprobs_and_kl(torch.zeros(0, 11), torch.zeros(0, dtype=torch.long),
                                return_entropy=True, backend=backend)
    assert out.logprobs.shape == (0,) and out.entropy is not None and out.entropy.shape == (0,)


def test_forced_cpu_without_extension_warns_once(monkeypatch):
    monkeypatch.setattr(logprob_kl, "_ext", None)
    monkeypatch.setattr(logprob_kl, "_warned_fallback", set())
    logits, targets = _inputs(4, 10, torch.float32)
    with pytest.warns(UserWarning, match="using the 'torch' backend"):
        out = token_logprobs_and_kl(logits, targets, backend="cpu")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        token_logprobs_and_kl(logits, targets, backend="cpu")
        token_logprobs_and_kl(logits, targets)  # "auto" never warns
    torch.testing.assert_close(out.logprobs, token_logprobs_and_kl(logits, targets).logprobs)


def test_fake_tensor_shapes():
    """register_fake: the custom ops trace under FakeTensorMode (what torch.compile uses)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        logits = torch.empty(6, 50, dtype=torch.bfloat16)
        targets = torch.zeros(6, dtype=torch.long)
        parts = torch.ops.megatron_rl.logprob_partials(logits, targets, 0, 1.0, True, "cpu")
        assert [tuple(p.shape) for p in parts] == [(6,)] * 4
        assert parts[0].dtype == torch.float32
        vec = torch.empty(6)
        grad = torch.ops.megatron_rl.logprob_grad(logits, targets, 0, 1.0, vec, vec, vec, None,
                                                  None, "cpu")
        assert grad.shape == logits.shape and grad.dtype == torch.bfloat16


# CUDA: tests/gpu/test_gpu_kernel.py (the kernel against fp64 up to V = 152064).


# ---------------------------------------------------------------------------------------------
# Tensor parallel over gloo: TP=2 shards must reproduce the TP=1 result.
# ---------------------------------------------------------------------------------------------


def _tp2_case(split):
    logits, targets = _inputs(23, sum(split), torch.float32)
    ref = torch.randn(23, generator=torch.Generator().manual_seed(5)) - 6.0
    weights = [torch.randn(23, generator=torch.Generator().manual_seed(6 + k)) for k in range(4)]
    return logits, targets, ref, weights


def _run_case(x, targets, ref, weights, backend, **kwargs):
    o = token_logprobs_and_kl(x, targets, ref_logprobs=ref, temperature=0.9, return_entropy=True,
                              backend=backend, **kwargs)
    outs = (o.logprobs, o.log_ratio, o.k3, o.entropy)
    sum((w * t).sum() for w, t in zip(weights, outs)).backward()
    return [t.detach() for t in outs]


def _tp2_case_on_rank(rank, split, backend, dtype, group):
    """tp2_harness case: this rank's shard of the logits through the op."""
    logits, targets, ref, weights = _tp2_case(split)
    start = sum(split[:rank])
    x = logits[:, start:start + split[rank]].to(dtype).requires_grad_(True)
    outs = _run_case(x, targets, ref, weights, backend, vocab_start=start, tp_group=group)
    return outs, x.grad


@pytest.mark.distributed
def test_tp2_matches_tp1():
    """Two gloo ranks, each with half the vocab, reproduce the full-vocab values and gradients."""
    backends = ["torch"] + (["cpu"] if "cpu" in extension_backends() else [])
    results = run_two_ranks(_tp2_case_on_rank, backends)
    assert len(results) == len(TP2_SPLITS) * len(backends) * 2
    for (split, backend, dtype), (outs, grad) in results.items():
        logits, targets, ref, weights = _tp2_case(split)
        assert (targets < split[0]).any() and (targets >= split[0]).any()  # targets on both ranks
        x = logits.to(dtype).requires_grad_(True)
        tp1 = _run_case(x, targets, ref, weights, backend)
        for a, b in zip(outs, tp1):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(grad.float(), x.grad.float(), rtol=tol, atol=tol * 1e-1)


# ---------------------------------------------------------------------------------------------
# Parity with megatron-core's vocab_parallel_cross_entropy (TP=1; it needs parallel_state).
# ---------------------------------------------------------------------------------------------
def _megatron_worker(rank, init_file, result_file):
    import torch.distributed as dist
    torch.set_num_threads(1)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        logits, targets = _inputs(31, 1031, torch.float32)
        x = logits.clone().requires_grad_(True)
        loss = vocab_parallel_cross_entropy(x.view(31, 1, 1031), targets.view(31, 1)).view(31)
        weights = torch.randn(31, generator=torch.Generator().manual_seed(3))
        (-loss * weights).sum().backward()
        torch.save((-loss.detach(), x.grad), result_file)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.distributed
def test_matches_megatron_vocab_parallel_cross_entropy():
    pytest.importorskip("megatron.core")
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        result_file = os.path.join(tmp, "mcore.pt")
        try:
            mp.spawn(_megatron_worker, args=(os.path.join(tmp, "init"), result_file), nprocs=1)
        except Exception as exc:  # pragma: no cover - depends on the megatron-core build
            pytest.skip(f"megatron-core vocab_parallel_cross_entropy did not run on CPU: {exc}")
        mcore_lp, mcore_grad = torch.load(result_file)
    logits, targets = _inputs(31, 1031, torch.float32)
    weights = torch.randn(31, generator=torch.Generator().manual_seed(3))
    for backend in ["torch"] + (["cpu"] if "cpu" in extension_backends() else []):
        x = logits.clone().requires_grad_(True)
        lp = token_logprobs_and_kl(x, targets, backend=backend).logprobs
        (lp * weights).sum().backward()
        torch.testing.assert_close(lp.detach(), mcore_lp, rtol=1e-6, atol=2e-6)
        torch.testing.assert_close(x.grad, mcore_grad, rtol=1e-5, atol=1e-7)
