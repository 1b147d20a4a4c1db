// Python bindings of megatron_rl._C: the fused token log-prob kernels.
// The CUDA entry points exist only in builds with WITH_CUDA (CUDA torch + nvcc); the Python
// side detects them with hasattr (megatron_rl/ops/logprob_kl.py: extension_backends).
#include <torch/extension.h>

#include "logprob_kl.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megatron-rl kernels: fused vocab-parallel token log-prob / KL (see csrc/logprob_kl.h)";
  m.def("logprob_partials_cpu", &megatron_rl::logprob_partials_cpu,
        "Per-rank forward partials (row_max, sum_exp, target_z, ent_w) on CPU",
        py::arg("logits"), py::arg("targets"), py::arg("vocab_start"), py::arg("inv_temperature"),
        py::arg("with_entropy"));
  m.def("logprob_grad_cpu", &megatron_rl::logprob_grad_cpu, "grad_logits on CPU",
        py::arg("logits"), py::arg("targets"), py::arg("vocab_start"), py::arg("inv_temperature"),
        py::arg("row_max"), py::arg("shifted_lse"), py::arg("grad_coef"), py::arg("entropy_grad"),
        py::arg("entropy"));
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
#endif
}
