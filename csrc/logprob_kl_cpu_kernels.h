// Row kernels of the fused token log-prob op for one x86 instruction-set variant.
//
// No include guard on purpose: logprob_kl_cpu.cpp includes this file once per variant, inside
// `#pragma GCC target(...)` regions, with MRL_ISA naming the namespace (default = baseline
// x86-64 / SSE2; avx2 = AVX2 + FMA + F16C) and MRL_VEC_BYTES the native vector width (16 or
// 32: GCC scalarizes selects on vectors wider than the target's registers). The kernels use
// GCC vector extensions, so each variant compiles to its own instruction set without
// intrinsics (except F16C conversions), and dispatch happens once at runtime (see
// logprob_kl_cpu.cpp). No torch headers here: raw pointers only.
//
// Math (per row i, z = logits * inv_t, see megatron_rl/ops/reference.py for the contract):
//   forward  : row_max = max z, sum_exp = sum exp(z - row_max), ent_w = sum exp(z-m)(z-m),
//              computed online over L1-sized blocks: the row is read from memory once.
//   backward : log p = (z - row_max) - shifted_lse, g = -p * (a + b * (log p + H)) * inv_t,
//              plus a * inv_t at the target; one read of the logits and one write of grad
//              (the target's vector is recomputed once more to add the one-hot term in fp32).
// Sums of a block use kW-lane fp32 accumulators; block totals are added into a double per row.
// Non-finite logits (as in every backend, see reference.py): -inf is a masked entry (adds 0 to
// every sum, 0 log 0 = 0, zero gradient), NaN makes the row's statistics NaN. Sums are relative
// to the safe max (the max, or 0 while it is -inf), so -inf - (-inf) never appears.

namespace megatron_rl {
namespace MRL_ISA {

typedef float vf __attribute__((vector_size(MRL_VEC_BYTES)));
typedef int32_t vi __attribute__((vector_size(MRL_VEC_BYTES)));
typedef uint32_t vu __attribute__((vector_size(MRL_VEC_BYTES)));
typedef uint16_t vu16 __attribute__((vector_size(MRL_VEC_BYTES / 2)));

constexpr int kW = MRL_VEC_BYTES / 4;  // fp32 lanes per vector
constexpr int64_t kBlock = 2048;  // floats per block: 8 KiB, stays in L1 between passes

static inline vf splat(float x) { return vf{} + x; }

static inline float safe_max(float m) { return m == -INFINITY ? 0.0f : m; }

static inline float hmax(vf v) {
  float m = v[0];
  for (int l = 1; l < kW; ++l) m = v[l] > m ? v[l] : m;
  return m;
}

static inline double hsum(vf v) {
  double s = 0.0;
  for (int l = 0; l < kW; ++l) s += v[l];
  return s;
}

// exp(x) for x <= ~0 (all our uses: z - max, log p). Cody-Waite reduction x = k ln2 + r,
// |r| <= ln2/2, degree-7 Taylor polynomial (truncation < 5e-9 relative), scale by 2^k through
// the exponent bits. x < -87 returns 0 (below FLT_MIN; irrelevant next to a sum >= 1);
// -inf gives 0 and NaN propagates. `vexp_core` leaves out that last select; `vexp_times`
// multiplies in a factor that counts only where exp(x) is not 0: a masked or underflowed entry
// adds 0 whatever its factor (-inf, +inf, or NaN from -inf - (-inf)).
static inline vf vexp_core(vf x) {
  vf xc = x < -87.0f ? splat(-87.0f) : x;
  xc = xc > 88.0f ? splat(88.0f) : xc;
  // Adding 1.5 * 2^23 rounds x / ln2 to an integer k held in the low mantissa bits of t, so k
  // is available both as a float (t - 1.5 * 2^23) and, by integer subtraction of the bit
  // patterns, as an int32 (no float->int conversion, which baseline SSE2 vectorizes poorly).
  const float kRound = 12582912.0f;
  const vf t = xc * 1.44269504088896341f + kRound;
  const vf k = t - kRound;
  vf r = xc - k * 0.693359375f;      // ln2 high part (exact in few bits)
  r = r - k * -2.12194440e-4f;       // ln2 low part
  vf p = splat(1.0f / 5040.0f);
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const vi ki = (vi)t - (vi)splat(kRound);
  const vf scale = (vf)((ki + 127) << 23);
  return p * scale;
}

static inline vf vexp(vf x) { return x < -87.0f ? vf{} : vexp_core(x); }

static inline vf vexp_times(vf x, vf f) { return x < -87.0f ? vf{} : vexp_core(x) * f; }

// e = exp(x) and exp(x) * f, sharing one exp; where exp(x) is 0 the product is 0. kKeepInf:
// f = +inf stays +inf there (the exact KL's policy entry where the reference is masked: the KL
// is +inf however small p).
template <bool kKeepInf = false>
static inline vf vexp_and_times(vf x, vf f, vf& times) {
  const vi underflow = x < -87.0f;
  const vf y = vexp_core(x);
  if (kKeepInf) {
    const vf inf = splat(INFINITY);
    times = underflow ? (f == inf ? inf : vf{}) : y * f;
  } else {
    times = underflow ? vf{} : y * f;
  }
  return underflow ? vf{} : y;
}

// ---- loads / stores of kW elements, and scalar conversions for row tails -------------------
// Element types: float, uint16_t holding bf16 bits, _Float16.
static inline vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
static inline vf vload(const uint16_t* p) {
  vu16 h;
  std::memcpy(&h, p, sizeof(h));
  return (vf)(__builtin_convertvector(h, vu) << 16);
}
static inline vf vload(const _Float16* p) {
#ifdef MRL_HAVE_F16C
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  vf v;
  for (int l = 0; l < kW; ++l) v[l] = static_cast<float>(p[l]);
  return v;
#endif
}

static inline void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }
static inline void vstore(uint16_t* p, vf v) {
  // Round to nearest even; NaN stays a (quiet) NaN.
  const vu u = (vu)v;
  vu r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  r = (v != v) ? vu{} + 0x7FC0u : r;
  const vu16 h = __builtin_convertvector(r, vu16);
  std::memcpy(p, &h, sizeof(h));
}
static inline void vstore(_Float16* p, vf v) {
#ifdef MRL_HAVE_F16C
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph((__m256)v, _MM_FROUND_TO_NEAREST_INT));
#else
  for (int l = 0; l < kW; ++l) p[l] = static_cast<_Float16>(v[l]);
#endif
}

static inline float to_float(float v) { return v; }
static inline float to_float(uint16_t v) {
  const uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
static inline float to_float(_Float16 v) { return static_cast<float>(v); }

template <typename T>
static inline void load_partial(const T* p, int64_t n, float* out, float pad) {
  alignas(32) T tmp[kW] = {};
  for (int64_t l = 0; l < n; ++l) tmp[l] = p[l];
  vstore(out, vload(tmp));
  for (int64_t l = n; l < kW; ++l) out[l] = pad;
}
template <typename T>
static inline void store_partial(T* p, int64_t n, const float* in) {
  alignas(32) T tmp[kW];
  vstore(tmp, vload(in));
  for (int64_t l = 0; l < n; ++l) p[l] = tmp[l];
}

// buf[0, n) = x[0, n) * inv_t in fp32; buf[n, round_up(n, 2 kW)) = pad. Returns padded length.
template <typename T>
static inline int64_t load_block(const T* x, int64_t n, float inv_t, float* buf, float pad) {
  const vf vinv = splat(inv_t);
  int64_t j = 0;
  for (; j + kW <= n; j += kW) vstore(buf + j, vload(x + j) * vinv);
  if (j < n) {
    load_partial(x + j, n - j, buf + j, 0.0f);
    vstore(buf + j, vload(buf + j) * vinv);
    for (int64_t l = n - j; l < kW; ++l) buf[j + l] = pad;
    j += kW;
  }
  const int64_t padded = (n + 2 * kW - 1) / (2 * kW) * (2 * kW);
  for (; j < padded; ++j) buf[j] = pad;
  return padded;
}

// ---- forward partials ----------------------------------------------------------------------
template <typename T, bool kEntropy>
void partials_rows(const T* logits, const int64_t* targets, int64_t row_begin, int64_t row_end,
                   int64_t vocab, int64_t vocab_start, float inv_t, float* row_max,
                   float* sum_exp, float* target_z, float* ent_w) {
  alignas(32) float buf[kBlock + 2 * kW];
  for (int64_t i = row_begin; i < row_end; ++i) {
    const T* x = logits + i * vocab;
    float m = -INFINITY;
    double s = 0.0, w = 0.0;
    for (int64_t j0 = 0; j0 < vocab; j0 += kBlock) {
      const int64_t n = std::min(kBlock, vocab - j0);
      const int64_t padded = load_block(x + j0, n, inv_t, buf, -INFINITY);
      vf mx0 = splat(-INFINITY), mx1 = mx0;
      for (int64_t j = 0; j < padded; j += 2 * kW) {
        const vf a = vload(buf + j), b = vload(buf + j + kW);
        mx0 = a > mx0 ? a : mx0;
        mx1 = b > mx1 ? b : mx1;
      }
      const float bm = hmax(mx0 > mx1 ? mx0 : mx1);
      if (bm > m) {  // online softmax: move the running sums to the new max
        if (s != 0.0) {  // (a NaN sum is moved and stays NaN)
          const double delta = static_cast<double>(safe_max(m)) - safe_max(bm);
          const double c = std::exp(delta);
          if (kEntropy) w = c * (w + delta * s);
          s *= c;
        }
        m = bm;
      }
      // Padding contributes exp(-1000) = 0, so 0 to both sums.
      const float ms = safe_max(m);
      for (int64_t j = n; j < padded; ++j) buf[j] = ms - 1000.0f;
      const vf vm = splat(ms);
      vf s0 = vf{}, s1 = vf{}, w0 = vf{}, w1 = vf{};
      for (int64_t j = 0; j < padded; j += 2 * kW) {
        const vf d0 = vload(buf + j) - vm, d1 = vload(buf + j + kW) - vm;
        if (kEntropy) {
          vf ed0, ed1;
          s0 += vexp_and_times(d0, d0, ed0);
          s1 += vexp_and_times(d1, d1, ed1);
          w0 += ed0;
          w1 += ed1;
        } else {
          s0 += vexp(d0);
          s1 += vexp(d1);
        }
      }
      s += hsum(s0 + s1);
      if (kEntropy) w += hsum(w0 + w1);
    }
    row_max[i] = m;
    sum_exp[i] = static_cast<float>(s);
    if (kEntropy) ent_w[i] = static_cast<float>(w);
    const int64_t t = targets[i] - vocab_start;
    if (t >= 0 && t < vocab) {
      target_z[i] = to_float(x[t]) * inv_t;  // exact conversion, same product as the vector path
    } else {
      target_z[i] = 0.0f;
    }
  }
}

// ---- backward ------------------------------------------------------------------------------
template <typename T, bool kEntropy>
void grad_rows(const T* logits, const int64_t* targets, int64_t row_begin, int64_t row_end,
               int64_t vocab, int64_t vocab_start, float inv_t, const float* row_max,
               const float* shifted_lse, const float* grad_coef, const float* entropy_grad,
               const float* entropy, T* grad) {
  alignas(32) float buf[kW];
  for (int64_t i = row_begin; i < row_end; ++i) {
    const T* x = logits + i * vocab;
    T* g = grad + i * vocab;
    const float a = grad_coef[i];
    const vf vm = splat(row_max[i]), vls = splat(shifted_lse[i]);
    const vf va = splat(a), vinv = splat(inv_t);
    const vf vb = splat(kEntropy ? entropy_grad[i] : 0.0f);
    const vf vh = splat(kEntropy ? entropy[i] : 0.0f);
    const int64_t t = targets[i] - vocab_start;
    auto grad_of = [&](vf z) {
      const vf logp = (z - vm) - vls;
      const vf coef = kEntropy ? va + vb * (logp + vh) : va;
      return -vexp_times(logp, coef) * vinv;  // p = 0: no gradient
    };
    // Full vectors straight from logits to grad, in registers.
    const int64_t num_full = vocab / kW * kW;
    for (int64_t j = 0; j < num_full; j += kW) vstore(g + j, grad_of(vload(x + j) * vinv));
    // The row tail through a small fp32 buffer.
    if (num_full < vocab) {
      const int64_t n = vocab - num_full;
      load_partial(x + num_full, n, buf, 0.0f);
      vstore(buf, grad_of(vload(buf) * vinv));
      store_partial(g + num_full, n, buf);
    }
    // The one-hot term: re-round the target's gradient with a * inv_t added in fp32.
    if (t >= 0 && t < vocab) {
      const int64_t j = t / kW * kW;
      const int64_t n = std::min<int64_t>(kW, vocab - j);
      load_partial(x + j, n, buf, 0.0f);
      vstore(buf, grad_of(vload(buf) * vinv));
      buf[t - j] += a * inv_t;
      store_partial(g + j, n, buf);
    }
  }
}

// ---- exact per-position KL(p || q) from both logits rows (the "exact" estimator) ----------
// forward : max_p, sum_p = sum e^(z - max_p), max_q, sum_q = sum e^(r - max_q) and
//           w = sum e^(z - max_p) ((z - max_p) - (r - max_q)), online over L1-sized blocks of
//           both rows (each row read once). When a block raises a maximum, the running sums move
//           to it: with dp = m_p - m_p', dq = m_q - m_q' (<= 0), w' = e^dp (w + (dp - dq) s_p),
//           s_p' = e^dp s_p, s_q' = e^dq s_q.
// backward: log p = (z - max_p) - lse_p, log q = (r - max_q) - lse_q,
//           g = grad_kl * p * (log p - log q - kl); one read of each row, one write of grad.
//           kAccumulate: grad already holds a gradient (the log-prob op's), g is added to it in
//           fp32 and rounded once (one more read of grad; no second [N, V] buffer).
template <typename T>
void exact_partials_rows(const T* logits, const T* ref, int64_t row_begin, int64_t row_end,
                         int64_t vocab, float* max_p, float* sum_p, float* max_q, float* sum_q,
                         float* w_out) {
  alignas(32) float bz[kBlock + 2 * kW];
  alignas(32) float br[kBlock + 2 * kW];
  for (int64_t i = row_begin; i < row_end; ++i) {
    const T* x = logits + i * vocab;
    const T* y = ref + i * vocab;
    float mp = -INFINITY, mq = -INFINITY;
    double sp = 0.0, sq = 0.0, w = 0.0;
    for (int64_t j0 = 0; j0 < vocab; j0 += kBlock) {
      const int64_t n = std::min(kBlock, vocab - j0);
      const int64_t padded = load_block(x + j0, n, 1.0f, bz, -INFINITY);
      load_block(y + j0, n, 1.0f, br, -INFINITY);
      vf mz0 = splat(-INFINITY), mz1 = mz0, mr0 = mz0, mr1 = mz0;
      for (int64_t j = 0; j < padded; j += 2 * kW) {
        const vf a = vload(bz + j), b = vload(bz + j + kW);
        const vf c = vload(br + j), d = vload(br + j + kW);
        mz0 = a > mz0 ? a : mz0;
        mz1 = b > mz1 ? b : mz1;
        mr0 = c > mr0 ? c : mr0;
        mr1 = d > mr1 ? d : mr1;
      }
      const float bmp = hmax(mz0 > mz1 ? mz0 : mz1), bmq = hmax(mr0 > mr1 ? mr0 : mr1);
      if (bmp > mp || bmq > mq) {  // online: move the running sums to the new maxima
        const float nmp = bmp > mp ? bmp : mp, nmq = bmq > mq ? bmq : mq;
        const double dp = static_cast<double>(safe_max(mp)) - safe_max(nmp);
        const double dq = static_cast<double>(safe_max(mq)) - safe_max(nmq);
        if (sp != 0.0) {  // s_p and s_q move independently: masked policy entries leave s_p = 0
          const double cp = std::exp(dp);
          if (w != INFINITY) w = cp * (w + (dp - dq) * sp);  // +inf stays (cp may be 0)
          sp *= cp;
        }
        if (sq != 0.0) sq *= std::exp(dq);
        mp = nmp;
        mq = nmq;
      }
      // Padding: exp(-1000) = 0, so 0 to every sum.
      const float mps = safe_max(mp), mqs = safe_max(mq);
      for (int64_t j = n; j < padded; ++j) {
        bz[j] = mps - 1000.0f;
        br[j] = mqs - 1000.0f;
      }
      const vf vmp = splat(mps), vmq = splat(mqs);
      vf s0 = vf{}, s1 = vf{}, q0 = vf{}, q1 = vf{}, w0 = vf{}, w1 = vf{};
      for (int64_t j = 0; j < padded; j += 2 * kW) {
        const vf dz0 = vload(bz + j) - vmp, dz1 = vload(bz + j + kW) - vmp;
        const vf dr0 = vload(br + j) - vmq, dr1 = vload(br + j + kW) - vmq;
        vf wz0, wz1;  // p = 0 adds 0 to w, whatever q
        s0 += vexp_and_times<true>(dz0, dz0 - dr0, wz0);
        s1 += vexp_and_times<true>(dz1, dz1 - dr1, wz1);
        q0 += vexp(dr0);
        q1 += vexp(dr1);
        w0 += wz0;
        w1 += wz1;
      }
      sp += hsum(s0 + s1);
      sq += hsum(q0 + q1);
      w += hsum(w0 + w1);
    }
    max_p[i] = mp;
    sum_p[i] = static_cast<float>(sp);
    max_q[i] = mq;
    sum_q[i] = static_cast<float>(sq);
    w_out[i] = static_cast<float>(w);
  }
}

template <typename T, bool kAccumulate>
void exact_grad_rows(const T* logits, const T* ref, int64_t row_begin, int64_t row_end,
                     int64_t vocab, const float* max_p, const float* lse_p, const float* max_q,
                     const float* lse_q, const float* kl, const float* grad_kl, T* grad) {
  alignas(32) float bz[kW];
  alignas(32) float br[kW];
  alignas(32) float bg[kW];
  for (int64_t i = row_begin; i < row_end; ++i) {
    const T* x = logits + i * vocab;
    const T* y = ref + i * vocab;
    T* g = grad + i * vocab;
    const vf vmp = splat(max_p[i]), vlp = splat(lse_p[i]);
    const vf vmq = splat(max_q[i]), vlq = splat(lse_q[i]);
    const vf vkl = splat(kl[i]), vg = splat(grad_kl[i]);
    auto grad_of = [&](vf z, vf r) {
      const vf logp = (z - vmp) - vlp;
      const vf logq = (r - vmq) - vlq;
      return vg * vexp_times(logp, (logp - logq) - vkl);  // p = 0: no gradient
    };
    const int64_t num_full = vocab / kW * kW;
    for (int64_t j = 0; j < num_full; j += kW) {
      vf v = grad_of(vload(x + j), vload(y + j));
      if (kAccumulate) v += vload(g + j);
      vstore(g + j, v);
    }
    if (num_full < vocab) {
      const int64_t n = vocab - num_full;
      load_partial(x + num_full, n, bz, 0.0f);
      load_partial(y + num_full, n, br, 0.0f);
      vf v = grad_of(vload(bz), vload(br));
      if (kAccumulate) {
        load_partial(g + num_full, n, bg, 0.0f);
        v += vload(bg);
      }
      vstore(bz, v);
      store_partial(g + num_full, n, bz);
    }
  }
}

}  // namespace MRL_ISA
}  // namespace megatron_rl
