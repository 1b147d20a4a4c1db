"""Routing replay: mixture-of-experts layers that route a token the way the rollout engine did.

Why. A MoE layer sends each token to the top-k experts of its router. The engine that sampled
a response and the trainer that scores it compute the router logits with different kernels (and,
one update stale, different weights), so at near-ties they pick different experts, and a token's
log-prob then differs by far more than float rounding: the importance weights of the rollout
correction and the KL estimators see a policy that never sampled the data. Replay (R3, "rollout
routing replay") records the engine's choice of experts for every token it forwarded and makes
the trainer's forward passes over those tokens use exactly that choice. The router still computes
its logits, so the gate values (the softmax over the chosen experts' logits) and the router's
gradient stay the trainer's own: only the discrete top-k is taken from the engine.

Format. One sequence's routes are an integer tensor [n, M, k]: n = the tokens the engine
forwarded (prompt + response minus the last sampled token, which is never fed back), M = the
model's mixture-of-experts layers in order (dense layers have none), k = experts per token,
global expert ids. `Completion.routed_experts` carries it from the engine; RolloutBatch holds
[B, L, M, k] (batch.fill_routes: positions without a record, padding included, get experts
0..k-1: they score nothing the loss reads, but every position must route somewhere).

Mechanism. megatron-core's TopKRouter holds a `RouterReplay` (moe_enable_routing_replay, set
on every MoE model megatron_rl builds); with no action set it routes as usual. `recording` sets
RECORD on this model's routers and `replaying` sets REPLAY_FORWARD with target indices, each for
one forward, and both clear the routers afterwards. While replaying, the routers' own top-k can
be collected too: `disagreement` then says how often the engine routed a token elsewhere. Each model drives its own routers only
(megatron's static helpers act on every router of the process, the reference model's included).

The router sees a forward's tokens as [s, b] flattened sequence-major (megatron's [s, b, h]
activations), and under sequence parallelism only its TP rank's contiguous s / TP slice;
`router_order` lays the [b, s, M, k] routes of a microbatch out that way. Expert parallelism does
not change it (routing happens before tokens are dispatched). Not covered: activation recompute
of MoE layers (the recomputed forward would route again; refused in configuration) and
megatron's fused TE router (which skips the replay hook; megatron_rl does not enable it).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


def moe_layers(module) -> list[tuple[int, object]]:
    """(index among the model's MoE layers, the layer's TopKRouter) for each mixture-of-experts
    layer of this pipeline stage of `module` (a megatron GPTModel), in layer order."""
    layers = module.decoder.layers
    config = module.config
    freq = getattr(config, "moe_layer_freq", 1)
    pattern = (list(freq) if isinstance(freq, (list, tuple))
               else [int(i % freq == 0) for i in range(config.num_layers)])
    out = []
    for layer in layers:
        router = getattr(layer.mlp, "router", None)
        if router is None:
            continue
        g = layer.layer_number - 1  # megatron's layer_number: global and 1-based
        out.append((sum(pattern[:g]), router))
    return out


def _replay_of(router):
    r = getattr(router, "router_replay", None)
    if r is None:
        raise ValueError("this model's routers were built without moe_enable_routing_replay")
    return r


@contextlib.contextmanager
def recording(module) -> Iterator[list[torch.Tensor]]:
    """Record the experts every MoE router of `module` picks during one forward. Yields a list
    that, after the block, holds per MoE layer of this stage (moe_layers order) the int64
    [tokens, k] indices in the router's token order."""
    layers = moe_layers(module)
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    out: list[torch.Tensor] = []
    for _, router in layers:
        _replay_of(router).set_router_replay_action(RouterReplayAction.RECORD)
    try:
        yield out
        for _, router in layers:
            rec = _replay_of(router).get_recorded_indices()
            if rec is None:
                raise RuntimeError("a router recorded nothing: no forward ran in the block")
            out.append(rec.detach())
    finally:
        for _, router in layers:
            _replay_of(router).clear_router_replay_action()
            _replay_of(router).clear_indices()


@contextlib.contextmanager
def replaying(module, routes: torch.Tensor,
              own: list[torch.Tensor] | None = None) -> Iterator[None]:
    """One forward of `module` in which every MoE router uses `routes` [tokens, M, k] (router
    token order, all M MoE layers of the model; this stage takes its own) instead of its top-k.
    own: a list that receives, per MoE layer of this stage, the [tokens, k] experts the router
    would have chosen itself (for measuring how often the engine's routing differs)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    layers = moe_layers(module)
    try:
        for m, router in layers:
            r = _replay_of(router)
            r.set_target_indices(routes[:, m].long())
            r.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            if own is not None:
                r.get_replay_topk = _also_own_topk(r, own)
        yield
    finally:
        for _, router in layers:
            r = _replay_of(router)
            r.clear_router_replay_action()
            r.clear_indices()
            r.__dict__.pop("get_replay_topk", None)


def _also_own_topk(replay, own: list[torch.Tensor]):
    """`replay`'s get_replay_topk (megatron-core's RouterReplay), which also appends the top-k the
    router computes itself to `own` before returning the replayed choice."""
    method = type(replay).get_replay_topk

    def get_replay_topk(scores, topk, num_groups=None, group_topk=None,
                        default_compute_topk=None):
        assert default_compute_topk is not None
        own.append(default_compute_topk(scores, topk, num_groups, group_topk)[1].detach())
        return method(replay, scores, topk, num_groups, group_topk, default_compute_topk)

    return get_replay_topk


def router_order(routes: torch.Tensor, length: int, tp_rank: int = 0, tp_size: int = 1,
                 sequence_parallel: bool = False) -> torch.Tensor:
    """A microbatch's routes [b, s, M, k] -> [tokens, M, k] in the order its routers see them:
    the sequence padded to `length` (the forward's sequence length; padding routes to experts
    0..k-1), sequence-major, and under sequence parallelism this TP rank's slice of it."""
    b, s, M, k = routes.shape
    if length > s:
        fill = torch.arange(k, dtype=routes.dtype, device=routes.device).expand(b, length - s, M, k)
        routes = torch.cat([routes, fill], dim=1)
    routes = routes.transpose(0, 1)  # [length, b, M, k]
    if sequence_parallel and tp_size > 1:
        chunk = length // tp_size
        routes = routes[tp_rank * chunk:(tp_rank + 1) * chunk]
    return routes.reshape(-1, M, k)


def gather_recorded(recorded: list[torch.Tensor], batch: int, tp_group=None, tp_size: int = 1,
                    sequence_parallel: bool = False) -> torch.Tensor:
    """The routes one forward of `batch` rows recorded on this stage (`recording`'s list) as
    [batch, s, M_stage, k]: the TP ranks' sequence slices joined under sequence parallelism."""
    import torch.distributed as dist

    stacked = torch.stack(recorded, dim=1)  # [s_local * batch, M, k]
    if sequence_parallel and tp_size > 1:
        parts = [torch.empty_like(stacked) for _ in range(tp_size)]
        dist.all_gather(parts, stacked.contiguous(), group=tp_group)
        stacked = torch.cat(parts)
    s = stacked.shape[0] // batch
    return stacked.reshape(s, batch, *stacked.shape[1:]).transpose(0, 1)


def disagreement(own: torch.Tensor, engine: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """How often the trainer's own routing differs from the engine's: own / engine [B, n, M, k]
    experts (order within the k ignored) over the `valid` [B, n] positions. Returns float64
    sums to reduce across ranks: [token-layer pairs whose expert sets differ, token-layer
    pairs, tokens with at least one such layer, tokens]."""
    differ = (own.long().sort(-1).values != engine.long().sort(-1).values).any(-1)  # [B, n, M]
    differ = differ & valid[..., None]
    tokens = valid.sum()
    return torch.stack([differ.sum(), tokens * own.shape[2], differ.any(-1).sum(),
                        tokens]).double()
