// CPU kernels of the fused token log-prob / log-ratio / K3 op (forward partials and backward).
//
// Rows are split across threads with at::parallel_for (OpenMP in PyTorch's builds, honouring
// torch.set_num_threads). Within a row, logits are processed in L1-sized blocks with fp32
// vectors (logprob_kl_cpu_kernels.h): 8 lanes in the AVX2+FMA+F16C build, 4 in the baseline
// x86-64 build. Both are compiled into the extension and one is picked at load time from
// CPUID, so the wheel stays portable without -march=native. float64 logits (used by
// gradcheck) take a plain scalar path with std::exp and double accumulation.
#include "logprob_kl.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

// ---- the two instruction-set variants of the row kernels ----------------------------------
#define MRL_ISA isa_default
#define MRL_VEC_BYTES 16
#include "logprob_kl_cpu_kernels.h"
#undef MRL_VEC_BYTES
#undef MRL_ISA

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MRL_HAVE_AVX2_VARIANT 1
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define MRL_ISA isa_avx2
#define MRL_VEC_BYTES 32
#define MRL_HAVE_F16C 1
#include "logprob_kl_cpu_kernels.h"
#undef MRL_HAVE_F16C
#undef MRL_VEC_BYTES
#undef MRL_ISA
#pragma GCC pop_options
#endif

namespace megatron_rl {
namespace {

enum class Isa { kDefault, kAvx2 };

Isa detect_isa() {
#ifdef MRL_HAVE_AVX2_VARIANT
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    return Isa::kAvx2;
  }
#endif
  return Isa::kDefault;
}

Isa g_isa = detect_isa();

// Rows per parallel task: enough work (~32K logits) to amortize scheduling.
int64_t grain_rows(int64_t vocab) { return std::max<int64_t>(1, (int64_t{1} << 15) / vocab); }

// ---- float64 reference path (gradcheck) ----------------------------------------------------
// Non-finite logits as in the float32 kernels: sums relative to the safe max, masked (-inf)
// entries add 0 and get no gradient, NaN propagates.
double safe_max64(double m) { return m == -INFINITY ? 0.0 : m; }
double times_unless_zero64(double e, double d) { return e == 0.0 ? 0.0 : e * d; }
// the exact KL's w term: as times_unless_zero64, except that d = +inf (a policy entry where the
// reference is masked) stays +inf however small p: the KL is +inf
double kl_term64(double e, double d) { return d == INFINITY ? d : times_unless_zero64(e, d); }

void partials_rows_f64(const double* logits, const int64_t* targets, int64_t begin, int64_t end,
                       int64_t vocab, int64_t vocab_start, double inv_t, bool with_entropy,
                       double* row_max, double* sum_exp, double* target_z, double* ent_w) {
  for (int64_t i = begin; i < end; ++i) {
    const double* x = logits + i * vocab;
    double m = -INFINITY;
    for (int64_t j = 0; j < vocab; ++j) m = std::max(m, x[j] * inv_t);
    const double ms = safe_max64(m);
    double s = 0.0, w = 0.0;
    for (int64_t j = 0; j < vocab; ++j) {
      const double d = x[j] * inv_t - ms;
      const double e = std::exp(d);
      s += e;
      w += times_unless_zero64(e, d);
    }
    row_max[i] = m;
    sum_exp[i] = s;
    if (with_entropy) ent_w[i] = w;
    const int64_t t = targets[i] - vocab_start;
    target_z[i] = (t >= 0 && t < vocab) ? x[t] * inv_t : 0.0;
  }
}

void grad_rows_f64(const double* logits, const int64_t* targets, int64_t begin, int64_t end,
                   int64_t vocab, int64_t vocab_start, double inv_t, const double* row_max,
                   const double* shifted_lse, const double* grad_coef, const double* entropy_grad,
                   const double* entropy, double* grad) {
  for (int64_t i = begin; i < end; ++i) {
    const double* x = logits + i * vocab;
    double* g = grad + i * vocab;
    const double a = grad_coef[i];
    const double b = entropy_grad ? entropy_grad[i] : 0.0;
    const double h = entropy ? entropy[i] : 0.0;
    for (int64_t j = 0; j < vocab; ++j) {
      const double logp = (x[j] * inv_t - row_max[i]) - shifted_lse[i];
      g[j] = -times_unless_zero64(std::exp(logp), a + b * (logp + h)) * inv_t;
    }
    const int64_t t = targets[i] - vocab_start;
    if (t >= 0 && t < vocab) g[t] += a * inv_t;
  }
}

void exact_partials_rows_f64(const double* logits, const double* ref, int64_t begin, int64_t end,
                             int64_t vocab, double* max_p, double* sum_p, double* max_q,
                             double* sum_q, double* w_out) {
  for (int64_t i = begin; i < end; ++i) {
    const double* x = logits + i * vocab;
    const double* y = ref + i * vocab;
    double mp = -INFINITY, mq = -INFINITY;
    for (int64_t j = 0; j < vocab; ++j) {
      mp = std::max(mp, x[j]);
      mq = std::max(mq, y[j]);
    }
    const double mps = safe_max64(mp), mqs = safe_max64(mq);
    double sp = 0.0, sq = 0.0, w = 0.0;
    for (int64_t j = 0; j < vocab; ++j) {
      const double dz = x[j] - mps, dr = y[j] - mqs;
      const double e = std::exp(dz);
      sp += e;
      sq += std::exp(dr);
      w += kl_term64(e, dz - dr);
    }
    max_p[i] = mp;
    sum_p[i] = sp;
    max_q[i] = mq;
    sum_q[i] = sq;
    w_out[i] = w;
  }
}

void exact_grad_rows_f64(const double* logits, const double* ref, int64_t begin, int64_t end,
                         int64_t vocab, const double* max_p, const double* lse_p,
                         const double* max_q, const double* lse_q, const double* kl,
                         const double* grad_kl, double* grad, bool accumulate) {
  for (int64_t i = begin; i < end; ++i) {
    const double* x = logits + i * vocab;
    const double* y = ref + i * vocab;
    double* g = grad + i * vocab;
    for (int64_t j = 0; j < vocab; ++j) {
      const double logp = (x[j] - max_p[i]) - lse_p[i];
      const double logq = (y[j] - max_q[i]) - lse_q[i];
      const double v = grad_kl[i] * times_unless_zero64(std::exp(logp), (logp - logq) - kl[i]);
      g[j] = accumulate ? g[j] + v : v;
    }
  }
}

// ---- dispatch on dtype, entropy flag and ISA -----------------------------------------------
template <typename T>
const T* typed_ptr(const at::Tensor& t) {
  return reinterpret_cast<const T*>(t.data_ptr());
}
template <typename T>
T* typed_mut_ptr(at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

template <typename T, bool kEntropy>
void run_partials(Isa isa, const T* x, const int64_t* tg, int64_t b, int64_t e, int64_t v,
                  int64_t vs, float inv_t, float* m, float* s, float* zt, float* w) {
#ifdef MRL_HAVE_AVX2_VARIANT
  if (isa == Isa::kAvx2) {
    isa_avx2::partials_rows<T, kEntropy>(x, tg, b, e, v, vs, inv_t, m, s, zt, w);
    return;
  }
#endif
  isa_default::partials_rows<T, kEntropy>(x, tg, b, e, v, vs, inv_t, m, s, zt, w);
}

template <typename T, bool kEntropy>
void run_grad(Isa isa, const T* x, const int64_t* tg, int64_t b, int64_t e, int64_t v,
              int64_t vs, float inv_t, const float* m, const float* ls, const float* a,
              const float* eg, const float* h, T* g) {
#ifdef MRL_HAVE_AVX2_VARIANT
  if (isa == Isa::kAvx2) {
    isa_avx2::grad_rows<T, kEntropy>(x, tg, b, e, v, vs, inv_t, m, ls, a, eg, h, g);
    return;
  }
#endif
  isa_default::grad_rows<T, kEntropy>(x, tg, b, e, v, vs, inv_t, m, ls, a, eg, h, g);
}

template <typename T>
void run_exact_partials(Isa isa, const T* x, const T* y, int64_t b, int64_t e, int64_t v,
                        float* mp, float* sp, float* mq, float* sq, float* w) {
#ifdef MRL_HAVE_AVX2_VARIANT
  if (isa == Isa::kAvx2) {
    isa_avx2::exact_partials_rows<T>(x, y, b, e, v, mp, sp, mq, sq, w);
    return;
  }
#endif
  isa_default::exact_partials_rows<T>(x, y, b, e, v, mp, sp, mq, sq, w);
}

template <typename T, bool kAccumulate>
void run_exact_grad(Isa isa, const T* x, const T* y, int64_t b, int64_t e, int64_t v,
                    const float* mp, const float* lp, const float* mq, const float* lq,
                    const float* kl, const float* gk, T* g) {
#ifdef MRL_HAVE_AVX2_VARIANT
  if (isa == Isa::kAvx2) {
    isa_avx2::exact_grad_rows<T, kAccumulate>(x, y, b, e, v, mp, lp, mq, lq, kl, gk, g);
    return;
  }
#endif
  isa_default::exact_grad_rows<T, kAccumulate>(x, y, b, e, v, mp, lp, mq, lq, kl, gk, g);
}

// Calls fn(T*) with T the storage type of the logits: float, uint16_t (bf16 bits), _Float16.
template <typename Fn>
void dispatch_low_precision(at::ScalarType dtype, Fn&& fn) {
  switch (dtype) {
    case at::kFloat: fn(static_cast<float*>(nullptr)); break;
    case at::kBFloat16: fn(static_cast<uint16_t*>(nullptr)); break;
    case at::kHalf: fn(static_cast<_Float16*>(nullptr)); break;
    default: TORCH_CHECK(false, "logits dtype must be float32, bfloat16, float16 or float64, got ",
                         dtype);
  }
}

}  // namespace

std::string cpu_isa() { return g_isa == Isa::kAvx2 ? "avx2" : "default"; }

void set_cpu_isa(const std::string& isa) {
  if (isa == "default") {
    g_isa = Isa::kDefault;
  } else if (isa == "avx2") {
    TORCH_CHECK(detect_isa() == Isa::kAvx2, "this CPU (or build) has no AVX2+FMA+F16C variant");
    g_isa = Isa::kAvx2;
  } else {
    TORCH_CHECK(false, "unknown cpu isa '", isa, "'; valid: default, avx2");
  }
}

Partials logprob_partials_cpu(const at::Tensor& logits, const at::Tensor& targets,
                              int64_t vocab_start, double inv_temperature, bool with_entropy) {
  check_common(logits, targets, vocab_start, inv_temperature);
  TORCH_CHECK(logits.device().is_cpu(), "logprob_partials_cpu needs CPU tensors");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const bool f64 = logits.scalar_type() == at::kDouble;
  const auto opts = logits.options().dtype(f64 ? at::kDouble : at::kFloat);
  at::Tensor row_max = at::empty({rows}, opts), sum_exp = at::empty({rows}, opts);
  at::Tensor target_z = at::empty({rows}, opts);
  at::Tensor ent_w = at::empty({with_entropy ? rows : 0}, opts);
  const int64_t* tg = targets.data_ptr<int64_t>();
  const Isa isa = g_isa;

  if (f64) {
    at::parallel_for(0, rows, grain_rows(vocab), [&](int64_t b, int64_t e) {
      partials_rows_f64(logits.data_ptr<double>(), tg, b, e, vocab, vocab_start, inv_temperature,
                        with_entropy, row_max.data_ptr<double>(), sum_exp.data_ptr<double>(),
                        target_z.data_ptr<double>(),
                        with_entropy ? ent_w.data_ptr<double>() : nullptr);
    });
    return {row_max, sum_exp, target_z, ent_w};
  }
  const float inv_t = static_cast<float>(inv_temperature);
  float* m = row_max.data_ptr<float>();
  float* s = sum_exp.data_ptr<float>();
  float* zt = target_z.data_ptr<float>();
  float* w = with_entropy ? ent_w.data_ptr<float>() : nullptr;
  dispatch_low_precision(logits.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* x = typed_ptr<T>(logits);
    at::parallel_for(0, rows, grain_rows(vocab), [&](int64_t b, int64_t e) {
      if (with_entropy) {
        run_partials<T, true>(isa, x, tg, b, e, vocab, vocab_start, inv_t, m, s, zt, w);
      } else {
        run_partials<T, false>(isa, x, tg, b, e, vocab, vocab_start, inv_t, m, s, zt, w);
      }
    });
  });
  return {row_max, sum_exp, target_z, ent_w};
}

at::Tensor logprob_grad_cpu(const at::Tensor& logits, const at::Tensor& targets,
                            int64_t vocab_start, double inv_temperature,
                            const at::Tensor& row_max, const at::Tensor& shifted_lse,
                            const at::Tensor& grad_coef,
                            const std::optional<at::Tensor>& entropy_grad,
                            const std::optional<at::Tensor>& entropy) {
  check_common(logits, targets, vocab_start, inv_temperature);
  check_grad_args(logits, row_max, shifted_lse, grad_coef, entropy_grad, entropy);
  TORCH_CHECK(logits.device().is_cpu(), "logprob_grad_cpu needs CPU tensors");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  at::Tensor grad = at::empty_like(logits);
  const int64_t* tg = targets.data_ptr<int64_t>();
  const bool with_entropy = entropy_grad.has_value();
  const Isa isa = g_isa;

  if (logits.scalar_type() == at::kDouble) {
    at::parallel_for(0, rows, grain_rows(vocab), [&](int64_t b, int64_t e) {
      grad_rows_f64(logits.data_ptr<double>(), tg, b, e, vocab, vocab_start, inv_temperature,
                    row_max.data_ptr<double>(), shifted_lse.data_ptr<double>(),
                    grad_coef.data_ptr<double>(),
                    with_entropy ? entropy_grad->data_ptr<double>() : nullptr,
                    with_entropy ? entropy->data_ptr<double>() : nullptr, grad.data_ptr<double>());
    });
    return grad;
  }
  const float inv_t = static_cast<float>(inv_temperature);
  const float* m = row_max.data_ptr<float>();
  const float* ls = shifted_lse.data_ptr<float>();
  const float* a = grad_coef.data_ptr<float>();
  const float* eg = with_entropy ? entropy_grad->data_ptr<float>() : nullptr;
  const float* h = with_entropy ? entropy->data_ptr<float>() : nullptr;
  dispatch_low_precision(logits.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* x = typed_ptr<T>(logits);
    T* g = typed_mut_ptr<T>(grad);
    at::parallel_for(0, rows, grain_rows(vocab), [&](int64_t b, int64_t e) {
      if (with_entropy) {
        run_grad<T, true>(isa, x, tg, b, e, vocab, vocab_start, inv_t, m, ls, a, eg, h, g);
      } else {
        run_grad<T, false>(isa, x, tg, b, e, vocab, vocab_start, inv_t, m, ls, a, eg, h, g);
      }
    });
  });
  return grad;
}

ExactPartials exact_kl_partials_cpu(const at::Tensor& logits, const at::Tensor& ref_logits) {
  check_exact_inputs(logits, ref_logits);
  TORCH_CHECK(logits.device().is_cpu(), "exact_kl_partials_cpu needs CPU tensors");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const bool f64 = logits.scalar_type() == at::kDouble;
  const auto opts = logits.options().dtype(f64 ? at::kDouble : at::kFloat);
  at::Tensor max_p = at::empty({rows}, opts), sum_p = at::empty({rows}, opts);
  at::Tensor max_q = at::empty({rows}, opts), sum_q = at::empty({rows}, opts);
  at::Tensor w = at::empty({rows}, opts);
  // two rows per logit: half the grain of the log-prob kernels
  const int64_t grain = std::max<int64_t>(1, grain_rows(vocab) / 2);
  if (f64) {
    at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
      exact_partials_rows_f64(logits.data_ptr<double>(), ref_logits.data_ptr<double>(), b, e,
                              vocab, max_p.data_ptr<double>(), sum_p.data_ptr<double>(),
                              max_q.data_ptr<double>(), sum_q.data_ptr<double>(),
                              w.data_ptr<double>());
    });
    return {max_p, sum_p, max_q, sum_q, w};
  }
  const Isa isa = g_isa;
  float* mp = max_p.data_ptr<float>();
  float* sp = sum_p.data_ptr<float>();
  float* mq = max_q.data_ptr<float>();
  float* sq = sum_q.data_ptr<float>();
  float* wp = w.data_ptr<float>();
  dispatch_low_precision(logits.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* x = typed_ptr<T>(logits);
    const T* y = typed_ptr<T>(ref_logits);
    at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
      run_exact_partials<T>(isa, x, y, b, e, vocab, mp, sp, mq, sq, wp);
    });
  });
  return {max_p, sum_p, max_q, sum_q, w};
}

at::Tensor exact_kl_grad_cpu(const at::Tensor& logits, const at::Tensor& ref_logits,
                             const at::Tensor& max_p, const at::Tensor& lse_p,
                             const at::Tensor& max_q, const at::Tensor& lse_q,
                             const at::Tensor& kl, const at::Tensor& grad_kl,
                             const std::optional<at::Tensor>& accumulate_into) {
  check_exact_inputs(logits, ref_logits);
  check_exact_grad_args(logits, max_p, lse_p, max_q, lse_q, kl, grad_kl, accumulate_into);
  TORCH_CHECK(logits.device().is_cpu(), "exact_kl_grad_cpu needs CPU tensors");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const bool accumulate = accumulate_into.has_value();
  at::Tensor grad = accumulate ? *accumulate_into : at::empty_like(logits);
  const int64_t grain = std::max<int64_t>(1, grain_rows(vocab) / 2);
  if (logits.scalar_type() == at::kDouble) {
    at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
      exact_grad_rows_f64(logits.data_ptr<double>(), ref_logits.data_ptr<double>(), b, e, vocab,
                          max_p.data_ptr<double>(), lse_p.data_ptr<double>(),
                          max_q.data_ptr<double>(), lse_q.data_ptr<double>(),
                          kl.data_ptr<double>(), grad_kl.data_ptr<double>(),
                          grad.data_ptr<double>(), accumulate);
    });
    return grad;
  }
  const Isa isa = g_isa;
  const float* mp = max_p.data_ptr<float>();
  const float* lp = lse_p.data_ptr<float>();
  const float* mq = max_q.data_ptr<float>();
  const float* lq = lse_q.data_ptr<float>();
  const float* k = kl.data_ptr<float>();
  const float* gk = grad_kl.data_ptr<float>();
  dispatch_low_precision(logits.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* x = typed_ptr<T>(logits);
    const T* y = typed_ptr<T>(ref_logits);
    T* g = typed_mut_ptr<T>(grad);
    at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
      if (accumulate) {
        run_exact_grad<T, true>(isa, x, y, b, e, vocab, mp, lp, mq, lq, k, gk, g);
      } else {
        run_exact_grad<T, false>(isa, x, y, b, e, vocab, mp, lp, mq, lq, k, gk, g);
      }
    });
  });
  return grad;
}

}  // namespace megatron_rl
