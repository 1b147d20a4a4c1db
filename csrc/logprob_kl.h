// Entry points of the fused token log-prob kernels (CPU: logprob_kl_cpu.cpp, CUDA:
// logprob_kl_cuda.cu), bound to Python in bindings.cpp as megatron_rl._C.
//
// Contract (identical for both devices; megatron_rl/ops/reference.py is the executable spec):
//   logits      [N, V_local] contiguous, float32 / bfloat16 / float16 (float64: CPU only);
//               this rank's vocab shard [vocab_start, vocab_start + V_local)
//   targets     [N] int64 contiguous, global token ids
//   statistics  [N] contiguous, float32 (float64 for float64 logits)
//   partials -> (row_max, sum_exp, target_z, ent_w)  with z = logits * inv_temperature;
//               target_z = 0 where the target is not in this shard; ent_w empty unless entropy
//   grad     -> grad_logits [N, V_local] in the logits dtype
//   non-finite logits: -inf masks an entry (probability 0, adds 0 to every sum, zero
//               gradient); NaN makes the row's statistics NaN; sums are relative to the safe
//               max (row_max, or 0 where row_max is -inf)
#pragma once

// at::Tensor alone, not <ATen/ATen.h>: nvcc parses this chain once per architecture
#include <ATen/core/Tensor.h>

#include <cmath>

#include <optional>
#include <string>
#include <tuple>

namespace megatron_rl {

using Partials = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

Partials logprob_partials_cpu(const at::Tensor& logits, const at::Tensor& targets,
                              int64_t vocab_start, double inv_temperature, bool with_entropy);

at::Tensor logprob_grad_cpu(const at::Tensor& logits, const at::Tensor& targets,
                            int64_t vocab_start, double inv_temperature,
                            const at::Tensor& row_max, const at::Tensor& shifted_lse,
                            const at::Tensor& grad_coef,
                            const std::optional<at::Tensor>& entropy_grad,
                            const std::optional<at::Tensor>& entropy);

// The exact per-position KL(softmax(logits) || softmax(ref_logits)) ("exact" KL estimator):
//   logits, ref_logits [N, V_local] contiguous, same dtype and device (this rank's vocab shard)
//   partials -> (max_p, sum_p, max_q, sum_q, w), each [N] float32 (float64 for float64 logits):
//               sum_p = sum e^(z - max_p), sum_q = sum e^(r - max_q),
//               w = sum e^(z - max_p) ((z - max_p) - (r - max_q))
//   grad     -> grad_kl * p * (log p - log q - kl) [N, V_local] in the logits dtype, with
//               log p = (z - max_p) - lse_p, log q = (r - max_q) - lse_q (global statistics);
//               with accumulate_into (a contiguous [N, V_local] tensor of the logits dtype, e.g.
//               the log-prob op's gradient) it is added there in place and returned
using ExactPartials = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

ExactPartials exact_kl_partials_cpu(const at::Tensor& logits, const at::Tensor& ref_logits);

at::Tensor exact_kl_grad_cpu(const at::Tensor& logits, const at::Tensor& ref_logits,
                             const at::Tensor& max_p, const at::Tensor& lse_p,
                             const at::Tensor& max_q, const at::Tensor& lse_q,
                             const at::Tensor& kl, const at::Tensor& grad_kl,
                             const std::optional<at::Tensor>& accumulate_into);

// Which x86 kernel variant the CPU entry points use: "avx2" (AVX2+FMA+F16C) or "default".
std::string cpu_isa();
void set_cpu_isa(const std::string& isa);

#ifdef WITH_CUDA
Partials logprob_partials_cuda(const at::Tensor& logits, const at::Tensor& targets,
                               int64_t vocab_start, double inv_temperature, bool with_entropy);

at::Tensor logprob_grad_cuda(const at::Tensor& logits, const at::Tensor& targets,
                             int64_t vocab_start, double inv_temperature,
                             const at::Tensor& row_max, const at::Tensor& shifted_lse,
                             const at::Tensor& grad_coef,
                             const std::optional<at::Tensor>& entropy_grad,
                             const std::optional<at::Tensor>& entropy);

ExactPartials exact_kl_partials_cuda(const at::Tensor& logits, const at::Tensor& ref_logits);

at::Tensor exact_kl_grad_cuda(const at::Tensor& logits, const at::Tensor& ref_logits,
                              const at::Tensor& max_p, const at::Tensor& lse_p,
                              const at::Tensor& max_q, const at::Tensor& lse_q,
                              const at::Tensor& kl, const at::Tensor& grad_kl,
                              const std::optional<at::Tensor>& accumulate_into);
#endif

// Shared argument checks (both devices). Throw c10::Error (RuntimeError in Python).
inline void check_common(const at::Tensor& logits, const at::Tensor& targets,
                         int64_t vocab_start, double inv_temperature) {
  TORCH_CHECK(logits.dim() == 2, "logits must be [N, V_local], got ", logits.sizes());
  TORCH_CHECK(logits.is_contiguous(), "logits must be contiguous");
  TORCH_CHECK(logits.size(1) > 0, "logits must have a non-empty vocab dim");
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == logits.size(0),
              "targets must be [N] with N = logits.size(0)");
  TORCH_CHECK(targets.scalar_type() == at::kLong, "targets must be int64");
  TORCH_CHECK(targets.is_contiguous(), "targets must be contiguous");
  TORCH_CHECK(targets.device() == logits.device(), "targets and logits on different devices");
  TORCH_CHECK(vocab_start >= 0, "vocab_start must be >= 0");
  TORCH_CHECK(inv_temperature > 0.0 && std::isfinite(inv_temperature),
              "inv_temperature must be finite and > 0");
}

inline void check_stat(const at::Tensor& stat, const at::Tensor& logits, const char* name) {
  const auto acc = logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK(stat.dim() == 1 && stat.size(0) == logits.size(0), name, " must be [N]");
  TORCH_CHECK(stat.scalar_type() == acc, name, " must be ", acc, " for ", logits.scalar_type(),
              " logits");
  TORCH_CHECK(stat.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(stat.device() == logits.device(), name, " and logits on different devices");
}

inline void check_grad_args(const at::Tensor& logits, const at::Tensor& row_max,
                            const at::Tensor& shifted_lse, const at::Tensor& grad_coef,
                            const std::optional<at::Tensor>& entropy_grad,
                            const std::optional<at::Tensor>& entropy) {
  check_stat(row_max, logits, "row_max");
  check_stat(shifted_lse, logits, "shifted_lse");
  check_stat(grad_coef, logits, "grad_coef");
  TORCH_CHECK(entropy_grad.has_value() == entropy.has_value(),
              "entropy_grad and entropy must be given together");
  if (entropy_grad.has_value()) {
    check_stat(*entropy_grad, logits, "entropy_grad");
    check_stat(*entropy, logits, "entropy");
  }
}

inline void check_exact_inputs(const at::Tensor& logits, const at::Tensor& ref_logits) {
  TORCH_CHECK(logits.dim() == 2, "logits must be [N, V_local], got ", logits.sizes());
  TORCH_CHECK(logits.is_contiguous() && ref_logits.is_contiguous(),
              "logits and ref_logits must be contiguous");
  TORCH_CHECK(logits.size(1) > 0, "logits must have a non-empty vocab dim");
  TORCH_CHECK(ref_logits.sizes() == logits.sizes(),
              "ref_logits must have the shape of logits, got ", ref_logits.sizes(), " and ",
              logits.sizes());
  TORCH_CHECK(ref_logits.scalar_type() == logits.scalar_type(),
              "ref_logits and logits must have the same dtype");
  TORCH_CHECK(ref_logits.device() == logits.device(), "ref_logits and logits on different devices");
}

inline void check_exact_grad_args(const at::Tensor& logits, const at::Tensor& max_p,
                                  const at::Tensor& lse_p, const at::Tensor& max_q,
                                  const at::Tensor& lse_q, const at::Tensor& kl,
                                  const at::Tensor& grad_kl,
                                  const std::optional<at::Tensor>& accumulate_into) {
  if (accumulate_into.has_value()) {
    const at::Tensor& acc = *accumulate_into;
    TORCH_CHECK(acc.sizes() == logits.sizes() && acc.scalar_type() == logits.scalar_type() &&
                    acc.device() == logits.device() && acc.is_contiguous(),
                "accumulate_into must be a contiguous tensor of the logits' shape, dtype and "
                "device");
  }
  check_stat(max_p, logits, "max_p");
  check_stat(lse_p, logits, "lse_p");
  check_stat(max_q, logits, "max_q");
  check_stat(lse_q, logits, "lse_q");
  check_stat(kl, logits, "kl");
  check_stat(grad_kl, logits, "grad_kl");
}

}  // namespace megatron_rl
