"""The CUDA kernels' arithmetic, run on the CPU: csrc/logprob_kl_cuda_rows.cuh compiled by the
host compiler into tests/ops/cuda_rows_host.cpp, which runs every thread of a 256-thread block
in turn and merges their states in the order of the kernels' warp shuffles.

This is the code the kernels run per thread (loads of 16-byte vectors, the unaligned prefix, the
online states, the merges, the gradient elements); what it cannot check is the GPU itself
(__expf for std::exp, the shuffles, memory): tests/gpu/test_gpu_kernel.py and
test_gpu_exact_kl.py do that on a GPU. Here every output is compared with the torch backend's
(reference.py, itself held to fp64 in test_logprob_kl.py / test_exact_kl.py) on finite logits,
masked (-inf) entries and NaN, for fp32 / bf16 / fp16, rows that start unaligned, and the
vectorized and scalar paths.
"""
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils import cpp_extension

from megatron_rl.ops import reference
from test_nonfinite_logits import NAN, masked_case

REPO = Path(__file__).resolve().parents[2]
DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
GRAD_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    exe = tmp_path_factory.mktemp("cuda_rows") / "cuda_rows_host"
    cxx = os.environ.get("CXX", "c++")
    includes = [f"-I{d}" for d in [str(REPO / "csrc")] + cpp_extension.include_paths()]
    build = subprocess.run([cxx, "-O2", "-std=c++20", *includes,
                            str(REPO / "tests/ops/cuda_rows_host.cpp"), "-o", str(exe)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    return HostBlock(exe, tmp_path_factory.mktemp("cuda_rows_io"))


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


class HostBlock:
    """Runs the CUDA kernels' per-thread code of one op over rows (see cuda_rows_host.cpp)."""

    def __init__(self, exe, io_dir):
        self.exe, self.io = exe, io_dir

    def _run(self, op, dtype, rows, vocab, offset, flags, payload, out_count, out_dtype):
        inp, out = self.io / "in.bin", self.io / "out.bin"
        header = np.array([rows, vocab, offset, *flags], dtype=np.int64).tobytes()
        inp.write_bytes(header + b"".join(payload))
        res = subprocess.run([str(self.exe), op, DTYPES[dtype], str(inp), str(out)],
                             capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        return torch.frombuffer(bytearray(out.read_bytes()), dtype=out_dtype).reshape(rows, out_count)

    def partials(self, x, inv_t, entropy, offset):
        n, v = x.shape
        f32 = np.array([inv_t], dtype=np.float32).tobytes()
        out = self._run("partials", x.dtype, n, v, offset, [int(entropy), 0], [_raw(x), f32], 3,
                        torch.float32)
        return out.unbind(1)  # m, s, w

    def grad(self, x, t_local, m, ls, a, b, h, inv_t, entropy, vectorized, offset):
        n, v = x.shape
        stats = [s.float().numpy().tobytes() for s in (m, ls, a, b, h)]
        payload = [_raw(x), t_local.numpy().astype(np.int64).tobytes(), *stats,
                   np.array([inv_t], dtype=np.float32).tobytes()]
        return self._run("grad", x.dtype, n, v, offset, [int(entropy), int(vectorized)], payload,
                         v, x.dtype)

    def exact_partials(self, x, y, vectorized, offset):
        n, v = x.shape
        out = self._run("exact_partials", x.dtype, n, v, offset, [int(vectorized), 0],
                        [_raw(x), _raw(y)], 5, torch.float32)
        return out.unbind(1)  # mp, sp, mq, sq, w

    def exact_grad(self, x, y, stats, vectorized, offset, accumulate_into=None):
        n, v = x.shape
        payload = [_raw(x), _raw(y), *[s.float().numpy().tobytes() for s in stats]]
        if accumulate_into is not None:
            payload.append(_raw(accumulate_into))
        return self._run("exact_grad", x.dtype, n, v, offset,
                         [int(vectorized), int(accumulate_into is not None)], payload, v, x.dtype)


def _inputs(kind, vocab, seed=0):
    """fp64 (z, r): finite rows, masked rows (test_nonfinite_logits.masked_case), those with
    underflowed policy entries where the reference is masked (KL +inf), or with NaN."""
    if kind == "finite":
        g = torch.Generator().manual_seed(seed)
        z = torch.randn(4, vocab, generator=g, dtype=torch.float64) * 3
        return z, z + torch.randn(4, vocab, generator=g, dtype=torch.float64)
    z, r, _ = masked_case(vocab, seed)
    if kind == "underflow":  # policy entries 95 below the max (e^-95 = 0 in fp32), reference -inf
        z[5, 100:110] = z[5].max() - 95
        r[5, 100:110] = float("-inf")
        z[4, :vocab // 2] = z[4].max() - 95  # a thread's whole share low at first
        r[4, :100] = float("-inf")
    if kind == "nan":
        z[0, vocab // 2] = NAN
        z[1, 0] = NAN
        r[4, 1] = NAN
    return z, r


def _same(got, want, rtol, atol):
    torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=atol, equal_nan=True)


CASES = [("finite", 1), ("finite", 7), ("finite", 1000), ("finite", 4099),
         ("masked", 3000), ("underflow", 3000), ("nan", 3000)]


@pytest.mark.parametrize("offset", [0, 3])  # rows starting on / off a 16-byte boundary
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind,vocab", CASES)
def test_logprob_partials_and_grad(host, kind, vocab, dtype, offset):
    z, _ = _inputs(kind, vocab)
    x = z.to(dtype)
    inv_t = 1 / 0.7
    m, s, w = host.partials(x, inv_t, entropy=True, offset=offset)
    targets = torch.arange(x.shape[0]) % vocab
    rm, rs, _, rw = reference.logprob_partials_torch(x, targets, 0, inv_t, True)
    ok = ~z.isnan().any(1)
    assert torch.equal(m[ok], rm[ok])  # the max is exact
    _same(s[ok], rs[ok], 1e-5, 0)
    _same(w[ok], rw[ok], 1e-5, 1e-5 * rs[ok].abs().max())
    assert s[~ok].isnan().all()  # a NaN row's sum (so its log-prob, entropy, gradient) is NaN
    # backward from the same statistics, with entropy and without, vectorized and scalar
    ls = torch.log(rs)
    a = torch.linspace(-1, 1, x.shape[0])
    b, h = torch.linspace(0.5, -0.3, x.shape[0]), ls - rw / rs
    for entropy in (True, False):
        want = reference.logprob_grad_torch(x, targets, 0, inv_t, rm, ls, a,
                                            b if entropy else None, h if entropy else None)
        for vectorized in (True, False):
            got = host.grad(x, targets, rm, ls, a, b, h, inv_t, entropy, vectorized, offset)
            rtol = GRAD_RTOL[dtype]
            _same(got, want, rtol, rtol * want.double().nan_to_num().abs().max())
            masked = z == float("-inf")
            masked[torch.arange(len(targets)), targets] = False  # the one-hot term's
            assert (got[masked & ok[:, None]] == 0).all()  # (a NaN row's gradient is NaN)


@pytest.mark.parametrize("offset", [0, 3])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind,vocab", CASES)
def test_exact_kl_partials_and_grad(host, kind, vocab, dtype, offset):
    z, r = _inputs(kind, vocab)
    x, y = z.to(dtype), r.to(dtype)
    want = reference.exact_kl_partials_torch(x, y)
    ok = ~(z.isnan() | r.isnan()).any(1)
    for vectorized in (True, False):
        got = [t[ok] for t in host.exact_partials(x, y, vectorized, offset)]
        assert torch.equal(got[0], want[0][ok]) and torch.equal(got[2], want[2][ok])  # exact
        _same(got[1], want[1][ok], 1e-5, 0)
        _same(got[3], want[3][ok], 1e-5, 0)
        _same(got[4], want[4][ok], 1e-5, 1e-5 * want[1][ok].abs().max())
        _, sp, _, sq, w = [t[~ok] for t in host.exact_partials(x, y, vectorized, offset)]
        assert (w / sp - torch.log(sp) + torch.log(sq)).isnan().all()  # a NaN row's KL is NaN
    mp, sp, mq, sq, w = want
    lp, lq = torch.log(sp), torch.log(sq)
    kl = w / sp - lp + lq
    gk = torch.linspace(-2, 1, x.shape[0])
    stats = (mp, lp, mq, lq, kl, gk)
    grad_want = reference.exact_kl_grad_torch(x, y, *stats)
    prior = torch.randn(x.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    acc_want = reference.exact_kl_grad_torch(x, y, *stats, accumulate_into=prior.clone())
    rtol = GRAD_RTOL[dtype]
    for vectorized in (True, False):
        got = host.exact_grad(x, y, stats, vectorized, offset)
        _same(got, grad_want, rtol, rtol * grad_want.double().nan_to_num().abs().max())
        assert (got[(z == float("-inf")) & ok[:, None]] == 0).all()
        got = host.exact_grad(x, y, stats, vectorized, offset, accumulate_into=prior)
        _same(got, acc_want, rtol, rtol * acc_want.double().nan_to_num().abs().max())
