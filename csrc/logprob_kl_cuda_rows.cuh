// One thread's share of a row in the CUDA kernels (logprob_kl_cuda.cu), written once for the
// device and the host.
//
// Every kernel runs one block of `nthreads` threads per row; thread `tid` takes the row's
// elements tid, tid + nthreads, ... (the aligned body as 16-byte vectors). The functions here do
// that share: the forward ones return the thread's online state, which the kernel merges across
// the block with warp shuffles (`merge` / `exact_merge`), the backward ones write the thread's
// gradient elements. nvcc compiles them into the kernels (__expf); a host compiler compiles the
// same code for tests/ops/test_cuda_rows_on_host.py, which runs every thread of a block in turn
// and replays the shuffles' merge order, so the kernels' arithmetic is tested on any machine.
//
// Non-finite logits (the same rules as the CPU and torch backends):
// - -inf is a masked entry: probability 0, and it adds 0 to every sum (0 log 0 = 0);
// - NaN anywhere in a row makes that row's statistics NaN (and so its gradient);
// - a state's sums are relative to its "safe max": the max, or 0 while the max is -inf (then
//   the sums are 0, or NaN), so -inf - (-inf) never appears.
#pragma once

#include <cmath>
#include <cstdint>

#ifdef __CUDACC__
#define MRL_HD __host__ __device__ __forceinline__
#else
#define MRL_HD inline
#endif

namespace megatron_rl {
namespace cuda_rows {

MRL_HD float fast_exp(float x) {
#ifdef __CUDA_ARCH__
  return __expf(x);  // MUFU.EX2: relative error ~1e-6 for |x| < 20; keeps the kernels memory-bound
#else
  return std::exp(x);
#endif
}

MRL_HD float max2(float a, float b) { return fmaxf(a, b); }  // a NaN operand is ignored

MRL_HD float safe_max(float m) { return m == -INFINITY ? 0.f : m; }

template <typename T>
struct alignas(16) Vec16 {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
};

template <typename T>
MRL_HD float to_float(T x) {
  return static_cast<float>(x);
}

// Elements before the first 16-byte boundary of a row (processed one by one).
template <typename T>
MRL_HD int64_t aligned_prefix(const T* row, int64_t vocab) {
  constexpr int kVec = Vec16<T>::kSize;
  const int64_t mis = static_cast<int64_t>((reinterpret_cast<uintptr_t>(row) % 16) / sizeof(T));
  const int64_t prefix = mis == 0 ? 0 : kVec - mis;
  return prefix < vocab ? prefix : vocab;
}

// ---- log-prob forward: online (max m, sum e^(z-m), sum e^(z-m)(z-m)) ------------------------
struct State {
  float m;
  float s;
  float w;
};

MRL_HD State empty_state() { return State{-INFINITY, 0.f, 0.f}; }

// Move the sums to a new max; a state whose sum is 0 holds nothing to move (a NaN sum is moved
// and stays NaN).
template <bool kEntropy>
MRL_HD void rescale(State& st, float new_max) {
  if (st.s != 0.f) {
    const float delta = safe_max(st.m) - safe_max(new_max);
    const float c = fast_exp(delta);
    if (kEntropy) st.w = c * (st.w + delta * st.s);
    st.s *= c;
  }
  st.m = new_max;
}

// One element's e^(z - m) and its entropy term (0 for a masked element, NaN for NaN).
template <bool kEntropy>
MRL_HD void accumulate(State& st, float z) {
  const float d = z - safe_max(st.m);
  const float e = fast_exp(d);
  st.s += e;
  if (kEntropy) st.w += e == 0.f ? 0.f : e * d;
}

template <bool kEntropy>
MRL_HD void merge_into(State& r, const State& x) {
  if (x.s != 0.f) {
    const float d = safe_max(x.m) - safe_max(r.m), c = fast_exp(d);
    r.s += x.s * c;
    if (kEntropy) r.w += c * (x.w + d * x.s);
  }
}

template <bool kEntropy>
MRL_HD State merge(const State& a, const State& b) {
  State r{max2(a.m, b.m), 0.f, 0.f};
  merge_into<kEntropy>(r, a);
  merge_into<kEntropy>(r, b);
  return r;
}

template <typename T, bool kEntropy>
MRL_HD State thread_partials(const T* x, int64_t vocab, float inv_t, int64_t tid,
                             int64_t nthreads) {
  constexpr int kVec = Vec16<T>::kSize;
  State st = empty_state();
  auto add = [&](float z) {
    if (z > st.m) rescale<kEntropy>(st, z);
    accumulate<kEntropy>(st, z);
  };
  const int64_t prefix = aligned_prefix(x, vocab);
  for (int64_t j = tid; j < prefix; j += nthreads) add(to_float(x[j]) * inv_t);
  const int64_t num_vec = (vocab - prefix) / kVec;
  const Vec16<T>* xv = reinterpret_cast<const Vec16<T>*>(x + prefix);
  for (int64_t k = tid; k < num_vec; k += nthreads) {
    const Vec16<T> chunk = xv[k];
    float z[kVec];
    float vmax = -INFINITY;
#pragma unroll
    for (int l = 0; l < kVec; ++l) {
      z[l] = to_float(chunk.v[l]) * inv_t;
      vmax = max2(vmax, z[l]);
    }
    if (vmax > st.m) rescale<kEntropy>(st, vmax);  // one rescale per vector, not per element
#pragma unroll
    for (int l = 0; l < kVec; ++l) accumulate<kEntropy>(st, z[l]);
  }
  for (int64_t j = prefix + num_vec * kVec + tid; j < vocab; j += nthreads) {
    add(to_float(x[j]) * inv_t);
  }
  return st;
}

// ---- log-prob backward: g = -p (a + b (log p + H)) / T, plus a / T at the target ------------
template <bool kEntropy>
MRL_HD float grad_of(float z, float m, float ls, float a, float b, float h, float inv_t) {
  const float logp = (z - m) - ls;
  const float p = fast_exp(logp);
  const float coef = kEntropy ? a + b * (logp + h) : a;
  return p == 0.f ? 0.f : -p * coef * inv_t;  // a masked element gets no gradient
}

// kVectorized = false when logits and grad rows are not equally aligned (then every element is
// handled as "prefix"); true in the usual case (grad = empty_like(logits)). `t`: the target's
// index in this shard (outside [0, vocab): no one-hot term here).
template <typename T, bool kEntropy, bool kVectorized>
MRL_HD void thread_grad(const T* x, T* g, int64_t vocab, int64_t t, float m, float ls, float a,
                        float b, float h, float inv_t, int64_t tid, int64_t nthreads) {
  constexpr int kVec = Vec16<T>::kSize;
  const float onehot = a * inv_t;
  auto one = [&](int64_t j, float z) {
    float gj = grad_of<kEntropy>(z, m, ls, a, b, h, inv_t);
    if (j == t) gj += onehot;
    return static_cast<T>(gj);
  };
  const int64_t prefix = kVectorized ? aligned_prefix(x, vocab) : vocab;
  for (int64_t j = tid; j < prefix; j += nthreads) g[j] = one(j, to_float(x[j]) * inv_t);
  if (!kVectorized) return;
  const int64_t num_vec = (vocab - prefix) / kVec;
  const Vec16<T>* xv = reinterpret_cast<const Vec16<T>*>(x + prefix);
  Vec16<T>* gv = reinterpret_cast<Vec16<T>*>(g + prefix);
  for (int64_t k = tid; k < num_vec; k += nthreads) {
    const Vec16<T> chunk = xv[k];
    Vec16<T> out;
    const int64_t j0 = prefix + k * kVec;
#pragma unroll
    for (int l = 0; l < kVec; ++l) out.v[l] = one(j0 + l, to_float(chunk.v[l]) * inv_t);
    gv[k] = out;
  }
  for (int64_t j = prefix + num_vec * kVec + tid; j < vocab; j += nthreads) {
    g[j] = one(j, to_float(x[j]) * inv_t);
  }
}

// ---- exact per-position KL(p || q) from both logits rows ------------------------------------
// State: the two maxima, the two sums e^(z - m_p) and e^(r - m_q), and
// w = sum e^(z - m_p) ((z - m_p) - (r - m_q)), all relative to the safe maxima. Moving to new
// maxima (dp = m_p - m_p', dq = m_q - m_q', between safe maxima):
//   w' = e^dp (w + (dp - dq) s_p),  s_p' = e^dp s_p,  s_q' = e^dq s_q.
// s_p and s_q are moved independently (a row whose policy entries seen so far are all masked
// has s_p = 0 and may still have s_q > 0); w is 0 whenever s_p is.
struct ExactState {
  float mp;
  float sp;
  float mq;
  float sq;
  float w;
};

// cp * w for a state's w moved to a larger policy max; +inf (a policy entry where the
// reference is masked: KL = +inf) stays +inf, also where cp underflows to 0.
MRL_HD float scaled_w(float cp, float w) { return w == INFINITY ? w : cp * w; }

MRL_HD ExactState empty_exact_state() { return ExactState{-INFINITY, 0.f, -INFINITY, 0.f, 0.f}; }

MRL_HD void exact_rescale(ExactState& st, float new_mp, float new_mq) {
  const float dp = safe_max(st.mp) - safe_max(new_mp), dq = safe_max(st.mq) - safe_max(new_mq);
  if (st.sp != 0.f) {
    const float cp = fast_exp(dp);
    st.w = scaled_w(cp, st.w + (dp - dq) * st.sp);
    st.sp *= cp;
  }
  if (st.sq != 0.f) st.sq *= fast_exp(dq);
  st.mp = new_mp;
  st.mq = new_mq;
}

MRL_HD void exact_accumulate(ExactState& st, float z, float r) {
  const float dz = z - safe_max(st.mp), dr = r - safe_max(st.mq);
  const float e = fast_exp(dz);
  st.sp += e;
  st.sq += fast_exp(dr);
  const float d = dz - dr;  // +inf: a policy entry where the reference is masked (KL = +inf)
  st.w += e == 0.f ? (d == INFINITY ? d : 0.f) : e * d;  // otherwise p = 0 adds 0
}

MRL_HD void exact_add(ExactState& st, float z, float r) {
  if (z > st.mp || r > st.mq) exact_rescale(st, max2(st.mp, z), max2(st.mq, r));
  exact_accumulate(st, z, r);
}

MRL_HD void exact_merge_into(ExactState& r, const ExactState& a) {
  const float dp = safe_max(a.mp) - safe_max(r.mp), dq = safe_max(a.mq) - safe_max(r.mq);
  if (a.sp != 0.f) {
    const float cp = fast_exp(dp);
    r.sp += a.sp * cp;
    r.w += scaled_w(cp, a.w + (dp - dq) * a.sp);
  }
  if (a.sq != 0.f) r.sq += a.sq * fast_exp(dq);
}

MRL_HD ExactState exact_merge(const ExactState& a, const ExactState& b) {
  ExactState r{max2(a.mp, b.mp), 0.f, max2(a.mq, b.mq), 0.f, 0.f};
  exact_merge_into(r, a);
  exact_merge_into(r, b);
  return r;
}

// kVectorized = false when the logits and ref rows are not equally aligned (then every element
// goes through the scalar loop); true in the usual case (both fresh allocations).
template <typename T, bool kVectorized>
MRL_HD ExactState thread_exact_partials(const T* x, const T* y, int64_t vocab, int64_t tid,
                                        int64_t nthreads) {
  constexpr int kVec = Vec16<T>::kSize;
  ExactState st = empty_exact_state();
  const int64_t prefix = kVectorized ? aligned_prefix(x, vocab) : vocab;
  for (int64_t j = tid; j < prefix; j += nthreads) exact_add(st, to_float(x[j]), to_float(y[j]));
  if (!kVectorized) return st;
  const int64_t num_vec = (vocab - prefix) / kVec;
  const Vec16<T>* xv = reinterpret_cast<const Vec16<T>*>(x + prefix);
  const Vec16<T>* yv = reinterpret_cast<const Vec16<T>*>(y + prefix);
  for (int64_t k = tid; k < num_vec; k += nthreads) {
    const Vec16<T> cx = xv[k];
    const Vec16<T> cy = yv[k];
    float z[kVec], r[kVec];
    float vmp = -INFINITY, vmq = -INFINITY;
#pragma unroll
    for (int l = 0; l < kVec; ++l) {
      z[l] = to_float(cx.v[l]);
      r[l] = to_float(cy.v[l]);
      vmp = max2(vmp, z[l]);
      vmq = max2(vmq, r[l]);
    }
    if (vmp > st.mp || vmq > st.mq) {  // one rescale per vector pair, not per element
      exact_rescale(st, max2(st.mp, vmp), max2(st.mq, vmq));
    }
#pragma unroll
    for (int l = 0; l < kVec; ++l) exact_accumulate(st, z[l], r[l]);
  }
  for (int64_t j = prefix + num_vec * kVec + tid; j < vocab; j += nthreads) {
    exact_add(st, to_float(x[j]), to_float(y[j]));
  }
  return st;
}

MRL_HD float exact_grad_of(float z, float r, float mp, float lp, float mq, float lq, float kl,
                           float gk) {
  const float logp = (z - mp) - lp;
  const float logq = (r - mq) - lq;
  const float p = fast_exp(logp);
  return p == 0.f ? 0.f : gk * p * ((logp - logq) - kl);
}

// kVectorized = false unless logits, ref and grad rows are equally aligned. kAccumulate: grad
// already holds a gradient (the log-prob op's); the exact-KL term is added to it in fp32 and
// rounded once, so the two ops share one [N, V] gradient buffer.
template <typename T, bool kVectorized, bool kAccumulate>
MRL_HD void thread_exact_grad(const T* x, const T* y, T* g, int64_t vocab, float mp, float lp,
                              float mq, float lq, float kl, float gk, int64_t tid,
                              int64_t nthreads) {
  constexpr int kVec = Vec16<T>::kSize;
  auto one = [&](float z, float r, T old) {
    float gj = exact_grad_of(z, r, mp, lp, mq, lq, kl, gk);
    if (kAccumulate) gj += to_float(old);
    return static_cast<T>(gj);
  };
  const int64_t prefix = kVectorized ? aligned_prefix(x, vocab) : vocab;
  for (int64_t j = tid; j < prefix; j += nthreads) {
    g[j] = one(to_float(x[j]), to_float(y[j]), kAccumulate ? g[j] : T(0.f));
  }
  if (!kVectorized) return;
  const int64_t num_vec = (vocab - prefix) / kVec;
  const Vec16<T>* xv = reinterpret_cast<const Vec16<T>*>(x + prefix);
  const Vec16<T>* yv = reinterpret_cast<const Vec16<T>*>(y + prefix);
  Vec16<T>* gv = reinterpret_cast<Vec16<T>*>(g + prefix);
  for (int64_t k = tid; k < num_vec; k += nthreads) {
    const Vec16<T> cx = xv[k];
    const Vec16<T> cy = yv[k];
    Vec16<T> out;
    if (kAccumulate) out = gv[k];
#pragma unroll
    for (int l = 0; l < kVec; ++l) {
      out.v[l] = one(to_float(cx.v[l]), to_float(cy.v[l]), kAccumulate ? out.v[l] : T(0.f));
    }
    gv[k] = out;
  }
  for (int64_t j = prefix + num_vec * kVec + tid; j < vocab; j += nthreads) {
    g[j] = one(to_float(x[j]), to_float(y[j]), kAccumulate ? g[j] : T(0.f));
  }
}

}  // namespace cuda_rows
}  // namespace megatron_rl
