// CUDA kernels of the fused token log-prob / log-ratio / K3 op (forward partials, backward).
//
// Built only with WITH_CUDA (CUDA torch + nvcc; see setup.py). Same contract as the CPU
// kernels (csrc/logprob_kl.h, megatron_rl/ops/reference.py):
// - forward: one thread block per row. Each thread streams 16-byte vectors of the row
//   (8 bf16/fp16 or 4 fp32) and keeps an online (max, sum exp, sum exp * (z - max)) state;
//   the block merges the states with warp shuffles. Logits are read exactly once.
// - backward: one thread block per row; each 16-byte vector is read, turned into
//   -p * (a + b (log p + H)) * inv_t (+ a * inv_t at the target) and written: one read and one
//   write of [N, V_local], no [N, V] temporaries.
// Rows whose start is not 16-byte aligned (V_local * sizeof(T) not a multiple of 16) handle a
// scalar prefix first, so every row still uses aligned vector accesses for its body.
// The exact-KL kernels (exact_partials_kernel, exact_grad_kernel) follow the same pattern over
// two rows (policy and reference logits): forward reads each once, backward reads each once and
// writes grad_logits once.
// exp uses the __expf intrinsic (MUFU.EX2; relative error ~1e-6 for |x| < 20), which keeps the
// kernels memory-bound; sums are fp32 per thread and merged in fp32.
// Each thread's share of a row (loads, online states, merges, gradient elements) lives in
// logprob_kl_cuda_rows.cuh, compiled for the host too and tested there; this file holds the
// warp-shuffle block reductions, the kernels and their launches.
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "logprob_kl.h"
#include "logprob_kl_cuda_rows.cuh"

namespace megatron_rl {
namespace {

// float32 / bfloat16 / float16 only (float64 is served by the torch backend).
#define MRL_DISPATCH_CUDA_DTYPES(TYPE, NAME, ...)                    \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                     \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)       \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)    \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

constexpr int kThreads = 256;
constexpr int kMaxWarps = kThreads / 32;

using namespace cuda_rows;

// The block's merged state from each thread's (merge order: butterfly within each warp, then
// warp 0 over the warps' states; tests/ops/test_cuda_rows_on_host.py replays it on the host).
template <bool kEntropy>
__device__ State block_reduce(State st) {
  __shared__ State warp_states[kMaxWarps];
  for (int offset = 16; offset > 0; offset >>= 1) {
    State other{__shfl_xor_sync(0xffffffffu, st.m, offset),
                __shfl_xor_sync(0xffffffffu, st.s, offset),
                __shfl_xor_sync(0xffffffffu, st.w, offset)};
    st = merge<kEntropy>(st, other);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_states[warp] = st;
  __syncthreads();
  if (warp == 0) {
    st = lane < blockDim.x / 32 ? warp_states[lane] : empty_state();
    for (int offset = 16; offset > 0; offset >>= 1) {
      State other{__shfl_xor_sync(0xffffffffu, st.m, offset),
                  __shfl_xor_sync(0xffffffffu, st.s, offset),
                  __shfl_xor_sync(0xffffffffu, st.w, offset)};
      st = merge<kEntropy>(st, other);
    }
  }
  return st;  // valid in thread 0
}

__device__ __forceinline__ ExactState exact_shfl_xor(const ExactState& st, int offset) {
  return ExactState{__shfl_xor_sync(0xffffffffu, st.mp, offset),
                    __shfl_xor_sync(0xffffffffu, st.sp, offset),
                    __shfl_xor_sync(0xffffffffu, st.mq, offset),
                    __shfl_xor_sync(0xffffffffu, st.sq, offset),
                    __shfl_xor_sync(0xffffffffu, st.w, offset)};
}

__device__ ExactState exact_block_reduce(ExactState st) {
  __shared__ ExactState warp_states[kMaxWarps];
  for (int offset = 16; offset > 0; offset >>= 1) st = exact_merge(st, exact_shfl_xor(st, offset));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_states[warp] = st;
  __syncthreads();
  if (warp == 0) {
    st = lane < blockDim.x / 32 ? warp_states[lane] : empty_exact_state();
    for (int offset = 16; offset > 0; offset >>= 1) st = exact_merge(st, exact_shfl_xor(st, offset));
  }
  return st;  // valid in thread 0
}

template <typename T, bool kEntropy>
__global__ void __launch_bounds__(kThreads)
partials_kernel(const T* __restrict__ logits, const int64_t* __restrict__ targets, int64_t vocab,
                int64_t vocab_start, float inv_t, float* __restrict__ row_max,
                float* __restrict__ sum_exp, float* __restrict__ target_z,
                float* __restrict__ ent_w) {
  const int64_t row = blockIdx.x;
  const T* x = logits + row * vocab;
  State st = thread_partials<T, kEntropy>(x, vocab, inv_t, threadIdx.x, blockDim.x);
  st = block_reduce<kEntropy>(st);  // every thread reaches this (no early return above)
  if (threadIdx.x == 0) {
    row_max[row] = st.m;
    sum_exp[row] = st.s;
    if (kEntropy) ent_w[row] = st.w;
    const int64_t t = targets[row] - vocab_start;
    target_z[row] = (t >= 0 && t < vocab) ? to_float(x[t]) * inv_t : 0.f;
  }
}

template <typename T, bool kEntropy, bool kVectorized>
__global__ void __launch_bounds__(kThreads)
grad_kernel(const T* __restrict__ logits, const int64_t* __restrict__ targets, int64_t vocab,
            int64_t vocab_start, float inv_t, const float* __restrict__ row_max,
            const float* __restrict__ shifted_lse, const float* __restrict__ grad_coef,
            const float* __restrict__ entropy_grad, const float* __restrict__ entropy,
            T* __restrict__ grad) {
  const int64_t row = blockIdx.x;
  thread_grad<T, kEntropy, kVectorized>(
      logits + row * vocab, grad + row * vocab, vocab, targets[row] - vocab_start, row_max[row],
      shifted_lse[row], grad_coef[row], kEntropy ? entropy_grad[row] : 0.f,
      kEntropy ? entropy[row] : 0.f, inv_t, threadIdx.x, blockDim.x);
}

template <typename T, bool kVectorized>
__global__ void __launch_bounds__(kThreads)
exact_partials_kernel(const T* __restrict__ logits, const T* __restrict__ ref, int64_t vocab,
                      float* __restrict__ max_p, float* __restrict__ sum_p,
                      float* __restrict__ max_q, float* __restrict__ sum_q,
                      float* __restrict__ w_out) {
  const int64_t row = blockIdx.x;
  ExactState st = thread_exact_partials<T, kVectorized>(logits + row * vocab, ref + row * vocab,
                                                        vocab, threadIdx.x, blockDim.x);
  st = exact_block_reduce(st);  // every thread reaches this (no early return above)
  if (threadIdx.x == 0) {
    max_p[row] = st.mp;
    sum_p[row] = st.sp;
    max_q[row] = st.mq;
    sum_q[row] = st.sq;
    w_out[row] = st.w;
  }
}

template <typename T, bool kVectorized, bool kAccumulate>
__global__ void __launch_bounds__(kThreads)
exact_grad_kernel(const T* __restrict__ logits, const T* __restrict__ ref, int64_t vocab,
                  const float* __restrict__ max_p, const float* __restrict__ lse_p,
                  const float* __restrict__ max_q, const float* __restrict__ lse_q,
                  const float* __restrict__ kl, const float* __restrict__ grad_kl,
                  T* __restrict__ grad) {
  const int64_t row = blockIdx.x;
  thread_exact_grad<T, kVectorized, kAccumulate>(
      logits + row * vocab, ref + row * vocab, grad + row * vocab, vocab, max_p[row], lse_p[row],
      max_q[row], lse_q[row], kl[row], grad_kl[row], threadIdx.x, blockDim.x);
}

void check_cuda_inputs(const at::Tensor& logits) {
  TORCH_CHECK(logits.is_cuda(), "the cuda backend needs CUDA tensors");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16 ||
                  logits.scalar_type() == at::kHalf,
              "CUDA logits must be float32, bfloat16 or float16 (float64: use backend='torch'), "
              "got ", logits.scalar_type());
}

}  // namespace

Partials logprob_partials_cuda(const at::Tensor& logits, const at::Tensor& targets,
                               int64_t vocab_start, double inv_temperature, bool with_entropy) {
  check_common(logits, targets, vocab_start, inv_temperature);
  check_cuda_inputs(logits);
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const auto opts = logits.options().dtype(at::kFloat);
  at::Tensor row_max = at::empty({rows}, opts), sum_exp = at::empty({rows}, opts);
  at::Tensor target_z = at::empty({rows}, opts);
  at::Tensor ent_w = at::empty({with_entropy ? rows : 0}, opts);
  if (rows == 0) return {row_max, sum_exp, target_z, ent_w};
  TORCH_CHECK(rows <= INT32_MAX, "too many rows for one launch");
  const float inv_t = static_cast<float>(inv_temperature);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  MRL_DISPATCH_CUDA_DTYPES(logits.scalar_type(), "logprob_partials_cuda", [&] {
    auto launch = [&](auto kernel) {
      kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
          logits.data_ptr<scalar_t>(), targets.data_ptr<int64_t>(), vocab, vocab_start, inv_t,
          row_max.data_ptr<float>(), sum_exp.data_ptr<float>(), target_z.data_ptr<float>(),
          with_entropy ? ent_w.data_ptr<float>() : nullptr);
    };
    if (with_entropy) {
      launch(partials_kernel<scalar_t, true>);
    } else {
      launch(partials_kernel<scalar_t, false>);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {row_max, sum_exp, target_z, ent_w};
}

at::Tensor logprob_grad_cuda(const at::Tensor& logits, const at::Tensor& targets,
                             int64_t vocab_start, double inv_temperature,
                             const at::Tensor& row_max, const at::Tensor& shifted_lse,
                             const at::Tensor& grad_coef,
                             const std::optional<at::Tensor>& entropy_grad,
                             const std::optional<at::Tensor>& entropy) {
  check_common(logits, targets, vocab_start, inv_temperature);
  check_cuda_inputs(logits);
  check_grad_args(logits, row_max, shifted_lse, grad_coef, entropy_grad, entropy);
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  at::Tensor grad = at::empty_like(logits);
  if (rows == 0) return grad;
  TORCH_CHECK(rows <= INT32_MAX, "too many rows for one launch");
  const bool with_entropy = entropy_grad.has_value();
  const bool same_alignment = (reinterpret_cast<uintptr_t>(logits.data_ptr()) % 16) ==
                              (reinterpret_cast<uintptr_t>(grad.data_ptr()) % 16);
  const float inv_t = static_cast<float>(inv_temperature);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  MRL_DISPATCH_CUDA_DTYPES(logits.scalar_type(), "logprob_grad_cuda", [&] {
    auto launch = [&](auto kernel) {
      kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
          logits.data_ptr<scalar_t>(), targets.data_ptr<int64_t>(), vocab, vocab_start, inv_t,
          row_max.data_ptr<float>(), shifted_lse.data_ptr<float>(), grad_coef.data_ptr<float>(),
          with_entropy ? entropy_grad->data_ptr<float>() : nullptr,
          with_entropy ? entropy->data_ptr<float>() : nullptr, grad.data_ptr<scalar_t>());
    };
    if (with_entropy && same_alignment) {
      launch(grad_kernel<scalar_t, true, true>);
    } else if (with_entropy) {
      launch(grad_kernel<scalar_t, true, false>);
    } else if (same_alignment) {
      launch(grad_kernel<scalar_t, false, true>);
    } else {
      launch(grad_kernel<scalar_t, false, false>);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return grad;
}

ExactPartials exact_kl_partials_cuda(const at::Tensor& logits, const at::Tensor& ref_logits) {
  check_exact_inputs(logits, ref_logits);
  check_cuda_inputs(logits);
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const auto opts = logits.options().dtype(at::kFloat);
  at::Tensor max_p = at::empty({rows}, opts), sum_p = at::empty({rows}, opts);
  at::Tensor max_q = at::empty({rows}, opts), sum_q = at::empty({rows}, opts);
  at::Tensor w = at::empty({rows}, opts);
  if (rows == 0) return {max_p, sum_p, max_q, sum_q, w};
  TORCH_CHECK(rows <= INT32_MAX, "too many rows for one launch");
  const bool same_alignment = (reinterpret_cast<uintptr_t>(logits.data_ptr()) % 16) ==
                              (reinterpret_cast<uintptr_t>(ref_logits.data_ptr()) % 16);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  MRL_DISPATCH_CUDA_DTYPES(logits.scalar_type(), "exact_kl_partials_cuda", [&] {
    auto launch = [&](auto kernel) {
      kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
          logits.data_ptr<scalar_t>(), ref_logits.data_ptr<scalar_t>(), vocab,
          max_p.data_ptr<float>(), sum_p.data_ptr<float>(), max_q.data_ptr<float>(),
          sum_q.data_ptr<float>(), w.data_ptr<float>());
    };
    if (same_alignment) {
      launch(exact_partials_kernel<scalar_t, true>);
    } else {
      launch(exact_partials_kernel<scalar_t, false>);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {max_p, sum_p, max_q, sum_q, w};
}

at::Tensor exact_kl_grad_cuda(const at::Tensor& logits, const at::Tensor& ref_logits,
                              const at::Tensor& max_p, const at::Tensor& lse_p,
                              const at::Tensor& max_q, const at::Tensor& lse_q,
                              const at::Tensor& kl, const at::Tensor& grad_kl,
                              const std::optional<at::Tensor>& accumulate_into) {
  check_exact_inputs(logits, ref_logits);
  check_cuda_inputs(logits);
  check_exact_grad_args(logits, max_p, lse_p, max_q, lse_q, kl, grad_kl, accumulate_into);
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const bool accumulate = accumulate_into.has_value();
  at::Tensor grad = accumulate ? *accumulate_into : at::empty_like(logits);
  if (rows == 0) return grad;
  TORCH_CHECK(rows <= INT32_MAX, "too many rows for one launch");
  const uintptr_t align = reinterpret_cast<uintptr_t>(logits.data_ptr()) % 16;
  const bool same_alignment =
      align == reinterpret_cast<uintptr_t>(ref_logits.data_ptr()) % 16 &&
      align == reinterpret_cast<uintptr_t>(grad.data_ptr()) % 16;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  MRL_DISPATCH_CUDA_DTYPES(logits.scalar_type(), "exact_kl_grad_cuda", [&] {
    auto launch = [&](auto kernel) {
      kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
          logits.data_ptr<scalar_t>(), ref_logits.data_ptr<scalar_t>(), vocab,
          max_p.data_ptr<float>(), lse_p.data_ptr<float>(), max_q.data_ptr<float>(),
          lse_q.data_ptr<float>(), kl.data_ptr<float>(), grad_kl.data_ptr<float>(),
          grad.data_ptr<scalar_t>());
    };
    if (same_alignment && accumulate) {
      launch(exact_grad_kernel<scalar_t, true, true>);
    } else if (same_alignment) {
      launch(exact_grad_kernel<scalar_t, true, false>);
    } else if (accumulate) {
      launch(exact_grad_kernel<scalar_t, false, true>);
    } else {
      launch(exact_grad_kernel<scalar_t, false, false>);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return grad;
}

}  // namespace megatron_rl
