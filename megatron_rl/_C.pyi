"""Type stub of the compiled extension megatron_rl._C (csrc/bindings.cpp), for static checking:
the type checker cannot read a compiled module, and with this stub it checks the arity and
argument names of every kernel call in megatron_rl/ops. The `*_cuda` entry points exist only
in builds with CUDA (megatron_rl/ops/logprob_kl.py detects them with hasattr).
tests/ops/test_ext_stub.py checks the stub against the built extension's signatures.
"""
from typing import SupportsFloat, SupportsIndex, SupportsInt

from torch import Tensor

def logprob_partials_cpu(logits: Tensor, targets: Tensor, vocab_start: SupportsInt | SupportsIndex,
                         inv_temperature: SupportsFloat | SupportsIndex, with_entropy: bool
                         ) -> tuple[Tensor, Tensor, Tensor, Tensor]: ...
def logprob_grad_cpu(logits: Tensor, targets: Tensor, vocab_start: SupportsInt | SupportsIndex,
                     inv_temperature: SupportsFloat | SupportsIndex, row_max: Tensor,
                     shifted_lse: Tensor, grad_coef: Tensor, entropy_grad: Tensor | None,
                     entropy: Tensor | None) -> Tensor: ...
def exact_kl_partials_cpu(logits: Tensor, ref_logits: Tensor
                          ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]: ...
def exact_kl_grad_cpu(logits: Tensor, ref_logits: Tensor, max_p: Tensor, lse_p: Tensor,
                      max_q: Tensor, lse_q: Tensor, kl: Tensor, grad_kl: Tensor,
                      accumulate_into: Tensor | None) -> Tensor: ...
def cpu_isa() -> str: ...
def set_cpu_isa(arg0: str) -> None: ...

def logprob_partials_cuda(logits: Tensor, targets: Tensor, vocab_start: SupportsInt | SupportsIndex,
                          inv_temperature: SupportsFloat | SupportsIndex, with_entropy: bool
                          ) -> tuple[Tensor, Tensor, Tensor, Tensor]: ...
def logprob_grad_cuda(logits: Tensor, targets: Tensor, vocab_start: SupportsInt | SupportsIndex,
                      inv_temperature: SupportsFloat | SupportsIndex, row_max: Tensor,
                      shifted_lse: Tensor, grad_coef: Tensor, entropy_grad: Tensor | None,
                      entropy: Tensor | None) -> Tensor: ...
def exact_kl_partials_cuda(logits: Tensor, ref_logits: Tensor
                           ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]: ...
def exact_kl_grad_cuda(logits: Tensor, ref_logits: Tensor, max_p: Tensor, lse_p: Tensor,
                       max_q: Tensor, lse_q: Tensor, kl: Tensor, grad_kl: Tensor,
                       accumulate_into: Tensor | None) -> Tensor: ...
