"""Tests of the fused LM-head scoring op (megatron_rl.ops.lm_head): log-probs, entropy, K1/K3 and
the exact KL from hidden states and the output-layer weight, without materialising the logits.

Oracle: the same quantities from logits = hidden @ weight.T built in float64 (textbook
log_softmax). In low precision the op may have at most ~2x the error of today's logits path
(logits in the input dtype, then the fused log-prob op) plus a small floor.
"""
from typing import Optional

import pytest
import torch

from megatron_rl.ops import extension_backends, token_logprobs_and_kl
from megatron_rl.ops.lm_head import (PEAK_TOKEN_VECTORS, default_chunk_tokens,
                                    default_vocab_block, lm_head_exact_kl,
                                    lm_head_logprobs_and_kl, lm_head_peak_bytes)
from megatron_rl.ops.reference import naive_exact_kl, naive_token_logprobs_and_kl
from tp2_harness import TP2_SPLITS, run_two_ranks

CPU_BACKENDS = ["torch", pytest.param("cpu", marks=pytest.mark.skipif(
    "cpu" not in extension_backends(), reason="megatron_rl._C built without the CPU kernel"))]


def _inputs(n, h, v, dtype, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=gen) * scale).to(dtype)
    weight = (torch.randn(v, h, generator=gen) / h ** 0.5 * 3).to(dtype)
    ref_hidden = (hidden.double() + 0.3 * torch.randn(n, h, generator=gen)).to(dtype)
    ref_weight = (weight.double() + 0.1 * torch.randn(v, h, generator=gen) / h ** 0.5).to(dtype)
    targets = torch.randint(0, v, (n,), generator=gen)
    ref_lp = -torch.rand(n, generator=gen) * 5
    coefs = torch.randn(5, n, generator=gen, dtype=torch.float64)
    return hidden, weight, targets, ref_lp, ref_hidden, ref_weight, coefs


def _fused(backend, chunk=None, vocab_block=None):
    """The fused head; with `chunk`, `chunk` tokens at a time over vocabulary blocks of
    `vocab_block` rows (default chunk + 4)."""
    if chunk is not None and vocab_block is None:
        vocab_block = chunk + 4

    def fn(hidden, weight, targets, ref_lp, ref_hidden, ref_weight):
        o = lm_head_logprobs_and_kl(hidden, weight, targets, ref_logprobs=ref_lp,
                                    return_entropy=True, backend=backend, ref_hidden=ref_hidden,
                                    ref_weight=ref_weight, chunk_tokens=chunk,
                                    vocab_block=vocab_block)
        return o.logprobs, o.log_ratio, o.k3, o.entropy, o.exact_kl
    return fn


def _logits_path(hidden, weight, targets, ref_lp, ref_hidden, ref_weight):
    """Today's path: the logits in the input dtype, then the fused logits op."""
    o = token_logprobs_and_kl(hidden @ weight.t(), targets, ref_logprobs=ref_lp,
                              return_entropy=True, ref_logits=ref_hidden @ ref_weight.t())
    return o.logprobs, o.log_ratio, o.k3, o.entropy, o.exact_kl


def _oracle(hidden, weight, targets, ref_lp, ref_hidden, ref_weight):
    """Textbook float64: log_softmax of hidden @ weight.T (differentiable in hidden, weight)."""
    z = hidden.double() @ weight.double().t()
    lp, lr, k3, ent = naive_token_logprobs_and_kl(z, targets, ref_lp.double(), dtype=torch.float64)
    kl = naive_exact_kl(z, ref_hidden.double() @ ref_weight.double().t(), dtype=torch.float64)
    return lp, lr, k3, ent, kl


def _run(fn, hidden, weight, targets, ref_lp, ref_hidden, ref_weight, coefs):
    """Outputs (float64) and the gradients of sum_k coefs_k . out_k w.r.t. hidden and weight."""
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    outs = fn(h, w, targets, ref_lp, ref_hidden, ref_weight)
    loss = sum((c * o.double()).sum() for c, o in zip(coefs, outs))
    gh, gw = torch.autograd.grad(loss, [h, w])
    return [o.detach().double() for o in outs], gh.double(), gw.double()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("chunk", [1, 3, None])
def test_float64_matches_the_textbook_values_and_gradients(backend, chunk):
    """fp64 in, every output and both gradients equal the oracle's to rounding, whatever the
    chunking (odd N = 11, V = 37, H = 13)."""
    args = _inputs(11, 13, 37, torch.float64)
    outs, gh, gw = _run(_fused(backend, chunk), *args)
    ref_outs, ref_gh, ref_gw = _run(_oracle, *args)
    for name, a, b in zip(["logprobs", "log_ratio", "k3", "entropy", "exact_kl"], outs, ref_outs):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-11, msg=name)
    torch.testing.assert_close(gh, ref_gh, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(gw, ref_gw, rtol=1e-9, atol=1e-11)


def test_gradcheck_float64():
    hidden, weight, targets, ref_lp, ref_hidden, ref_weight, _ = _inputs(5, 4, 9, torch.float64)
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)

    def f(h, w):
        o = lm_head_logprobs_and_kl(h, w, targets, ref_logprobs=ref_lp, return_entropy=True,
                                    ref_hidden=ref_hidden, ref_weight=ref_weight, chunk_tokens=2,
                                    vocab_block=4)
        return o.logprobs, o.k3, o.entropy, o.exact_kl
    assert torch.autograd.gradcheck(f, (h, w))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_error_at_most_twice_the_logits_path(backend, dtype):
    """Against the fp64 oracle, the fused op's error is at most ~2x that of the logits path
    in the same dtype (plus a floor), for values and both gradients."""
    args = _inputs(24, 32, 301, dtype, seed=1)
    outs, gh, gw = _run(_fused(backend, 5), *args)
    base_outs, base_gh, base_gw = _run(_logits_path, *args)
    ref_outs, ref_gh, ref_gw = _run(_oracle, *args)
    err = lambda a, b: float((a - b).abs().max())  # noqa: E731
    floor = 1e-5 if dtype == torch.float32 else 1e-3
    for name, a, base, ref in zip(["logprobs", "log_ratio", "k3", "entropy", "exact_kl"], outs,
                                  base_outs, ref_outs):
        assert err(a, ref) <= 2 * err(base, ref) + floor, name
    scale_h, scale_w = float(ref_gh.abs().max()), float(ref_gw.abs().max())
    gfloor = 1e-5 if dtype == torch.float32 else 2e-2
    assert err(gh, ref_gh) <= 2 * err(base_gh, ref_gh) + gfloor * scale_h
    assert err(gw, ref_gw) <= 2 * err(base_gw, ref_gw) + gfloor * scale_w


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_qwen_vocabulary_151936(backend):
    """A Qwen2.5-sized vocabulary (V = 151936) in a few chunks (two of tokens, four of the
    vocabulary, the last one partial): values and gradients in fp32 against the fp64 oracle."""
    args = _inputs(6, 16, 151936, torch.float32, seed=2)
    outs, gh, gw = _run(_fused(backend, 4, vocab_block=40000), *args)
    ref_outs, ref_gh, ref_gw = _run(_oracle, *args)
    close = lambda a, b: torch.testing.assert_close(  # noqa: E731
        a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))
    for a, b in zip(outs + [gh, gw], ref_outs + [ref_gh, ref_gw]):
        close(a, b)


def test_tied_embedding_gets_both_gradients():
    """A tied output layer: the weight is also the input embedding. Its gradient is the sum of
    the embedding's and the output layer's, as autograd gives for the textbook computation."""
    gen = torch.Generator().manual_seed(3)
    v, h, n = 29, 8, 10
    emb = torch.randn(v, h, generator=gen, dtype=torch.float64)
    mix = torch.randn(h, h, generator=gen, dtype=torch.float64)
    tokens = torch.randint(0, v, (n,), generator=gen)
    targets = torch.randint(0, v, (n,), generator=gen)
    coefs = torch.randn(2, n, generator=gen, dtype=torch.float64)

    def grad(fused):
        e = emb.clone().requires_grad_(True)
        hidden = torch.tanh(e[tokens] @ mix)
        if fused:
            o = lm_head_logprobs_and_kl(hidden, e, targets, return_entropy=True, chunk_tokens=3,
                                        vocab_block=7)
            lp, ent = o.logprobs, o.entropy
        else:
            lp, _, _, ent = naive_token_logprobs_and_kl(hidden @ e.t(), targets, None,
                                                        dtype=torch.float64)
        (coefs[0] * lp + coefs[1] * ent).sum().backward()
        return e.grad
    torch.testing.assert_close(grad(True), grad(False), rtol=1e-10, atol=1e-12)


def test_masked_tokens_get_no_gradient():
    """Rows whose outputs get zero weight in the loss (masked tokens) get zero hidden gradient;
    the weight's gradient equals that of the unmasked rows alone."""
    hidden, weight, targets, ref_lp, ref_hidden, ref_weight, coefs = _inputs(9, 6, 23,
                                                                             torch.float64)
    mask = torch.tensor([1, 0, 1, 1, 0, 0, 1, 0, 1], dtype=torch.float64)
    _, gh, gw = _run(_fused("torch", 2), hidden, weight, targets, ref_lp, ref_hidden, ref_weight,
                     coefs * mask)
    assert torch.all(gh[mask == 0] == 0)
    keep = mask.bool()
    _, _, gw_kept = _run(_fused("torch", 2), hidden[keep], weight, targets[keep], ref_lp[keep],
                         ref_hidden[keep], ref_weight, coefs[:, keep])
    torch.testing.assert_close(gw, gw_kept, rtol=1e-12, atol=1e-14)


def test_only_the_needed_gradients_and_shapes():
    """Leading dims are kept; a frozen weight gets no gradient; exact-KL-only backward works;
    zero rows work; bad shapes and dtypes fail with the argument named."""
    hidden, weight, targets, _, ref_hidden, ref_weight, _ = _inputs(6, 5, 11, torch.float32)
    h = hidden.reshape(2, 3, 5).requires_grad_(True)
    kl = lm_head_exact_kl(h, weight, ref_hidden.reshape(2, 3, 5), ref_weight)
    assert kl.shape == (2, 3)
    kl.sum().backward()
    assert h.grad is not None and weight.grad is None
    o = lm_head_logprobs_and_kl(hidden[:0], weight, targets[:0], return_entropy=True)
    assert o.logprobs.shape == (0,) and o.entropy.shape == (0,)
    with pytest.raises(ValueError, match="weight"):
        lm_head_logprobs_and_kl(hidden, weight[:, :4], targets)
    with pytest.raises(ValueError, match="dtype"):
        lm_head_logprobs_and_kl(hidden, weight.double(), targets)
    with pytest.raises(ValueError, match="targets must lie"):
        lm_head_logprobs_and_kl(hidden, weight, targets + 100)


def _cpu_peak_bytes(fn) -> int:
    """Peak bytes `fn()` allocates on the CPU beyond what existed before it: the running sum of
    the allocations and frees torch's profiler records (profile_memory), in time order. Runs on
    one thread: the op's own allocations do not depend on the thread count, oneDNN's per-thread
    buffers do (see `_matmul_workspace_bytes`)."""
    from torch.profiler import ProfilerActivity, profile

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
    finally:
        torch.set_num_threads(threads)
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    now = peak = 0
    for e in events:
        now += e.nbytes()  # pyright: ignore[reportAttributeAccessIssue] (not in torch's stub)
        peak = max(peak, now)
    return peak


def _matmul_workspace_bytes(m: int, k: int, n: int, dtype: torch.dtype, threads: int = 1) -> int:
    """Upper bound on the bytes one CPU matmul [m, k] @ [k, n] allocates through torch's allocator
    beyond its [m, n] output, over every code path the CPU may take (oneDNN picks it by the CPU's
    instruction set; `ONEDNN_MAX_CPU_ISA` only lowers it):

    - float32/float64, and 16-bit types below AVX-512 (AVX2 and older): MKL or torch's own
      kernels, whose packing buffers are not torch allocations: 0.
    - bf16/fp16 with AVX-512 but no native bf16 instructions (AVX512_CORE, AVX512_CORE_VNNI:
      Skylake/Cascade Lake/Ice Lake servers): oneDNN's gemm:jit:bf16 accumulates the whole output
      in one fp32 scratchpad buffer, 4 m n bytes; its packing is internal to the gemm driver.
    - brgemm (AVX512_CORE_BF16: Cooper Lake, AMD Zen 4/5; AVX512_CORE_FP16; AVX512_CORE_AMX and
      AMX-FP16: Sapphire/Granite Rapids; AVX2_VNNI_2: Sierra Forest, Arrow Lake): fp32
      accumulation blocks of the output (at most 4 m n over all threads), copies of A's blocks
      when A is not row-major with an even k (at most 2 m k), each thread's repack of the B
      blocks it multiplies into the VNNI pair layout (at most 2 k n a thread), blocks padded to
      64 elements, and AMX's tile workspace (1 KiB a thread).

    The bound is the sum of the last path's terms, which also covers the gemm:jit path:
    4 m' n' + 2 m' k' + threads (2 k' n' + 1 KiB), with m', k', n' rounded up to 64. Measured
    on an AMX Xeon (oneDNN 3.12 in torch 2.13; AVX2, AVX512_CORE, AVX512_CORE_BF16,
    AVX512_CORE_AMX; 1 and 2 threads): at most 0.89 of it, for the op's shapes and for
    [2048, 896] @ [896, 4096], [2048, 4096] @ [4096, 896] and [64, 896] @ [896, 151936]. Not
    run there: AVX2_VNNI_2 (no avx_ne_convert), the same brgemm with AVX2's narrower blocks, and
    AMX-FP16, the same brgemm as AMX for fp16: both inside the same terms.
    """
    if torch.empty(0, dtype=dtype).element_size() >= 4:
        return 0
    m, k, n = (-(-x // 64) * 64 for x in (m, k, n))
    return 4 * m * n + 2 * m * k + threads * (2 * k * n + 1024)


def _lm_head_matmuls(n: int, h: int, v: int, dtype: torch.dtype, chunk: Optional[int],
                     block: Optional[int]) -> list[tuple[int, int, int]]:
    """(m, k, n) of the op's largest matmuls at these block sizes (the op's defaults when None):
    forward h_c W^T ([c, H] @ [H, V]), backward h W_b^T ([N, H] @ [H, b]), dz W_b ([N, b] @
    [b, H]) and dz^T h ([b, N] @ [N, H])."""
    s, cpu = torch.empty(0, dtype=dtype).element_size(), torch.device("cpu")
    c = min(n, chunk or default_chunk_tokens(v, s, cpu))
    b = min(v, block or default_vocab_block(n, v, s, cpu))
    return [(c, h, v), (n, h, b), (n, b, h), (b, n, h)]


def _lm_head_workspace_bytes(n: int, h: int, v: int, dtype: torch.dtype, chunk: Optional[int],
                             block: Optional[int]) -> int:
    """The largest `_matmul_workspace_bytes` (one thread) of the op's matmuls. The op runs one
    matmul at a time, so at most one workspace is live."""
    return max(_matmul_workspace_bytes(*mkn, dtype) for mkn in _lm_head_matmuls(n, h, v, dtype,
                                                                                 chunk, block))


PEAK_CASES = [
    (torch.float32, True, "both", 512, 64, 4000, 128, 1000),
    (torch.float32, False, "both", 1024, 32, 3000, 256, 500),
    (torch.bfloat16, True, "both", 512, 64, 4000, 128, 1000),
    (torch.float64, True, "both", 512, 64, 4000, 128, 1000),
    (torch.float32, True, "hidden", 512, 64, 4000, 128, 1000),
    (torch.float32, True, "weight", 512, 64, 4000, 128, 1000),
    (torch.float32, True, "both", 300, 64, 4000, None, None),  # the CPU's own block sizes
]


def _measured_peak(dtype, exact, grads, n, h, v, chunk, block):
    """The measured peak of one forward+backward of the compiled CPU op, and the inputs' flags."""
    hidden, weight, targets, _, ref_hidden, ref_weight, _ = _inputs(n, h, v, dtype)
    hidden.requires_grad_(grads in ("both", "hidden"))
    weight.requires_grad_(grads in ("both", "weight"))
    ref = {"ref_hidden": ref_hidden, "ref_weight": ref_weight} if exact else {}

    def step():
        o = lm_head_logprobs_and_kl(hidden, weight, targets, return_entropy=True, backend="cpu",
                                    chunk_tokens=chunk, vocab_block=block, **ref)
        loss = o.logprobs.sum() + o.entropy.sum()
        (loss + o.exact_kl.sum() if exact else loss).backward()

    return _cpu_peak_bytes(step), hidden.requires_grad, weight.requires_grad


needs_cpu_kernel = pytest.mark.skipif("cpu" not in extension_backends(),
                                      reason="megatron_rl._C built without the CPU kernel")


@needs_cpu_kernel
@pytest.mark.parametrize("dtype,exact,grads,n,h,v,chunk,block", PEAK_CASES)
def test_analytic_peak_is_the_measured_cpu_peak(dtype, exact, grads, n, h, v, chunk, block):
    """lm_head_peak_bytes against the CPU allocations of one forward+backward (the compiled
    kernels): the measured peak is at most the analytic one plus one matmul's oneDNN workspace
    (0 in fp32/fp64 and on CPUs without AVX-512), and at least the analytic one less the
    per-token allowance, on whichever code path this CPU's oneDNN takes. The bf16 case measures
    3,739,660 bytes on AVX2, 5,787,788 on AVX512_CORE (the fp32 output buffer of a 128 x 4000
    matmul), 3,814,412 on AVX512_CORE_BF16 and 3,749,900 on AMX; analytic 3,764,224."""
    measured, hidden_grad, weight_grad = _measured_peak(dtype, exact, grads, n, h, v, chunk,
                                                        block)
    analytic = lm_head_peak_bytes(n, h, v, dtype, "cpu", exact_kl=exact, hidden_grad=hidden_grad,
                                  weight_grad=weight_grad, chunk_tokens=chunk, vocab_block=block)
    workspace = _lm_head_workspace_bytes(n, h, v, dtype, chunk, block)
    allowance = PEAK_TOKEN_VECTORS * n * (8 if dtype == torch.float64 else 4)
    assert analytic - allowance <= measured <= analytic + workspace, (measured, analytic,
                                                                     workspace)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["a_b", "a_bt", "at_b"])
def test_matmul_workspace_bound_holds_for_the_peak_shapes(dtype, layout):
    """`_matmul_workspace_bytes` bounds what one matmul of the memory tests' shapes allocates
    beyond its output on this CPU's code path, with the operands laid out as the op passes them
    (B transposed in h W^T, A transposed in dz^T h)."""
    gen = torch.Generator().manual_seed(0)
    shapes = {mkn for case in PEAK_CASES for mkn in _lm_head_matmuls(*case[3:6], dtype, *case[6:])}
    for m, k, n in sorted(shapes):
        a = torch.randn(k, m, generator=gen).to(dtype).t() if layout == "at_b" else (
            torch.randn(m, k, generator=gen).to(dtype))
        b = torch.randn(n, k, generator=gen).to(dtype).t() if layout == "a_bt" else (
            torch.randn(k, n, generator=gen).to(dtype))
        out = torch.empty(m, n, dtype=dtype)
        extra = _cpu_peak_bytes(lambda: torch.matmul(a, b, out=out))
        assert extra <= _matmul_workspace_bytes(m, k, n, dtype), (m, k, n, extra)


@needs_cpu_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_peak_bound_fails_an_op_that_holds_the_full_logits(dtype):
    """The bound of the test above is tight enough to catch a regression: the same op holding
    [N, V] logits at once (one chunk of all N tokens, one block of all V entries) measures above
    the analytic peak plus workspace computed for the blocked sizes, on every code path."""
    n, h, v, chunk, block = 512, 64, 4000, 128, 1000
    measured, _, _ = _measured_peak(dtype, True, "both", n, h, v, n, v)
    bound = (lm_head_peak_bytes(n, h, v, dtype, "cpu", exact_kl=True, chunk_tokens=chunk,
                                vocab_block=block)
             + _lm_head_workspace_bytes(n, h, v, dtype, chunk, block))
    assert measured > bound, (measured, bound)


def test_analytic_peak_at_the_gpu_block_size():
    """The GPU test's shape (tests/gpu/test_gpu_lm_head.py), by hand: 512 MiB blocks on a GPU,
    so 32768 vocabulary entries of 8192 bf16 tokens per block; three blocks (logits, the
    reference's, their gradient), the bf16 weight gradient and the fp32 hidden gradient."""
    n, h, v = 8192, 896, 151936
    blocks = 3 * (n * 32768 * 2)
    assert blocks == 3 * 512 * 2 ** 20
    by_hand = blocks + v * h * 2 + n * h * 4 + PEAK_TOKEN_VECTORS * n * 4
    assert lm_head_peak_bytes(n, h, v, torch.bfloat16, "cuda", exact_kl=True) == by_hand
    # under one [N, V] bf16 logits tensor, of which the logits path holds three
    assert by_hand < n * v * 2
    # on the CPU the blocks are 128 MiB: a quarter of the vocabulary entries per block
    assert lm_head_peak_bytes(n, h, v, torch.bfloat16, "cpu", exact_kl=True) == (
        3 * 128 * 2 ** 20 + v * h * 2 + n * h * 4 + PEAK_TOKEN_VECTORS * n * 4)


def _tp2_case(rank, split, backend, dtype, group):
    """This rank's vocab shard of the output layer; the hidden gradient summed over the two
    ranks (as megatron's copy_to_tensor_model_parallel_region does in backward)."""
    import torch.distributed as dist

    v = sum(split)
    hidden, weight, targets, ref_lp, ref_hidden, ref_weight, coefs = _inputs(7, 12, v, dtype)
    start = sum(split[:rank])
    w = weight[start:start + split[rank]].clone().requires_grad_(True)
    h = hidden.clone().requires_grad_(True)
    o = lm_head_logprobs_and_kl(h, w, targets, ref_logprobs=ref_lp, return_entropy=True,
                                vocab_start=start, tp_group=group, backend=backend,
                                ref_hidden=ref_hidden,
                                ref_weight=ref_weight[start:start + split[rank]], chunk_tokens=3,
                                vocab_block=100)
    outs = [o.logprobs, o.log_ratio, o.k3, o.entropy, o.exact_kl]
    sum((c * x.double()).sum() for c, x in zip(coefs, outs)).backward()
    gh = h.grad.float().clone()
    dist.all_reduce(gh, group=group)
    return [x.detach() for x in outs] + [gh], w.grad.float().t().contiguous()


def test_tp2_matches_tp1():
    """Two gloo ranks, each with half (and an uneven split) of the vocabulary: outputs, the
    summed hidden gradient and the gathered weight gradient equal the one-rank op's."""
    backends = ["torch"] + (["cpu"] if "cpu" in extension_backends() else [])
    results = run_two_ranks(_tp2_case, backends)
    for split in TP2_SPLITS:
        for backend in backends:
            for dtype in (torch.float32, torch.bfloat16):
                outs, gw_t = results[(split, backend, dtype)]
                args = _inputs(7, 12, sum(split), dtype)
                ref_outs, ref_gh, ref_gw = _run(_fused(backend, 3), *args)
                tol = 1e-5 if dtype == torch.float32 else 2e-2
                for a, b in zip(outs[:5], ref_outs):
                    torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol)
                scale = float(ref_gh.abs().max())
                torch.testing.assert_close(outs[5].double(), ref_gh, rtol=tol, atol=tol * scale)
                torch.testing.assert_close(gw_t.t().double(), ref_gw, rtol=tol,
                                           atol=tol * float(ref_gw.abs().max()))
