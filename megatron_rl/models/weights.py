"""A Policy's weights in and out: loading a full (megatron-named) or HF state dict into this
rank's shard, and gathering the full state dict (or gradients) from every rank's shard to one
rank, for weight sync to a rollout engine, export and checks.

The gather (`gather`) moves tensors towards the rank `dst` that needs them, one at a time:

    TP      each tensor's TP shards are gathered (dist.gather) to one rank of the TP group, its
            `leader`, which merges them on its device
    PP, EP  the leaders of the other pipeline stages and expert-parallel ranks send each merged
            tensor point-to-point to dst (expert-parallel ranks > 0 only their experts)
    dst     copies each tensor to the host as it arrives

One model replica takes part (the ranks of dst's TP group, of its pipeline group's stages and of
their expert-parallel groups); the other data-parallel replicas hold the same weights and wait.
A rank other than dst holds nothing on the host (it sends from its device; on a CPU-only world
its own shard is its host copy) and at most one tensor's TP shards and their merge in flight.
dst holds the full state dict on the host (and, on a CPU-only world, one tensor in flight).
`dst=None` (every rank gets it): the full state dict is gathered to rank 0 and broadcast tensor
by tensor.

`gather_memory` computes the host bytes per rank of this gather and, for comparison, of an
all-gather design, in which every rank all-gathers the TP shards, then exchanges expert sets and
whole pipeline stages as pickled objects (all_gather_object) and merges everything (a lower
bound there: pickle's own transient copies are not counted). For Qwen2.5-7B in bf16 (28 layers,
hidden 3584, FFN 18944, 28 heads, 4 KV heads, vocabulary 152064, untied embeddings: 7.62e9
parameters, 15.23 GB), GB = 1e9 bytes of tensor payload:

    layout        all-gather: every rank        this gather: dst    every other rank
    TP1           30.46 GB                      15.23 GB            0
    TP8           30.46 GB                      15.23 GB            0
    TP2 x PP2     45.69 GB                      15.23 GB            0
    TP8 x PP2     45.70 GB                      15.23 GB            0
    TP4 x PP4     41.35 GB                      15.23 GB            0

At TP8 x PP2 (two nodes of 8 GPUs) the all-gather holds 8 x 45.7 = 366 GB of host memory on
each node; this gather 15.2 GB on dst's node and none on the other. In flight, a rank holds at
most the largest tensor's shards and their merge on its device (the 1.09 GB embedding, merged).
The table is in docs/rollout.md too; tests/unit/models/test_weights.py checks the arithmetic by
hand. Measured on two gloo ranks with a 184 MiB fp32 model (tests/distributed/
test_weight_gather.py): dst grew by 184 MiB at PP2 and 216 MiB at TP2 (a CPU-only world holds
the embedding's shards in flight on the host), the other rank by 0; the all-gather design grew
every rank by 368 MiB at TP2 (as counted) and 736 MiB at PP2 (counted: 552 MiB; the rest is
pickle's).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_rl.models import hf_mapping
from megatron_rl.models.config import ModelArgs

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


# -- who sends what to dst --------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Place:
    """A global rank's position in megatron's groups: its TP, PP and EP ranks and the global
    ranks of its TP, pipeline and expert-parallel groups."""

    rank: int
    tp_rank: int
    pp_rank: int
    ep_rank: int
    tp_group: tuple[int, ...]
    pp_group: tuple[int, ...]
    ep_group: tuple[int, ...]


def exchange_places() -> list[Place]:
    """Every global rank's Place, on every rank (collective over the world; a few integers per
    rank; a Policy's layout does not change, so it asks once)."""
    from megatron.core import parallel_state as ps

    def ranks(group) -> tuple[int, ...]:
        return tuple(dist.get_process_group_ranks(group))

    mine = Place(dist.get_rank(), ps.get_tensor_model_parallel_rank(),
                 ps.get_pipeline_model_parallel_rank(), ps.get_expert_model_parallel_rank(),
                 ranks(ps.get_tensor_model_parallel_group()),
                 ranks(ps.get_pipeline_model_parallel_group()),
                 ranks(ps.get_expert_model_parallel_group()))
    places: list = [None] * dist.get_world_size()
    dist.all_gather_object(places, mine)
    return places


@dataclasses.dataclass(frozen=True)
class GatherPlan:
    """The ranks that gather the full model to `dst`: one model replica, as (pipeline stage,
    expert-parallel rank) -> the `leader` that collects its TP group's shards. leaders: in
    (pp_rank, ep_rank) order, the order dst stores the tensors in; dst leads its own TP group.
    The replica: dst's pipeline group, each of its stages' expert-parallel group, and each of
    those ranks' TP group. my_leader: the leader of this rank's TP group, None when this rank
    is not in the replica."""

    dst: int
    leaders: tuple[Place, ...]
    my_leader: int | None

    @classmethod
    def build(cls, places: list[Place], dst: int, rank: int) -> GatherPlan:
        if not 0 <= dst < len(places):
            raise ValueError(f"dst {dst} is not a global rank (world size {len(places)})")
        by_rank = {p.rank: p for p in places}
        leaders = sorted({by_rank[e] for q in by_rank[dst].pp_group
                          for e in by_rank[q].ep_group}, key=lambda p: (p.pp_rank, p.ep_rank))
        coords = [(p.pp_rank, p.ep_rank) for p in leaders]
        assert len(set(coords)) == len(coords), f"two leaders of one (stage, EP rank): {coords}"
        my_leader = None
        for lead in leaders:
            members = [by_rank[r] for r in lead.tp_group]
            assert all((m.pp_rank, m.ep_rank) == (lead.pp_rank, lead.ep_rank) for m in members)
            if rank in lead.tp_group:
                my_leader = lead.rank
        return cls(dst, tuple(leaders), my_leader)


def _names(local: dict[str, torch.Tensor], args: ModelArgs, pp_size: int, pp_rank: int,
           ep_size: int, ep_rank: int) -> list[str]:
    """The local tensors (local-spec names) that go into the full state dict, in the order
    they are sent: sorted by name (hf_mapping.full_name says which)."""
    return [n for n in sorted(local)
            if hf_mapping.full_name(n, args, pp_size, pp_rank, ep_size, ep_rank) is not None]


def _settle(t: torch.Tensor) -> None:
    """Wait until the collectives on device tensor `t` have finished (NCCL queues them on its
    own stream; without this a rank could run ahead and hold many tensors in flight)."""
    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()


def _merge_tp(t: torch.Tensor, name: str, leader: int, tp_group,
              tp_size: int) -> torch.Tensor | None:
    """Local tensor `name` of every rank of the TP group, merged on `leader` (None elsewhere)."""
    t = t.contiguous()
    if tp_size == 1:
        return t
    parts = ([torch.empty_like(t) for _ in range(tp_size)] if dist.get_rank() == leader
             else None)
    dist.gather(t, parts, dst=leader, group=tp_group)
    if parts is None:
        _settle(t)
        return None
    return hf_mapping.merge_tp_shards(parts, name)


def gather(policy: Policy, local: dict[str, torch.Tensor], dst: int | None
           ) -> dict[str, torch.Tensor] | None:
    """The full megatron state dict (global names, fresh host tensors) of every rank's `local`
    tensors (local-spec or TE names, on the model's device) of `policy`'s layout: on global
    rank `dst` (None elsewhere), or on every rank when dst is None. Collective over the world.
    The order of the result: by pipeline stage, expert-parallel rank, then local name (as
    hf_mapping.gather_shards)."""
    device = next(policy.module.parameters()).device
    if dst is None:
        return broadcast_full(gather(policy, local, 0), 0, device)
    plan = GatherPlan.build(policy.places, dst, dist.get_rank())
    if plan.my_leader is None:  # another model replica: it holds the same weights
        return None
    args, tp, pp, ep = policy.args, policy.tp_size, policy.pp_size, policy.ep_size
    local = hf_mapping.from_te_names(local)
    names = _names(local, args, pp, policy.pp_rank, ep, policy.ep_rank)
    me = dist.get_rank()
    if me != dst:  # a TP group's shards to its leader; the leader sends them on to dst
        if me == plan.my_leader:
            dist.send_object_list([[(n, local[n].shape, local[n].dtype) for n in names]], dst=dst)
        for name in names:
            merged = _merge_tp(local[name], name, plan.my_leader, policy.tp_group, tp)
            if merged is not None:
                dist.send(merged, dst=dst)
                _settle(merged)
        return None
    full: dict[str, torch.Tensor] = {}
    for lead in plan.leaders:
        if lead.rank == me:  # dst's own TP group
            for name in names:
                merged = _merge_tp(local[name], name, me, policy.tp_group, tp)
                assert merged is not None
                # a copy even on the host: the caller must not hold the live parameters
                full[_full_name(name, args, pp, lead, ep)] = merged.to("cpu", copy=tp == 1)
            continue
        meta: list = [None]
        dist.recv_object_list(meta, src=lead.rank)
        for name, shape, dtype in meta[0]:
            buf = torch.empty(_merged_shape(name, tuple(shape), tp), dtype=dtype, device=device)
            dist.recv(buf, src=lead.rank)
            full[_full_name(name, args, pp, lead, ep)] = buf.to("cpu")
    return full


def _full_name(name: str, args: ModelArgs, pp_size: int, lead: Place, ep_size: int) -> str:
    full = hf_mapping.full_name(name, args, pp_size, lead.pp_rank, ep_size, lead.ep_rank)
    assert full is not None  # _names sends only these
    return full


def _merged_shape(name: str, shard: tuple[int, ...], tp_size: int) -> tuple[int, ...]:
    """The shape of local tensor `name` once its TP shards are merged."""
    kind = hf_mapping.partition_kind(name)
    if kind in (hf_mapping.COLUMN, hf_mapping.GATED_COLUMN):
        return (shard[0] * tp_size, *shard[1:])
    if kind == hf_mapping.ROW:
        return (shard[0], shard[1] * tp_size, *shard[2:])
    return shard


def broadcast_full(full: dict[str, torch.Tensor] | None, src: int, device: torch.device
                   ) -> dict[str, torch.Tensor]:
    """`full` (a state dict of host tensors on global rank `src`) on every rank, one tensor at a
    time through `device` (collective over the world)."""
    meta: list = [None if full is None else [(n, t.shape, t.dtype) for n, t in full.items()]]
    dist.broadcast_object_list(meta, src=src)
    if dist.get_rank() == src:
        assert full is not None
        for t in full.values():
            buf = t.to(device)
            dist.broadcast(buf, src=src)
            _settle(buf)
        return full
    out = {}
    for name, shape, dtype in meta[0]:
        buf = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(buf, src=src)
        out[name] = buf.to("cpu")
    return out


# -- host memory of the gather, on paper ------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class GatherMemory:
    """Host bytes of one gather of the full state dict (tensor payloads; Python objects and the
    allocator's slack not counted).

    full: the gathered state dict.
    all_gather: the all-gather design's peak on its worst rank (every rank gathers
        everything): the TP shards of its stage all-gathered and copied to the host; the
        expert-parallel peers' experts and then whole pipeline stages exchanged with
        all_gather_object, whose peak holds the pickled input, the output buffer (group size x
        the largest input) and the unpickled tensors at once; then the merge, beside the
        unmerged shards. A lower bound: pickle's own transient copies (of the stream, and of
        each received object before it is unpickled) are not counted.
    dst: this gather's peak on dst (the result; what is in flight lives on the device).
    other: this gather's peak on any other rank (0: it sends from its device).
    largest: the largest tensor of the full state dict. A rank holds at most twice that in
        flight (one tensor's TP shards and their merge) on its device, and on the host too when
        the model itself lives on the CPU.
    """

    full: int
    all_gather: int
    dst: int
    other: int
    largest: int


def gather_memory(args: ModelArgs, tp: int = 1, pp: int = 1, ep: int = 1,
                  bytes_per_element: int = 2) -> GatherMemory:
    """GatherMemory of model `args` at layout TP x PP x EP, `bytes_per_element` bytes per
    tensor element (2: bf16 weights; full_grads gathers fp32: 4).

    The local tensors of each (stage p, expert-parallel rank e) are shard_for_rank's (on the
    meta device: shapes only), S(p, e) = their TP-unsplit bytes (a replicated tensor tp times).
    The all-gather design's peak on a rank at (p, e) is the largest of
      EP exchange  S(p, e) + X(p, e) + ep max_e' X(p, e') + B(p)
      PP exchange  S(p, e) + [B(p) if ep > 1] + B(p) + pp max_p' B(p') + M
      merge        S(p, e) + U + N
    with X(p, e) = S(p, e) for e = 0 and the experts' part of it otherwise (what rank e sends),
    B(p) = sum_e X(p, e) (stage p with every expert), M = sum_p B(p), U the unmerged shards
    held then (M with PP > 1; B(p) with EP > 1 only; else S(p, e) itself, shared with it, 0) and
    N the bytes the merge creates: every TP-split kind of tensor, also at TP1 (a concatenation
    of one shard); a replicated tensor is TP rank 0's shard itself."""
    meta = {n: torch.empty(s, device="meta")
            for n, s in hf_mapping.expected_shapes(args).items()}
    split = sum(t.numel() for n, t in meta.items()
                if hf_mapping.partition_kind(n) != hf_mapping.REPLICATED)
    full = sum(t.numel() for t in meta.values())
    largest = max(t.numel() for t in meta.values())
    S: dict[tuple[int, int], int] = {}
    X: dict[tuple[int, int], int] = {}
    for p in range(pp):
        for e in range(ep):
            local = hf_mapping.shard_for_rank(meta, args, tp_size=tp, pp_size=pp, pp_rank=p,
                                              ep_size=ep, ep_rank=e)
            S[p, e] = sum(tp * t.numel() for t in local.values())
            X[p, e] = S[p, e] if e == 0 else sum(
                tp * t.numel() for n, t in local.items() if hf_mapping.is_expert_param(n))
    B = {p: sum(X[p, e] for e in range(ep)) for p in range(pp)}
    M = sum(B.values())
    peak = 0
    for (p, e), s in S.items():
        phases = []
        if ep > 1:
            phases.append(s + X[p, e] + ep * max(X[p, f] for f in range(ep)) + B[p])
        if pp > 1:
            phases.append(s + (B[p] if ep > 1 else 0) + B[p] + pp * max(B.values()) + M)
        unmerged = M if pp > 1 else (B[p] if ep > 1 else 0)
        phases.append(s + unmerged + split)
        peak = max(peak, *phases)
    b = bytes_per_element
    return GatherMemory(full=full * b, all_gather=peak * b, dst=full * b, other=0,
                        largest=largest * b)
