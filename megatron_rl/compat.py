"""Quarantined compatibility shims that let megatron-core run without CUDA (CPU + gloo).

Every patch here covers hard-coded CUDA use in megatron-core 0.16.1 (the pinned version) and is
applied only when CUDA is absent (`apply_cpu_compat()` is a no-op on GPU machines). Each entry
names the upstream file:line it covers, so that a version bump can re-check them one by one.
Two more apply on any machine: `apply_without_te_compat()` covers a name megatron-core leaves
undefined when TransformerEngine is absent, and `apply_rope_thd_compat()` replaces the unfused
RoPE of packed sequences by one that reads nothing back to the host (it synchronised with the
device four times per layer).

Mechanism: for modules that create tensors with `device="cuda"` literals or call
`torch.cuda.current_device()` / `torch.cuda.synchronize()`, the module-global name `torch` is
replaced by a thin proxy (`_CpuTorch`) that rewrites CUDA devices to CPU and makes the CUDA
synchronisation calls no-ops. Everything else is forwarded to the real torch module, so the
semantics of the patched code are unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import types

import torch

PINNED_MEGATRON_CORE = "0.16.1"

_applied = False


def _to_cpu_device(device):
    """Map 'cuda', 'cuda:N', torch.device('cuda') or an int device index to CPU."""
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cpu")
    if str(device).startswith("cuda"):
        return torch.device("cpu")
    return device


def _device_rewriting(fn):
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    wrapper.__name__ = getattr(fn, "__name__", "wrapper")
    return wrapper


class _CpuCuda(types.ModuleType):
    """Stand-in for `torch.cuda` inside patched modules: the current device is the CPU."""

    def __init__(self):
        super().__init__("torch.cuda")

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device():
        return torch.device("cpu")

    @staticmethod
    def synchronize(device=None):
        return None


class _CpuTorch(types.ModuleType):
    """Stand-in for the `torch` module inside patched megatron-core modules."""

    _FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "randn", "rand",
                  "zeros_like", "empty_like", "ones_like")

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CpuCuda()
        for name in self._FACTORIES:
            setattr(self, name, _device_rewriting(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


_CPU_TORCH = _CpuTorch()

# module -> the upstream lines (megatron-core 0.16.1) that the torch proxy covers there.
_PROXIED_MODULES = {
    # rotary_pos_embedding.py:162 moves inv_freq to torch.cuda.current_device().
    "megatron.core.models.common.embeddings.rotary_pos_embedding": "L162 current_device()",
    # param_and_grad_buffer.py:783/800/806 allocate grad/param buffers on current_device().
    "megatron.core.distributed.param_and_grad_buffer": "L783,800,806 current_device()",
    # state_dict_saver.py:252 broadcasts a failure flag created on current_device().
    "megatron.core.dist_checkpointing.strategies.state_dict_saver": "L252 current_device()",
    # p2p_communication.py:242/398 torch.cuda.synchronize(); :313/321 recv buffers on current_device().
    "megatron.core.pipeline_parallel.p2p_communication": "L242,313,321,398",
    # schedules.py:596/983/2138 total_num_tokens = torch.zeros(..., device="cuda").
    "megatron.core.pipeline_parallel.schedules": "L596,983,2138 device='cuda'",
    # optimizer.py:907 FP32Optimizer._scale on device='cuda'.
    "megatron.core.optimizer.optimizer": "L907 device='cuda'",
    # utils.py:1207 local multi_tensor_l2norm returns a tensor on device='cuda'.
    "megatron.core.utils": "L1207 device='cuda'",
    # clip_grads.py:90/103/115/174/207 norm and overflow buffers on device='cuda'.
    "megatron.core.optimizer.clip_grads": "L90,103,115,174,207 device='cuda'",
    # filesystem_async.py:230 torch.cuda.synchronize() before async writes.
    "megatron.core.dist_checkpointing.strategies.filesystem_async": "L230 synchronize()",
    # mappings.py:91/141/148/181/442 gather/scatter buffers on current_device() (TP collectives).
    "megatron.core.tensor_parallel.mappings": "L91,141,148,181,442 current_device()",
    # layers.py:552/597/607 sequence-parallel all-gather and wgrad buffers on current_device().
    "megatron.core.tensor_parallel.layers": "L552,597,607 current_device()",
    # tensor_parallel/utils.py:70/91 split/gather buffers; data.py:86 broadcast_data buffer.
    "megatron.core.tensor_parallel.utils": "L70,91 current_device()",
    "megatron.core.tensor_parallel.data": "L86 current_device()",
    # exchange_utils.py:104/110/326 checkpoint-load exchange buffers on device="cuda".
    "megatron.core.dist_checkpointing.exchange_utils": "L104,110,326 device='cuda'",
    # distrib_optimizer.py:791 (distributed optimizer) Adam state allocated on current_device().
    "megatron.core.optimizer.distrib_optimizer": "L791 current_device()",
    # router.py:90,92 gating() moves the router weight and bias to current_device() on every
    # forward; :169,178,192,198 expert-bias and global aux-loss buffers on current_device().
    "megatron.core.transformer.moe.router": "L90,92,169,178,192,198 current_device()",
    # moe_utils.py:998 the aux-loss logging tracker, force-initialised on device="cuda".
    "megatron.core.transformer.moe.moe_utils": "L998 device='cuda'",
}


def _clip_grad_by_total_norm_fp32_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """CPU version of clip_grads.clip_grad_by_total_norm_fp32.

    Covers clip_grads.py:167, which asserts `param.grad.type() == 'torch.cuda.FloatTensor'`.
    Same math: g <- g * max_norm / (total_norm + 1e-6) when that factor is < 1.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff >= 1.0:
        return
    for p in parameters:
        g = getattr(p, "decoupled_grad", None) if use_decoupled_grad else p.grad
        if g is not None:
            g.detach().mul_(clip_coeff)


@contextlib.contextmanager
def _tensor_cuda_is_identity():
    """Within the block, `Tensor.cuda()` returns the tensor itself (it stays on the CPU)."""
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


def _without_tensor_cuda(fn):
    """Wrap a megatron-core method so its `.cuda()` calls are no-ops while it runs."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _tensor_cuda_is_identity():
            return fn(*args, **kwargs)

    return wrapper


# (module, class, method) whose body calls Tensor.cuda(), wrapped with _without_tensor_cuda.
_TENSOR_CUDA_METHODS = [
    # language_module.py:244 `weight.data = weight.data.cuda()` when tying embeddings across PP.
    ("megatron.core.models.common.language_module.language_module", "LanguageModule",
     "setup_embeddings_and_output_layer"),
]

_CUDA_TYPE_NAMES = {"torch.FloatTensor": "torch.cuda.FloatTensor",
                    "torch.HalfTensor": "torch.cuda.HalfTensor",
                    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}


@contextlib.contextmanager
def _tensor_type_reports_cuda():
    """Within the block, `t.type()` (no argument) of a CPU float tensor names its CUDA
    counterpart ("torch.FloatTensor" -> "torch.cuda.FloatTensor"): megatron-core's optimizers
    dispatch on those strings to sort parameters into fp32 and fp16/bf16 groups. `t.type(dtype)`
    (a conversion) is untouched."""
    original = torch.Tensor.type

    def type_(self, *args, **kwargs):
        name = original(self, *args, **kwargs)
        if args or kwargs:
            return name
        return _CUDA_TYPE_NAMES.get(name, name)

    setattr(torch.Tensor, "type", type_)
    try:
        yield
    finally:
        setattr(torch.Tensor, "type", original)


def _with_cuda_type_names(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _tensor_type_reports_cuda():
            return fn(*args, **kwargs)

    return wrapper


# (module, class, method) that sort parameters by `param.type()` against CUDA tensor type names
# and raise TypeError for anything else; wrapped with _with_cuda_type_names.
_CUDA_TYPE_METHODS = [
    # optimizer.py:671/690/695 Float16OptimizerWithFloat16Params (bf16/fp16 + fp32 main params).
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params", "__init__"),
    # distrib_optimizer.py:361/420/431 (_build_model_and_main_param_groups, called from here)
    # and :582, DistributedOptimizer.
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer", "__init__"),
]


def _get_cuda_rng_state_cpu(device="cuda", clone=False, graph_safe=False):
    """CPU version of tensor_parallel/random.py:41 `_get_cuda_rng_state` (L55 calls
    torch.cuda.random.get_rng_state()): there is no CUDA generator to save. Activation
    recompute (`CheckpointFunction`, random.py:514) still saves and restores the CPU generator
    (`_get_all_rng_states`, random.py:444, reads torch.get_rng_state() as well)."""
    return None


def _set_cuda_rng_state_cpu(new_state, device=-1, graph_safe=False):
    """CPU version of tensor_parallel/random.py:72 `_set_cuda_rng_state`: nothing to restore."""
    return None


def _fork_without_cuda_states(fork, default_name):
    """CPU version of tensor_parallel/random.py:243 CudaRNGStatesTracker.fork, which raises
    (:247-248) for a state that `model_parallel_cuda_manual_seed` never added (it seeds CUDA
    generators). Without CUDA an empty placeholder is added and the upstream fork runs as is,
    with the CUDA get/set above as no-ops: the block draws from the CPU generator.
    megatron-core forks around dropout (the embedding under sequence parallelism,
    language_model_embedding.py:145); megatron_rl's models have dropout 0."""

    @functools.wraps(fork)
    def wrapper(self, name=default_name):
        self.states_.setdefault(name, None)
        return fork(self, name)

    return wrapper


def apply_without_te_compat() -> bool:
    """Define the name megatron-core's MoE router reads without TransformerEngine. Idempotent.

    moe_utils.py:1192,1225 (RouterGatingLinearFunction, the router's linear layer) test
    `te_general_gemm is not None`, but moe_utils.py:22-39 defines te_general_gemm only when TE
    imports: without TE every router forward raises NameError, on CPU and GPU alike. Setting it
    to None selects the torch.mm path written for that case. Returns True when patched.
    """
    from megatron.core.transformer.moe import moe_utils

    if getattr(moe_utils, "HAVE_TE", False) or hasattr(moe_utils, "te_general_gemm"):
        return False
    setattr(moe_utils, "te_general_gemm", None)
    return True


def _rope_thd_without_host_sync(upstream):
    """megatron-core's unfused RoPE of a packed (THD) row, rope_utils.py:178-251
    (`_apply_rotary_pos_emb_thd`), without reading cu_seqlens on the host.

    Upstream reads the segment lengths with `.tolist()` (rope_utils.py:204) and compares
    `freqs.size(0) == cu_seqlens[-1]` in an `if` (rope_utils.py:211): two host
    synchronisations for the query and two for the key, in every layer. Here each token's
    position within its segment comes from cu_seqlens on the device,

        segment(i) = max{j : cu[j] <= i},   position(i) = i - cu[segment(i)],

    (searchsorted), and freqs[position] is the table upstream concatenates slice by slice
    (rows 0..len-1 for every segment), so the rotation is the same arithmetic on the same
    values. Upstream's other case, a table exactly as long as the row (each token reads
    freqs[cu[j] + offset] = freqs[i]), is recognised by freqs.size(0) == t.size(0): the row
    length, which is cu_seqlens[-1] whenever upstream's split of t by the segment lengths
    succeeds. Context parallelism (each rank holds two chunks of every segment) keeps
    upstream's code. A segment longer than the table (max_seqlen below the longest segment),
    which upstream reports as a shape mismatch, is an index error here."""

    @functools.wraps(upstream)
    def apply(t, cu_seqlens, freqs, rotary_interleaved=False, multi_latent_attention=False,
              mscale=1.0, cp_group=None):
        if cp_group is None or cp_group.size() > 1:
            return upstream(t, cu_seqlens, freqs, rotary_interleaved=rotary_interleaved,
                            multi_latent_attention=multi_latent_attention, mscale=mscale,
                            cp_group=cp_group)
        from megatron.core.models.common.embeddings import rope_utils

        n = t.shape[0]
        if freqs.size(0) == n:  # absolute positions across the row
            freqs_packed = freqs
        else:
            token = torch.arange(n, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
            start = cu_seqlens[torch.searchsorted(cu_seqlens, token, right=True) - 1]
            freqs_packed = freqs[(token - start).long()]
        return rope_utils._apply_rotary_pos_emb_bshd(
            t.unsqueeze(1), freqs_packed, rotary_interleaved=rotary_interleaved,
            multi_latent_attention=multi_latent_attention, mscale=mscale).squeeze(1)

    setattr(apply, "upstream", upstream)  # what apply_rope_thd_compat recognises
    return apply


def apply_rope_thd_compat() -> bool:
    """Replace megatron-core's unfused THD RoPE by `_rope_thd_without_host_sync`, on any
    machine (the host synchronisations it removes cost most on a GPU). Idempotent; returns
    True when it patched. apply_rotary_pos_emb (rope_utils.py:303) looks the function up in its
    module at every call, so the module attribute is the one to replace."""
    from megatron.core.models.common.embeddings import rope_utils

    current = rope_utils._apply_rotary_pos_emb_thd
    if hasattr(current, "upstream"):
        return False
    rope_utils._apply_rotary_pos_emb_thd = _rope_thd_without_host_sync(current)
    return True


def apply_cpu_compat(force: bool = False) -> bool:
    """Patch megatron-core for CPU execution when CUDA is absent. Idempotent.

    Returns True when the patches are active.
    """
    global _applied
    if _applied:
        return True
    if torch.cuda.is_available() and not force:
        return False
    for name in _PROXIED_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:  # optional parts (e.g. inference) may not import everywhere
            continue
        setattr(mod, "torch", _CPU_TORCH)
    for mod_name, cls_name, method in _TENSOR_CUDA_METHODS:
        cls = getattr(importlib.import_module(mod_name), cls_name)
        setattr(cls, method, _without_tensor_cuda(getattr(cls, method)))
    for mod_name, cls_name, method in _CUDA_TYPE_METHODS:
        cls = getattr(importlib.import_module(mod_name), cls_name)
        setattr(cls, method, _with_cuda_type_names(getattr(cls, method)))
    from megatron.core.tensor_parallel import random as tp_random

    tp_random._get_cuda_rng_state = _get_cuda_rng_state_cpu
    tp_random._set_cuda_rng_state = _set_cuda_rng_state_cpu
    tracker = tp_random.CudaRNGStatesTracker
    tracker.fork = _fork_without_cuda_states(tracker.fork,
                                             tp_random._MODEL_PARALLEL_RNG_TRACKER_NAME)
    from megatron.core.optimizer import clip_grads, optimizer

    clip_grads.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32_cpu
    optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32_cpu
    _applied = True
    return True
