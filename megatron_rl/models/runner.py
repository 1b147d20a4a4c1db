"""Running microbatches through a Policy's model: megatron-core's pipeline schedule
(`get_forward_backward_func`) for every layout, so TP/PP/DP/EP all take the same path.

`forward_backward` prepares the microbatches (expert-parallel peers matched, one shape under
pipeline parallelism), sets the models' modes and gradient buffers, and hands the schedule a
`ForwardStep`: per microbatch, the model inputs (padding for sequence parallelism, THD params of
a packed row), the model run (routing replay or recording, the output layer switched to hidden
states for the fused LM head, the reference's stage beside the policy's), and the loss or the
collected value. `collect_per_token` is the forward-only pass that scores a whole batch.

Loss convention: the `loss_fn` given to `forward_backward` returns each microbatch's loss already
normalised by *global* batch quantities (e.g. sum over tokens / total tokens of the whole global
batch, see megatron_rl.loss). The sum of those losses over microbatches and DP ranks is the
global loss. megatron-core's schedule divides each microbatch loss by the number of microbatches
and DDP averages gradients over DP ranks; `schedule_scale` undoes both, so gradients equal the
gradient of the global loss, independent of the layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Callable, cast

import torch
import torch.distributed as dist

from megatron_rl.models import routing
from megatron_rl.models.gpt import thd_params

if TYPE_CHECKING:
    from megatron_rl.models.policy import Policy


def schedule_scale(num_microbatches: int, dp_size: int) -> float:
    """Factor that cancels the schedule's 1/num_microbatches and DDP's 1/dp_size."""
    return float(num_microbatches * dp_size)


def pad_sequence(tokens: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor | None,
                 length: int):
    """Right-pad a microbatch to `length` positions: token 0, positions continuing, and (for an
    explicit mask, True = masked out) padded rows that see only themselves, so that no
    attention row is empty."""
    b, s = tokens.shape
    extra = length - s
    tokens = torch.cat([tokens, tokens.new_zeros(b, extra)], dim=1)
    pos = torch.cat([pos, pos[:, -1:] + torch.arange(1, extra + 1, device=pos.device)], dim=1)
    if mask is not None:
        full = torch.ones(*mask.shape[:-2], length, length, dtype=mask.dtype, device=mask.device)
        full[..., :s, :s] = mask
        idx = torch.arange(s, length, device=mask.device)
        full[..., idx, idx] = False
        mask = full
    return tokens, pos, mask


def match_expert_peers(microbatches: list[dict], group) -> list[dict]:
    """`microbatches` padded so that every rank of the expert-parallel `group` runs the same
    number of microbatches of one shape. Under expert parallelism each MoE layer of every forward
    exchanges the ranks' tokens (megatron-core's allgather dispatcher, which needs equal sizes),
    while data-parallel ranks hold batches of their own lengths. Each microbatch grows to the
    group's largest [b, s]: padded rows take copies of the first row and right padding, cut off
    the output again (its "_shape" is the original), a packed row padding segments at its end
    (packing.pad_segments: cu_seqlens and its host copy grow together), cut off the output
    again too. Missing microbatches are padding only, marked "_dummy": loss 0, results
    dropped."""
    from megatron_rl.packing import pad_segments, padding_segments, segment_inputs
    from megatron_rl.parallel import all_reduce

    packed = bool(microbatches) and "cu_seqlens" in microbatches[0]
    b = max((mb["tokens"].shape[0] for mb in microbatches), default=1)
    s = max((mb["tokens"].shape[1] for mb in microbatches), default=8)
    stats = all_reduce([len(microbatches), b, s, int(packed)], group, op=dist.ReduceOp.MAX)
    n, b, s, packed = (int(v) for v in stats.tolist())
    out = []
    for mb in microbatches:
        tokens = mb["tokens"]
        b0, s0 = tokens.shape
        if (b0, s0) == (b, s):
            out.append(mb)
            continue
        mb = cast("dict[str, Any]", {**mb, "_shape": (b0, s0)})
        if "cu_seqlens" in mb:  # more padding segments
            extra = s - s0
            segs = padding_segments(extra)
            mb.update(tokens=torch.cat([tokens, tokens.new_zeros(1, extra)], dim=1),
                      position_ids=torch.cat([mb["position_ids"], torch.cat(
                          [torch.arange(n_, device=tokens.device) for n_ in segs])[None]], dim=1),
                      **pad_segments(mb, extra))
            if "routed_experts" in mb:
                r = mb["routed_experts"]
                fill = torch.arange(r.shape[-1], dtype=r.dtype, device=r.device)
                mb["routed_experts"] = torch.cat(
                    [r, fill.expand(1, extra, *r.shape[2:])], dim=1)
        else:  # more rows (copies of the first), then right padding
            rows = torch.cat([torch.arange(b0), torch.zeros(b - b0, dtype=torch.long)])
            for key in ("tokens", "position_ids", "attention_mask", "routed_experts"):
                if mb.get(key) is not None:
                    mb[key] = mb[key][rows.to(mb[key].device)]
            if s > s0:  # (routes are padded where they are laid out, routing.router_order)
                pos = mb.get("position_ids")
                if pos is None:
                    pos = torch.arange(s0, device=tokens.device).expand(b, s0)
                mb["tokens"], mb["position_ids"], mask = pad_sequence(
                    mb["tokens"], pos, mb.get("attention_mask"), s)
                if mask is not None:
                    mb["attention_mask"] = mask
        out.append(mb)
    dev = microbatches[0]["tokens"].device if microbatches else torch.device("cpu")
    while len(out) < n:
        tokens = torch.zeros(b, s, dtype=torch.long, device=dev)
        dummy: dict = {"tokens": tokens, "_dummy": True}
        if packed:
            segs = padding_segments(s)
            dummy.update(position_ids=torch.cat([torch.arange(n_) for n_ in segs])[None].to(dev),
                         **segment_inputs(segs, dev))
        out.append(dummy)
    return out


@contextlib.contextmanager
def hidden_states_output(gpt_model):
    """Within this context the model's output layer returns its input, the final hidden states
    (after the final norm), instead of the logits: GPTModel then returns [b, s, H] where it
    would return [b, s, V/TP], for ops.lm_head to score without the logits.

    The hidden states go through what megatron's ColumnParallelLinear does to its input
    (tensor_parallel/layers.py, megatron-core 0.16.1): under sequence parallelism an all-gather
    of the sequence (reduce-scatter of the gradient), otherwise with TP > 1 an identity whose
    backward all-reduces the gradient, since each rank's vocab shard contributes a partial
    gradient to the hidden states."""
    from megatron.core.tensor_parallel import (copy_to_tensor_model_parallel_region,
                                               gather_from_sequence_parallel_region)

    layer = gpt_model.output_layer

    def forward(input_, weight=None, runtime_gather_output=None):
        if layer.sequence_parallel:
            return gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True,
                                                        group=layer.tp_group), None
        if layer.allreduce_dgrad:
            return copy_to_tensor_model_parallel_region(input_, group=layer.tp_group), None
        return input_, None

    layer.forward = forward
    try:
        yield
    finally:
        del layer.forward


def packed_seq_params(batch: dict, device):
    """megatron-core's THD PackedSeqParams for a packed microbatch (see megatron_rl.packing),
    None for a padded one. Every packed forward of a microbatch (training, scoring, the
    reference's, every pipeline stage's) gets its params here: with the boundaries the
    microbatch carries on the host ("cu_seqlens_host", packing.segment_inputs), the attention
    reads nothing back from the device; without them it reads cu_seqlens once per forward."""
    if "cu_seqlens" not in batch:
        return None
    return thd_params(batch["cu_seqlens"], batch["max_seqlen"], device,
                      bounds=batch.get("cu_seqlens_host"))


def check_same_layout(policy: Policy, other: Policy) -> None:
    """`other` must be a frozen model of the same architecture in `policy`'s layout (the
    reference run inside forward_backward)."""
    mine = (policy.tp_size, policy.pp_size, policy.pp_rank, policy.ep_size,
            policy.sequence_parallel, policy.args.vocab_size, policy.args.hidden_size,
            policy.args.num_hidden_layers, policy.params_dtype, policy.fused_lm_head)
    theirs = (other.tp_size, other.pp_size, other.pp_rank, other.ep_size,
              other.sequence_parallel,
              other.args.vocab_size, other.args.hidden_size, other.args.num_hidden_layers,
              other.params_dtype, other.fused_lm_head)
    if mine != theirs:
        raise ValueError("the reference must have the policy's layout and architecture "
                         "(TP, PP, stage, EP, sequence parallelism, vocab, hidden size, layers, "
                         f"dtype, fused LM head): policy {mine}, reference {theirs}")
    if other.trainable:
        raise ValueError("the reference run inside forward_backward must be frozen "
                         "(Policy(trainable=False))")


@dataclasses.dataclass
class ForwardStep:
    """The forward step megatron-core's schedule calls for each microbatch of one
    forward_backward call (see forward_backward for the arguments).

    seq_length: the microbatches' length s; padded: s rounded up to a multiple of TP under
    sequence parallelism (which splits the sequence over the TP ranks; causal attention: the
    real positions never see the right padding, cut off the output before the loss);
    hidden: the last stage returns the final hidden states instead of the logits;
    scale: schedule_scale of the call."""

    policy: Policy
    reference: Policy | None
    loss_fn: Callable | None
    collect: Callable | None
    hidden: bool
    scale: float
    device: torch.device
    seq_length: int
    padded: int

    def __call__(self, data_iterator, model):
        """(output tensor, loss function of the output) of the next microbatch: the policy's
        output; with a reference, the reference's stage runs on the same inputs under no_grad,
        and a stage before the last sends cat([policy hidden, reference hidden]) along the
        sequence (the schedule's p2p tensors are twice as long, see forward_backward)."""
        batch = next(data_iterator)
        tokens, pos, mask, packed = self.inputs(batch)
        ref = self.reference
        # the policy replays or records routes (models.routing), the reference neither
        if ref is None:
            return (self.run_model(self.policy, model, tokens, pos, mask, packed, batch),
                    functools.partial(self.loss, batch, None))
        received = self.policy.module.decoder.input_tensor  # set by the schedule; None on stage 0
        if received is not None:
            half = received.shape[0] // 2
            self.policy.module.set_input_tensor(received[:half])
            ref.module.set_input_tensor(received[half:])
        out = self.run_model(self.policy, model, tokens, pos, mask, packed, batch)
        with torch.no_grad():
            ref_out = self.run_model(ref, ref.model[0], tokens, pos, mask, packed)
        if self.policy.is_last_stage:
            return out, functools.partial(self.loss, batch, ref_out)
        return torch.cat([out, ref_out]), functools.partial(self.loss, batch, None)

    def inputs(self, batch: dict):
        """(tokens, position ids, attention mask, packed-sequence params) of `batch` on the
        model's device: positions 0..s-1 unless given, right padding to `padded`."""
        dev = self.device
        tokens = batch["tokens"].to(dev)
        bs, ss = tokens.shape
        pos = batch.get("position_ids")
        pos = (torch.arange(ss, device=dev).expand(bs, ss) if pos is None else pos.to(dev))
        mask = batch.get("attention_mask")
        mask = None if mask is None else mask.to(dev)
        packed = packed_seq_params(batch, dev)
        pad_multiple = self.policy.pad_multiple
        if packed is not None and ss % pad_multiple:
            raise ValueError(f"a packed row of {ss} tokens: it must be a multiple of "
                             f"{pad_multiple} (packing.packed_microbatches pad_multiple)")
        if packed is None and self.padded != self.seq_length:
            tokens, pos, mask = pad_sequence(tokens, pos, mask, self.padded)
        return tokens, pos, mask, packed

    def run_model(self, policy: Policy, model, tokens, pos, mask, packed, batch=None):
        """`policy`'s stage on the inputs: hidden states or logits (see `hidden`); with a
        batch's "routed_experts" its MoE layers replay them, and with its "record_routes" list
        the experts its routers chose themselves are appended to it (models.routing)."""
        head = (hidden_states_output(policy.module) if self.hidden and policy.is_last_stage
                else contextlib.nullcontext())
        routes = None if batch is None else batch.get("routed_experts")
        record = None if batch is None else batch.get("record_routes")
        if routes is None and record is None:
            with head:
                return model(tokens, pos, mask, packed_seq_params=packed)
        if routes is not None:  # replay; with `record`: and note the routers' own choice
            routes = routing.router_order(routes.to(self.device), tokens.shape[1], policy.tp_rank,
                                          policy.tp_size, policy.sequence_parallel)
            rec: list = []
            with head, routing.replaying(policy.module, routes, None if record is None else rec):
                out = model(tokens, pos, mask, packed_seq_params=packed)
            if record is None:
                return out
        else:  # the experts chosen
            with head, routing.recording(policy.module) as rec:
                out = model(tokens, pos, mask, packed_seq_params=packed)
        assert batch is not None and record is not None
        # as [b, s, M_stage, k] in the batch's layout
        rows, length = batch.get("_shape", batch["tokens"].shape)
        got = routing.gather_recorded(rec, tokens.shape[0], policy.tp_group, policy.tp_size,
                                      policy.sequence_parallel)
        record.append(got[:rows, :length])
        return out

    def loss(self, batch: dict, ref_out, out):
        """The schedule's loss function of a microbatch's last-stage output `out`: (loss x
        scale, metrics) from loss_fn, or (0, collected value) from collect; nothing for an
        expert-parallel padding microbatch. Padding added here or by match_expert_peers is cut
        off `out` (and `ref_out`) first: a padded microbatch back to [rows, seq_length] or its
        "_shape", a packed row grown by match_expert_peers back to its "_shape" [1, T] (the
        shape of its layout's targets)."""
        if batch.get("_dummy"):  # expert-parallel padding: no loss, nothing collected
            return out.float().sum() * 0.0, {}
        if "cu_seqlens" not in batch or "_shape" in batch:  # cut the padding off (SP, EP peers)
            rows, length = batch.get("_shape", (out.shape[0], self.seq_length))
            if (rows, length) != tuple(out.shape[:2]):
                out = out[:rows, :length].contiguous()
                if ref_out is not None:
                    ref_out = ref_out[:rows, :length].contiguous()
        extra = () if self.reference is None else (ref_out,)
        if self.collect is not None:
            return torch.zeros((), device=out.device), self.collect(batch, out, *extra)
        assert self.loss_fn is not None
        loss, metrics = self.loss_fn(batch, out, *extra)
        return loss * self.scale, metrics


def _microbatch_shape(policy: Policy, microbatches: list[dict]) -> tuple[int, int]:
    """The [b, s] the schedule is told: the largest microbatch's; under pipeline parallelism
    (fixed p2p shapes) every microbatch must have it."""
    b, s = max((mb["tokens"].shape for mb in microbatches), key=lambda bs: bs[0] * bs[1])
    if policy.pp_size > 1 and any(mb["tokens"].shape != (b, s) for mb in microbatches):
        raise ValueError("pipeline parallelism needs microbatches of one shape")
    return b, s


def _start(policy: Policy, reference: Policy | None, forward_only: bool) -> None:
    """Train or eval mode for the policy (the reference: eval), and, for a backward, zeroed
    gradient buffers (megatron DDP's; a frozen model is not wrapped) and optimizer grads."""
    for m in policy.model:
        m.train(not forward_only)
    if reference is not None:
        for m in reference.model:
            m.train(False)
    zero_grad_buffer = getattr(policy.model[0], "zero_grad_buffer", None)
    if not forward_only and zero_grad_buffer is not None:
        zero_grad_buffer()
    if policy.optimizer is not None and not forward_only:
        policy.optimizer.zero_grad()


def forward_backward(policy: Policy, microbatches: list[dict], loss_fn: Callable | None,
                     forward_only: bool = False, collect: Callable | None = None,
                     reference: Policy | None = None, for_scoring: bool = False) -> list:
    """Run all microbatches through `policy`'s pipeline schedule (Policy.forward_backward
    documents the arguments). Returns the loss_fn metrics (or collected values) of the real
    microbatches on the last stage, [] elsewhere."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    num_real = len(microbatches)
    if policy.ep_size > 1:  # the expert-parallel peers run matching forwards
        from megatron.core import parallel_state as ps

        microbatches = match_expert_peers(microbatches, ps.get_expert_model_parallel_group())
    if not microbatches:
        return []
    if reference is not None:
        check_same_layout(policy, reference)
    b, s = _microbatch_shape(policy, microbatches)
    padded = -(-s // policy.tp_size) * policy.tp_size if policy.sequence_parallel else s
    step = ForwardStep(policy, reference, loss_fn, collect,
                       hidden=policy.fused_lm_head and for_scoring,
                       scale=schedule_scale(len(microbatches), policy.dp_size),
                       device=next(policy.module.parameters()).device, seq_length=s,
                       padded=padded)
    _start(policy, reference, forward_only)
    fb = get_forward_backward_func()
    context = torch.no_grad() if forward_only else contextlib.nullcontext()
    # with a reference, the stages exchange [2 s, b, h]: both models' hidden states
    seq_length = padded if reference is None or policy.pp_size == 1 else 2 * padded
    with context:
        out = fb(forward_step_func=step, data_iterator=iter(microbatches), model=policy.model,
                 num_microbatches=len(microbatches), seq_length=seq_length, micro_batch_size=b,
                 forward_only=forward_only)
    if reference is not None:
        reference.module.set_input_tensor(None)
    return out[:num_real] if policy.is_last_stage else []


def collect_per_token(policy: Policy, tokens: torch.Tensor, layout, fn: Callable,
                      num_outputs: int, *, seq_lengths=None, reference: Policy | None = None,
                      routes: torch.Tensor | None = None,
                      own_routes: list | None = None) -> torch.Tensor:
    """[num_outputs, B, L-1] fp32 per-token values of a right-padded batch, on every rank of
    `policy`'s pipeline (Policy.collect_per_token documents the arguments)."""
    from megatron_rl.packing import Layout

    if isinstance(layout, int):
        layout = Layout(packed=False, micro_batch_size=layout)
    B, L = tokens.shape
    mbs = layout.microbatches(tokens, seq_lengths, None, policy.pad_multiple, policy.pp_size > 1,
                              routes)

    def collect(batch, out, *ref):
        mb = batch["layout"]
        return torch.stack([mb.to_rows(v.float()) for v in fn(mb, out, *ref)])

    recorded: list = []
    record = {} if own_routes is None else {"record_routes": recorded}
    outs = forward_backward(policy, [{**mb.inputs, "layout": mb, **record} for mb in mbs], None,
                            forward_only=True, collect=collect, reference=reference,
                            for_scoring=True)
    if own_routes is not None:  # int16 on the host, like the batch's routed_experts
        rows = torch.zeros(B, L - 1, *recorded[0].shape[2:], dtype=torch.int16)
        for mb, got in zip(mbs, recorded):
            rows[mb.rows.cpu()] = mb.to_rows(got).to("cpu", torch.int16)
        own_routes.append(rows)
    result = None
    if policy.is_last_stage:
        result = torch.zeros(num_outputs, B, L - 1, device=outs[0].device if outs else None)
        for mb, o in zip(mbs, outs):
            result[:, mb.rows.to(result.device)] = o
    return policy.broadcast_from_last_stage(result, (num_outputs, B, L - 1), torch.float32)
