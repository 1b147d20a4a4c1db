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
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "logprob_kl.h"

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

template <typename T>
struct alignas(16) Vec16 {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
};

template <typename T>
__device__ __forceinline__ float to_float(T x) {
  return static_cast<float>(x);
}

// Online softmax state of one thread (and, after merging, of a block): max m, sum e^(z-m),
// and for entropy sum e^(z-m) (z-m).
struct State {
  float m;
  float s;
  float w;
};

template <bool kEntropy>
__device__ __forceinline__ void rescale(State& st, float new_max) {
  if (st.s > 0.f) {
    const float delta = st.m - new_max;
    const float c = __expf(delta);
    if (kEntropy) st.w = c * (st.w + delta * st.s);
    st.s *= c;
  }
  st.m = new_max;
}

template <bool kEntropy>
__device__ __forceinline__ void add(State& st, float z) {
  if (z > st.m) rescale<kEntropy>(st, z);
  const float d = z - st.m;
  const float e = __expf(d);
  st.s += e;
  if (kEntropy) st.w += e * d;
}

template <bool kEntropy>
__device__ __forceinline__ State merge(State a, State b) {
  const float m = fmaxf(a.m, b.m);
  State r{m, 0.f, 0.f};
  if (a.s > 0.f) {
    const float da = a.m - m, ca = __expf(da);
    r.s += a.s * ca;
    if (kEntropy) r.w += ca * (a.w + da * a.s);
  }
  if (b.s > 0.f) {
    const float db = b.m - m, cb = __expf(db);
    r.s += b.s * cb;
    if (kEntropy) r.w += cb * (b.w + db * b.s);
  }
  return r;
}

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
    st = lane < blockDim.x / 32 ? warp_states[lane] : State{-INFINITY, 0.f, 0.f};
    for (int offset = 16; offset > 0; offset >>= 1) {
      State other{__shfl_xor_sync(0xffffffffu, st.m, offset),
                  __shfl_xor_sync(0xffffffffu, st.s, offset),
                  __shfl_xor_sync(0xffffffffu, st.w, offset)};
      st = merge<kEntropy>(st, other);
    }
  }
  return st;  // valid in thread 0
}

// Elements before the first 16-byte boundary of a row (processed one by one).
template <typename T>
__device__ __forceinline__ int64_t aligned_prefix(const T* row, int64_t vocab) {
  constexpr int kVec = Vec16<T>::kSize;
  const int64_t mis = static_cast<int64_t>((reinterpret_cast<uintptr_t>(row) % 16) / sizeof(T));
  const int64_t prefix = mis == 0 ? 0 : kVec - mis;
  return prefix < vocab ? prefix : vocab;
}

template <typename T, bool kEntropy>
__global__ void __launch_bounds__(kThreads)
partials_kernel(const T* __restrict__ logits, const int64_t* __restrict__ targets, int64_t vocab,
                int64_t vocab_start, float inv_t, float* __restrict__ row_max,
                float* __restrict__ sum_exp, float* __restrict__ target_z,
                float* __restrict__ ent_w) {
  constexpr int kVec = Vec16<T>::kSize;
  const int64_t row = blockIdx.x;
  const T* x = logits + row * vocab;
  State st{-INFINITY, 0.f, 0.f};

  const int64_t prefix = aligned_prefix(x, vocab);
  for (int64_t j = threadIdx.x; j < prefix; j += blockDim.x) add<kEntropy>(st, to_float(x[j]) * inv_t);
  const int64_t num_vec = (vocab - prefix) / kVec;
  const Vec16<T>* xv = reinterpret_cast<const Vec16<T>*>(x + prefix);
  for (int64_t k = threadIdx.x; k < num_vec; k += blockDim.x) {
    const Vec16<T> chunk = xv[k];
    float z[kVec];
    float vmax = -INFINITY;
#pragma unroll
    for (int l = 0; l < kVec; ++l) {
      z[l] = to_float(chunk.v[l]) * inv_t;
      vmax = fmaxf(vmax, z[l]);
    }
    if (vmax > st.m) rescale<kEntropy>(st, vmax);  // one rescale per vector, not per element
#pragma unroll
    for (int l = 0; l < kVec; ++l) {
      const float d = z[l] - st.m;
      const float e = __expf(d);
      st.s += e;
      if (kEntropy) st.w += e * d;
    }
  }
  for (int64_t j = prefix + num_vec * kVec + threadIdx.x; j < vocab; j += blockDim.x) {
    add<kEntropy>(st, to_float(x[j]) * inv_t);
  }

  st = block_reduce<kEntropy>(st);
  if (threadIdx.x == 0) {
    row_max[row] = st.m;
    sum_exp[row] = st.s;
    if (kEntropy) ent_w[row] = st.w;
    const int64_t t = targets[row] - vocab_start;
    target_z[row] = (t >= 0 && t < vocab) ? to_float(x[t]) * inv_t : 0.f;
  }
}

template <typename T, bool kEntropy>
__device__ __forceinline__ float grad_of(float z, float m, float ls, float a, float b, float h,
                                         float inv_t) {
  const float logp = (z - m) - ls;
  const float p = __expf(logp);
  const float coef = kEntropy ? a + b * (logp + h) : a;
  return -p * coef * inv_t;
}

// kVectorized = false when logits and grad rows are not equally aligned (then every element is
// handled as "prefix"); true in the usual case (grad = empty_like(logits)).
template <typename T, bool kEntropy, bool kVectorized>
__global__ void __launch_bounds__(kThreads)
grad_kernel(const T* __restrict__ logits, const int64_t* __restrict__ targets, int64_t vocab,
            int64_t vocab_start, float inv_t, const float* __restrict__ row_max,
            const float* __restrict__ shifted_lse, const float* __restrict__ grad_coef,
            const float* __restrict__ entropy_grad, const float* __restrict__ entropy,
            T* __restrict__ grad) {
  constexpr int kVec = Vec16<T>::kSize;
  const int64_t row = blockIdx.x;
  const T* x = logits + row * vocab;
  T* g = grad + row * vocab;
  const float m = row_max[row], ls = shifted_lse[row], a = grad_coef[row];
  const float b = kEntropy ? entropy_grad[row] : 0.f;
  const float h = kEntropy ? entropy[row] : 0.f;
  const int64_t t = targets[row] - vocab_start;  // may lie outside [0, vocab): no one-hot here
  const float onehot = a * inv_t;

  const int64_t prefix = kVectorized ? aligned_prefix(x, vocab) : vocab;
  for (int64_t j = threadIdx.x; j < prefix; j += blockDim.x) {
    float gj = grad_of<T, kEntropy>(to_float(x[j]) * inv_t, m, ls, a, b, h, inv_t);
    if (j == t) gj += onehot;
    g[j] = static_cast<T>(gj);
  }
  if (!kVectorized) return;
  const int64_t num_vec = (vocab - prefix) / kVec;
  const Vec16<T>* xv = reinterpret_cast<const Vec16<T>*>(x + prefix);
  Vec16<T>* gv = reinterpret_cast<Vec16<T>*>(g + prefix);
  for (int64_t k = threadIdx.x; k < num_vec; k += blockDim.x) {
    const Vec16<T> chunk = xv[k];
    Vec16<T> out;
    const int64_t j0 = prefix + k * kVec;
#pragma unroll
    for (int l = 0; l < kVec; ++l) {
      float gj = grad_of<T, kEntropy>(to_float(chunk.v[l]) * inv_t, m, ls, a, b, h, inv_t);
      if (j0 + l == t) gj += onehot;
      out.v[l] = static_cast<T>(gj);
    }
    gv[k] = out;
  }
  for (int64_t j = prefix + num_vec * kVec + threadIdx.x; j < vocab; j += blockDim.x) {
    float gj = grad_of<T, kEntropy>(to_float(x[j]) * inv_t, m, ls, a, b, h, inv_t);
    if (j == t) gj += onehot;
    g[j] = static_cast<T>(gj);
  }
}

// ---- exact per-position KL(p || q) from both logits rows (the "exact" estimator) ----------
// Same structure as the log-prob kernels: one thread block per row, 16-byte vectors of both
// rows, an online state per thread merged with warp shuffles. State: the two maxima, the two
// sums e^(z - m_p) and e^(r - m_q), and w = sum e^(z - m_p) ((z - m_p) - (r - m_q)). Moving to
// new maxima m_p' >= m_p, m_q' >= m_q (dp = m_p - m_p', dq = m_q - m_q'):
//   w' = e^dp (w + (dp - dq) s_p),  s_p' = e^dp s_p,  s_q' = e^dq s_q.
// A state with s_p == 0 has seen no element (maxima -inf) and contributes nothing; any state
// that has seen an element has s_p >= 1 and s_q >= 1 (the maximum's own term).
struct ExactState {
  float mp;
  float sp;
  float mq;
  float sq;
  float w;
};

__device__ __forceinline__ void exact_rescale(ExactState& st, float new_mp, float new_mq) {
  if (st.sp > 0.f) {
    const float dp = st.mp - new_mp, dq = st.mq - new_mq;
    const float cp = __expf(dp);
    st.w = cp * (st.w + (dp - dq) * st.sp);
    st.sp *= cp;
    st.sq *= __expf(dq);
  }
  st.mp = new_mp;
  st.mq = new_mq;
}

__device__ __forceinline__ void exact_add(ExactState& st, float z, float r) {
  if (z > st.mp || r > st.mq) exact_rescale(st, fmaxf(st.mp, z), fmaxf(st.mq, r));
  const float dz = z - st.mp, dr = r - st.mq;
  const float e = __expf(dz);
  st.sp += e;
  st.sq += __expf(dr);
  st.w += e * (dz - dr);
}

__device__ __forceinline__ void exact_merge_into(ExactState& r, const ExactState& a) {
  if (a.sp > 0.f) {
    const float dp = a.mp - r.mp, dq = a.mq - r.mq;
    const float cp = __expf(dp);
    r.sp += a.sp * cp;
    r.sq += a.sq * __expf(dq);
    r.w += cp * (a.w + (dp - dq) * a.sp);
  }
}

__device__ __forceinline__ ExactState exact_merge(const ExactState& a, const ExactState& b) {
  ExactState r{fmaxf(a.mp, b.mp), 0.f, fmaxf(a.mq, b.mq), 0.f, 0.f};
  exact_merge_into(r, a);
  exact_merge_into(r, b);
  return r;
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
    st = lane < blockDim.x / 32 ? warp_states[lane]
                                : ExactState{-INFINITY, 0.f, -INFINITY, 0.f, 0.f};
    for (int offset = 16; offset > 0; offset >>= 1) st = exact_merge(st, exact_shfl_xor(st, offset));
  }
  return st;  // valid in thread 0
}

// kVectorized = false when the logits and ref rows are not equally aligned (then every element
// goes through the scalar loop); true in the usual case (both fresh allocations).
template <typename T, bool kVectorized>
__global__ void __launch_bounds__(kThreads)
exact_partials_kernel(const T* __restrict__ logits, const T* __restrict__ ref, int64_t vocab,
                      float* __restrict__ max_p, float* __restrict__ sum_p,
                      float* __restrict__ max_q, float* __restrict__ sum_q,
                      float* __restrict__ w_out) {
  constexpr int kVec = Vec16<T>::kSize;
  const int64_t row = blockIdx.x;
  const T* x = logits + row * vocab;
  const T* y = ref + row * vocab;
  ExactState st{-INFINITY, 0.f, -INFINITY, 0.f, 0.f};

  const int64_t prefix = kVectorized ? aligned_prefix(x, vocab) : vocab;
  for (int64_t j = threadIdx.x; j < prefix; j += blockDim.x) {
    exact_add(st, to_float(x[j]), to_float(y[j]));
  }
  if (kVectorized) {
    const int64_t num_vec = (vocab - prefix) / kVec;
    const Vec16<T>* xv = reinterpret_cast<const Vec16<T>*>(x + prefix);
    const Vec16<T>* yv = reinterpret_cast<const Vec16<T>*>(y + prefix);
    for (int64_t k = threadIdx.x; k < num_vec; k += blockDim.x) {
      const Vec16<T> cx = xv[k];
      const Vec16<T> cy = yv[k];
      float z[kVec], r[kVec];
      float vmp = -INFINITY, vmq = -INFINITY;
#pragma unroll
      for (int l = 0; l < kVec; ++l) {
        z[l] = to_float(cx.v[l]);
        r[l] = to_float(cy.v[l]);
        vmp = fmaxf(vmp, z[l]);
        vmq = fmaxf(vmq, r[l]);
      }
      if (vmp > st.mp || vmq > st.mq) {  // one rescale per vector pair, not per element
        exact_rescale(st, fmaxf(st.mp, vmp), fmaxf(st.mq, vmq));
      }
#pragma unroll
      for (int l = 0; l < kVec; ++l) {
        const float dz = z[l] - st.mp, dr = r[l] - st.mq;
        const float e = __expf(dz);
        st.sp += e;
        st.sq += __expf(dr);
        st.w += e * (dz - dr);
      }
    }
    for (int64_t j = prefix + num_vec * kVec + threadIdx.x; j < vocab; j += blockDim.x) {
      exact_add(st, to_float(x[j]), to_float(y[j]));
    }
  }

  st = exact_block_reduce(st);  // every thread reaches this (no early return above)
  if (threadIdx.x == 0) {
    max_p[row] = st.mp;
    sum_p[row] = st.sp;
    max_q[row] = st.mq;
    sum_q[row] = st.sq;
    w_out[row] = st.w;
  }
}

__device__ __forceinline__ float exact_grad_of(float z, float r, float mp, float lp, float mq,
                                               float lq, float kl, float gk) {
  const float logp = (z - mp) - lp;
  const float logq = (r - mq) - lq;
  return gk * __expf(logp) * ((logp - logq) - kl);
}

// kVectorized = false unless logits, ref and grad rows are equally aligned. kAccumulate: grad
// already holds a gradient (the log-prob op's); the exact-KL term is added to it in fp32 and
// rounded once, so the two ops share one [N, V] gradient buffer.
template <typename T, bool kVectorized, bool kAccumulate>
__global__ void __launch_bounds__(kThreads)
exact_grad_kernel(const T* __restrict__ logits, const T* __restrict__ ref, int64_t vocab,
                  const float* __restrict__ max_p, const float* __restrict__ lse_p,
                  const float* __restrict__ max_q, const float* __restrict__ lse_q,
                  const float* __restrict__ kl, const float* __restrict__ grad_kl,
                  T* __restrict__ grad) {
  constexpr int kVec = Vec16<T>::kSize;
  const int64_t row = blockIdx.x;
  const T* x = logits + row * vocab;
  const T* y = ref + row * vocab;
  T* g = grad + row * vocab;
  const float mp = max_p[row], lp = lse_p[row], mq = max_q[row], lq = lse_q[row];
  const float k = kl[row], gk = grad_kl[row];

  const int64_t prefix = kVectorized ? aligned_prefix(x, vocab) : vocab;
  for (int64_t j = threadIdx.x; j < prefix; j += blockDim.x) {
    float gj = exact_grad_of(to_float(x[j]), to_float(y[j]), mp, lp, mq, lq, k, gk);
    if (kAccumulate) gj += to_float(g[j]);
    g[j] = static_cast<T>(gj);
  }
  if (!kVectorized) return;
  const int64_t num_vec = (vocab - prefix) / kVec;
  const Vec16<T>* xv = reinterpret_cast<const Vec16<T>*>(x + prefix);
  const Vec16<T>* yv = reinterpret_cast<const Vec16<T>*>(y + prefix);
  Vec16<T>* gv = reinterpret_cast<Vec16<T>*>(g + prefix);
  for (int64_t kk = threadIdx.x; kk < num_vec; kk += blockDim.x) {
    const Vec16<T> cx = xv[kk];
    const Vec16<T> cy = yv[kk];
    Vec16<T> out;
    if (kAccumulate) out = gv[kk];
#pragma unroll
    for (int l = 0; l < kVec; ++l) {
      float gj = exact_grad_of(to_float(cx.v[l]), to_float(cy.v[l]), mp, lp, mq, lq, k, gk);
      if (kAccumulate) gj += to_float(out.v[l]);
      out.v[l] = static_cast<T>(gj);
    }
    gv[kk] = out;
  }
  for (int64_t j = prefix + num_vec * kVec + threadIdx.x; j < vocab; j += blockDim.x) {
    float gj = exact_grad_of(to_float(x[j]), to_float(y[j]), mp, lp, mq, lq, k, gk);
    if (kAccumulate) gj += to_float(g[j]);
    g[j] = static_cast<T>(gj);
  }
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
