"""A Policy's weights in and out: loading a full (megatron-named) or HF state dict into this
rank's shard, and gathering the full state dict (or gradients) from every rank's shard.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_rl.models import hf_mapping

if TYPE_CHECKING:
    from megatron_rl.models.policy import Policy


# -- loading ----------------------------------------------------------------------------------

def load_full_state_dict(policy: Policy, full: dict[str, torch.Tensor],
                         source: str = "state dict") -> None:
    """Load a megatron state dict (global names, see hf_mapping) into this rank: the full model,
    or at least what this rank's pipeline stage holds (hf_mapping.stage_names)."""
    args = policy.args
    expected = hf_mapping.expected_shapes(args)
    wanted = hf_mapping.stage_names(expected, args, policy.pp_size, policy.pp_rank)
    hf_mapping.check_state_dict(full, {n: s for n, s in expected.items() if n in wanted}, source)
    local = hf_mapping.shard_for_rank(full, args, tp_size=policy.tp_size, tp_rank=policy.tp_rank,
                                      pp_size=policy.pp_size, pp_rank=policy.pp_rank,
                                      ep_size=policy.ep_size, ep_rank=policy.ep_rank)
    own = policy.module.state_dict()
    if any(k.endswith("layer_norm_weight") for k in own):
        local = hf_mapping.to_te_names(local)
    with torch.no_grad():
        for name, t in own.items():
            if t is None or name.endswith("_extra_state"):
                continue
            if name not in local:
                raise ValueError(f"state dict has no tensor for parameter {name!r}")
            if tuple(local[name].shape) != tuple(t.shape):
                raise ValueError(f"tensor {name!r}: expected shape {list(t.shape)}, "
                                 f"found {list(local[name].shape)}")
            t.copy_(local[name])
    if policy.optimizer is not None:
        # fp16/bf16 training keeps fp32 main params: refresh them from the model.
        reload = getattr(policy.optimizer, "reload_model_params", None)
        if reload is not None:
            reload()


def load_hf(policy: Policy, path: str) -> None:
    """Load a HF safetensors checkpoint directory: this rank reads only the tensors of its
    pipeline stage (memory-mapped; the ranks of a node share the page cache)."""
    args = policy.args
    names = hf_mapping.stage_names(hf_mapping.hf_expected_shapes(args), args, policy.pp_size,
                                   policy.pp_rank)
    hf = hf_mapping.load_hf_state_dict(path, names)
    load_full_state_dict(policy, hf_mapping.hf_to_megatron(hf, args, source=path,
                                                           pp_size=policy.pp_size,
                                                           pp_rank=policy.pp_rank), source=path)


# -- this rank's shard ------------------------------------------------------------------------

def local_state_dict(policy: Policy) -> dict[str, torch.Tensor]:
    """This rank's parameters (and buffers) under local names, detached, where they live."""
    return {k: v.detach() for k, v in policy.module.state_dict().items()
            if v is not None and not k.endswith("_extra_state")}


def local_grads(policy: Policy) -> dict[str, torch.Tensor]:
    """This rank's gradients after forward_backward (DDP's DP-reduced fp32 main grads; zeros
    for a parameter without one), under the parameters' local names."""
    local = {}
    for name, p in policy.module.named_parameters():
        g = getattr(p, "main_grad", None)
        g = p.grad if g is None else g
        local[name] = (torch.zeros_like(p) if g is None else g).detach().float()
    return local


def gather(policy: Policy, local: dict[str, torch.Tensor], dst: int | None
           ) -> dict[str, torch.Tensor] | None:
    """The full megatron state dict (global names, host tensors) of every rank's `local` tensors
    (local-spec or TE names) of `policy`'s layout: on global rank `dst` (None elsewhere), or on
    every rank when dst is None. Collective over the world.

    TP shards are all-gathered on the device (NCCL on GPUs), then copied to the host;
    expert-parallel ranks exchange their experts, and pipeline stages everything, as host
    tensors in objects."""
    from megatron.core import parallel_state as ps

    tp_size, pp_size, ep_size = policy.tp_size, policy.pp_size, policy.ep_size
    local = hf_mapping.from_te_names(local)
    names = sorted(local)
    gathered = {}
    for name in names:
        if tp_size == 1:
            gathered[name] = [local[name]]
        else:
            parts = [torch.empty_like(local[name]) for _ in range(tp_size)]
            dist.all_gather(parts, local[name].contiguous(), group=policy.tp_group)
            gathered[name] = parts
        # at TP1 a copy also on CPU: the caller must not hold the live parameters (the
        # all-gathered parts of TP > 1 are fresh tensors already)
        gathered[name] = [t.to("cpu", copy=tp_size == 1) for t in gathered[name]]
    shards = {(r, policy.pp_rank): {n: gathered[n][r] for n in names} for r in range(tp_size)}
    if ep_size > 1:
        # every EP rank holds the same non-expert tensors: send only the experts
        shards = {(*k, policy.ep_rank): ({n: t for n, t in v.items()
                                          if hf_mapping.is_expert_param(n)}
                                         if policy.ep_rank else v) for k, v in shards.items()}
        objs = [None] * ep_size
        dist.all_gather_object(objs, shards, group=ps.get_expert_model_parallel_group())
        shards = {k: v for o in objs for k, v in o.items()}
    if pp_size > 1:
        objs = [None] * pp_size
        dist.all_gather_object(objs, shards, group=ps.get_pipeline_model_parallel_group())
        shards = {k: v for o in objs for k, v in o.items()}
    full = hf_mapping.gather_shards(shards, policy.args, tp_size, pp_size, ep_size)
    if dst is None or dist.get_rank() == dst:
        return full
    return None
