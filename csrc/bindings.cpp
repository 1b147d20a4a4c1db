// Python bindings of megatron_rl._C: the fused token log-prob kernels.
// The CUDA entry points exist only in builds with WITH_CUDA (CUDA torch + nvcc); the Python
// side detects them with hasattr (megatron_rl/ops/logprob_kl.py: extension_backends).
#include <torch/extension.h>

#include "logprob_kl.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megatron-rl kernels: fused vocab-parallel token log-prob / KL, exact KL "
            "(see csrc/logprob_kl.h)";
  m.def("logprob_partials_cpu", &megatron_rl::logprob_partials_cpu,
        "Per-rank forward partials (row_max, sum_exp, target_z, ent_w) on CPU",
        py::arg("logits"), py::arg("targets"), py::arg("vocab_start"), py::arg("inv_temperature"),
        py::arg("with_entropy"));
  m.def("logprob_grad_cpu", &megatron_rl::logprob_grad_cpu, "grad_logits on CPU",
        py::arg("logits"), py::arg("targets"), py::arg("vocab_start"), py::arg("inv_temperature"),
        py::arg("row_max"), py::arg("shifted_lse"), py::arg("grad_coef"), py::arg("entropy_grad"),
        py::arg("entropy"));
  m.def("exact_kl_partials_cpu", &megatron_rl::exact_kl_partials_cpu,
        "Exact-KL forward partials (max_p, sum_p, max_q, sum_q, w) on CPU", py::arg("logits"),
        py::arg("ref_logits"));
  m.def("exact_kl_grad_cpu", &megatron_rl::exact_kl_grad_cpu,
        "Exact-KL grad w.r.t. the policy logits on CPU (or added into accumulate_into)",
        py::arg("logits"), py::arg("ref_logits"), py::arg("max_p"), py::arg("lse_p"),
        py::arg("max_q"), py::arg("lse_q"), py::arg("kl"), py::arg("grad_kl"),
        py::arg("accumulate_into"));
  m.def("cpu_isa", &megatron_rl::cpu_isa, "x86 variant used by the CPU kernels");
  m.def("set_cpu_isa", &megatron_rl::set_cpu_isa, "force the CPU kernel variant (testing)");
#ifdef WITH_CUDA
  m.def("logprob_partials_cuda", &megatron_rl::logprob_partials_cuda,
        "Per-rank forward partials (row_max, sum_exp, target_z, ent_w) on CUDA",
        py::arg("logits"), py::arg("targets"), py::arg("vocab_start"), py::arg("inv_temperature"),
        py::arg("with_entropy"));
  m.def("logprob_grad_cuda", &megatron_rl::logprob_grad_cuda, "grad_logits on CUDA",
        py::arg("logits"), py::arg("targets"), py::arg("vocab_start"), py::arg("inv_temperature"),
        py::arg("row_max"), py::arg("shifted_lse"), py::arg("grad_coef"), py::arg("entropy_grad"),
        py::arg("entropy"));
  m.def("exact_kl_partials_cuda", &megatron_rl::exact_kl_partials_cuda,
        "Exact-KL forward partials (max_p, sum_p, max_q, sum_q, w) on CUDA", py::arg("logits"),
        py::arg("ref_logits"));
  m.def("exact_kl_grad_cuda", &megatron_rl::exact_kl_grad_cuda,
        "Exact-KL grad w.r.t. the policy logits on CUDA (or added into accumulate_into)",
        py::arg("logits"), py::arg("ref_logits"), py::arg("max_p"), py::arg("lse_p"),
        py::arg("max_q"), py::arg("lse_q"), py::arg("kl"), py::arg("grad_kl"),
        py::arg("accumulate_into"));
#endif
}
