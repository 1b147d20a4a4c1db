"""How a batch's sequences are laid out for the model: padded rows or packed rows.

Padded (the comparison path, `--no-sequence-packing`): microbatches of `micro_batch_size`
sequences, each right-padded to the batch's longest, L tokens.

Packed (the default): the sequences of a microbatch are concatenated into one row of at most
`max_tokens` tokens (`--max-tokens-per-microbatch`), padded at the end to a multiple of
`pad_multiple` or, with shape bucketing (on a GPU, see `bucketed_length`), to one of at most
SHAPE_BUCKETS lengths per token budget; the padding is a segment of its own. The model gets input_ids [1, T],
position_ids restarting at 0 in every sequence, and the segment boundaries `cu_seqlens`
(megatron-core's THD `PackedSeqParams`): attention stays inside a sequence and RoPE restarts.
The boundaries are built on the host and kept there beside the device tensor
(`segment_inputs`), so the model's attention never reads them back from the device.
Sequences go to microbatches by first-fit decreasing on their lengths, so few microbatches are
needed and the long ones are not all in one.

Either way, per-token model outputs come back in the batch's own [B, L-1] layout
(`Microbatch.to_rows`): position t of row i scores token t+1 of sequence i. Everything the
loss sees (loss mask, advantages, old / reference / rollout log-probs, KL terms) therefore stays
in one layout, and the packed and padded paths give the same numbers up to float rounding.

Across data-parallel ranks, whole groups (the samples of one prompt, which share a baseline) are
dealt by token count (`balance_groups`: longest-processing-time first), so that no rank waits
on another's long tail. They are dealt one PPO minibatch at a time (`rank_groups`): minibatch k
is the k-th block of the batch's groups in every layout, so the data-parallel size and packing
decide which rank computes a group, never which optimizer step it belongs to.
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
from typing import Sequence

import torch

from megatron_rl.batch import next_token_targets
from megatron_rl.parallel import to_device


def balance_groups(group_tokens: Sequence[int], num_parts: int) -> list[list[int]]:
    """Indices of the groups each of `num_parts` ranks takes, balanced by token count: groups in
    decreasing size, each to the part with the fewest tokens so far (ties: the lower part), the
    LPT rule (at most 4/3 of the optimal makespan). Every part gets the same number of groups
    when the count divides evenly (the loss normalisers and PPO minibatches count sequences per
    rank); within a part the groups keep their original order."""
    n = len(group_tokens)
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    cap = -(-n // num_parts)  # groups per part at most
    order = sorted(range(n), key=lambda g: (-group_tokens[g], g))
    heap = [(0, p) for p in range(num_parts)]
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    for g in order:
        load, p = heapq.heappop(heap)
        parts[p].append(g)
        if len(parts[p]) < cap:  # a full part takes no more groups
            heapq.heappush(heap, (load + group_tokens[g], p))
    return [sorted(p) for p in parts]


def rank_groups(group_tokens: Sequence[int], num_ranks: int, rank: int, num_minibatches: int,
                balance: bool) -> list[int]:
    """Indices of the groups data-parallel rank `rank` of `num_ranks` trains on, in the order
    its PPO minibatches take them: its share of minibatch 0, then of minibatch 1, ...

    PPO minibatch k is the groups [k n/M, (k+1) n/M) of the batch's n groups (M =
    `num_minibatches`) whatever the layout: the same sequences share an optimizer step at any
    data-parallel size, packed or not, so a resume onto another layout continues the same
    updates (their loss normalisers count the minibatch over all ranks: the same too). Each
    block is dealt over the ranks on its own: balanced by token count (`balance`:
    balance_groups, since a minibatch's forward-backward ends in a collective), else every
    num_ranks-th group. n must be a multiple of M x num_ranks (TrainConfig.check_layout), so
    every rank's share of every minibatch has n / (M num_ranks) groups and the trainer's k-th
    equal slice of a rank's groups is its share of minibatch k."""
    n = len(group_tokens)
    if n % (num_minibatches * num_ranks):
        raise ValueError(f"{n} groups do not split into {num_minibatches} minibatches of equal "
                         f"shares on {num_ranks} data-parallel ranks")
    block = n // num_minibatches
    mine: list[int] = []
    for start in range(0, n, block):
        if balance:
            share = balance_groups(group_tokens[start:start + block], num_ranks)[rank]
        else:
            share = list(range(block))[rank::num_ranks]
        mine += [start + g for g in share]
    return mine


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of indices whose lengths sum to at most `capacity`: longest first, each into the
    first bin with room. Bins in order of creation, indices within a bin ascending."""
    too_long = [i for i, n in enumerate(lengths) if n > capacity]
    if too_long:
        i = too_long[0]
        raise ValueError(f"sequence {i} has {lengths[i]} tokens, more than "
                         f"--max-tokens-per-microbatch {capacity}: raise it to at least the "
                         "longest prompt + response")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, r in enumerate(room):
            if lengths[i] <= r:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return [sorted(b) for b in bins]


PAD_SEGMENT = 256  # longest padding segment of a packed row (tokens)


def padding_segments(n: int) -> list[int]:
    """The lengths of the segments `n` padding tokens of a packed row form: at most PAD_SEGMENT
    each, since attention over one long padding segment (a short row padded to a long one)
    would cost O(n^2)."""
    return [min(PAD_SEGMENT, n - a) for a in range(0, n, PAD_SEGMENT)]


def segment_inputs(segments: Sequence[int], device) -> dict:
    """The segment keys of a packed row's inputs, for segments of `segments` tokens laid end to
    end from position 0 (the sequences, then the padding's segments):

    - "cu_seqlens": [n + 1] int32 on `device`, the boundaries megatron-core's THD attention and
      RoPE read on the device;
    - "cu_seqlens_host": the same n + 1 values as a tuple of ints on the host. The attention
      needs them on the host too (SDPAttention's segments, varlen_attn's longest one); given
      them (models.gpt.thd_params `bounds`), it reads nothing back from the device, where
      reading cu_seqlens would make the host wait for the device once per forward;
    - "max_seqlen": the longest segment.

    Both boundary keys come from the one host list here, so they always agree; every row shape
    a packed row takes (its padding, bucketing, expert-parallel peers) goes through this."""
    lens = [int(n) for n in segments]
    bounds = (0, *itertools.accumulate(lens))
    return {"cu_seqlens": to_device(torch.tensor(bounds, dtype=torch.int32), device),
            "cu_seqlens_host": bounds, "max_seqlen": max(lens, default=0)}


def host_segment_bounds(inputs: dict) -> tuple[int, ...]:
    """A packed row's segment boundaries on the host: its "cu_seqlens_host" (segment_inputs),
    else, for inputs built without them, cu_seqlens read back from the device (a host
    synchronisation)."""
    bounds = inputs.get("cu_seqlens_host")
    if bounds is None:
        bounds = inputs["cu_seqlens"].tolist()
    return tuple(int(b) for b in bounds)


def pad_segments(inputs: dict, extra: int) -> dict:
    """The segment keys (segment_inputs) of packed `inputs` whose row grows by `extra` padding
    tokens at its end: padding_segments(extra) more segments, on the device of its
    cu_seqlens."""
    bounds = host_segment_bounds(inputs)
    lens = [b - a for a, b in itertools.pairwise(bounds)]
    return segment_inputs(lens + padding_segments(extra), inputs["cu_seqlens"].device)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


SHAPE_BUCKETS = 16  # packed row lengths per token budget, at most (with bucketing)


def bucket_quantum(budget: int, pad_multiple: int = 8) -> int:
    """The step q of the bucketed row lengths of a token budget B: ceil(B / SHAPE_BUCKETS)
    rounded up to a multiple of `pad_multiple`."""
    return _round_up(-(-budget // SHAPE_BUCKETS), pad_multiple)


def bucketed_length(tokens: int, budget: int, pad_multiple: int = 8) -> int:
    """The length a packed row of `tokens` real tokens (<= budget B) is padded to with shape
    bucketing: min(round_up(tokens, q), round_up(B, pad_multiple)), q = bucket_quantum(B).

    Shapes: the lengths are q, 2q, ..., 15q and the cap round_up(B, pad_multiple) (16q >= B,
    so every other multiple of q is past the cap): at most SHAPE_BUCKETS per budget, whatever
    the sequence lengths, so megatron's compiled fusions, CUDA graphs and the caching allocator
    see that many row shapes per run with a fixed --max-tokens-per-microbatch. With the default
    budget (micro_batch_size x the batch's padded width L) the budget follows L, and there are
    at most SHAPE_BUCKETS per distinct width instead.

    Cost: a row gets fewer than q ~ B/16 padding tokens, never more than the unbucketed row's
    cap (the budget's memory is kept). First-fit decreasing fills most rows to within a few
    tokens of B, and those take the cap, so the padding added is about 1-2% of the tokens on
    long-tailed lengths (tests/unit/test_packing.py measures it); only a batch's last, partly
    filled rows pay up to q each."""
    cap = _round_up(budget, pad_multiple)
    if tokens > cap:
        raise ValueError(f"a packed row of {tokens} tokens is over its budget of {budget}")
    return min(_round_up(tokens, bucket_quantum(budget, pad_multiple)), cap)


@dataclasses.dataclass
class Microbatch:
    """One microbatch: the model's inputs and where its outputs go in the batch.

    rows: [b] long, the batch rows it holds. inputs: what Policy.forward_backward feeds the
    model: "tokens" [b, L] (padded) or [1, T] (packed) and, packed, "position_ids" [1, T] and
    the segment keys of `segment_inputs` ("cu_seqlens" [segments + 1] int32 on the device, the
    same boundaries on the host as "cu_seqlens_host", "max_seqlen"). targets: the token each
    position scores (the next one in its sequence; anything at a sequence's last position),
    shaped like tokens.
    unpack: packed only, [b, L-1] long indices into the packed row (0 where invalid) with
    `valid` [b, L-1] bool."""
    rows: torch.Tensor
    inputs: dict
    targets: torch.Tensor
    unpack: torch.Tensor | None = None
    valid: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.inputs["tokens"].numel()

    def to_rows(self, per_token: torch.Tensor) -> torch.Tensor:
        """Per-position outputs [b, s, ...] (padded; padded rows beyond `rows` dropped) or
        [1, T, ...] (packed) -> [len(rows), L-1, ...] in the batch's layout (0 at positions that
        score nothing)."""
        if self.unpack is None:
            return per_token[:len(self.rows), :-1]
        rest = per_token.shape[2:]
        out = per_token.reshape(-1, *rest)[self.unpack.to(per_token.device)]
        valid = self.valid.to(per_token.device).reshape(*self.valid.shape, *(1,) * len(rest))
        return torch.where(valid, out, torch.zeros_like(out))


def padded_microbatches(tokens: torch.Tensor, rows: Sequence[int], micro_batch_size: int,
                        equal_shapes: bool = True,
                        routes: torch.Tensor | None = None) -> list[Microbatch]:
    """`micro_batch_size` rows at a time of the right-padded [B, L] tokens; with equal_shapes
    (the pipeline schedule) the last one is filled up with copies of its first row. routes:
    the batch's [B, L, M, k] routing-replay experts (models.routing), carried as the inputs'
    "routed_experts" [b, L, M, k]."""
    out = []
    rows = list(rows)
    for i in range(0, len(rows), micro_batch_size):
        r = to_device(rows[i:i + micro_batch_size], tokens.device, torch.long)
        take = r
        if equal_shapes and len(r) < micro_batch_size:
            take = torch.cat([r, r[:1].expand(micro_batch_size - len(r))])
        t = tokens[take]
        inputs = {"tokens": t}
        if routes is not None:
            inputs["routed_experts"] = routes[take.to(routes.device)]
        out.append(Microbatch(r, inputs, next_token_targets(t)))
    return out


def packed_microbatches(tokens: torch.Tensor, seq_lengths: Sequence[int], rows: Sequence[int],
                        max_tokens: int, pad_multiple: int = 8,
                        equal_shapes: bool = False,
                        routes: torch.Tensor | None = None,
                        bucket: bool = False) -> list[Microbatch]:
    """Pack `rows` of the right-padded [B, L] tokens (row i's sequence: its first seq_lengths[i]
    tokens) into rows of at most `max_tokens` tokens (first-fit decreasing), each padded to a
    multiple of `pad_multiple`, or with `bucket` to bucketed_length(its tokens, max_tokens);
    with equal_shapes (the pipeline schedule) all to the longest. routes: the batch's
    [B, L, M, k] routing-replay experts, carried packed like the tokens as the inputs'
    "routed_experts" [1, T, M, k]."""
    def padded_length(n: int) -> int:
        return (bucketed_length(n, max_tokens, pad_multiple) if bucket
                else _round_up(n, pad_multiple))

    rows = list(rows)
    lengths = [int(seq_lengths[r]) for r in rows]
    bins = first_fit_decreasing(lengths, max_tokens)
    width = padded_length(max(sum(lengths[i] for i in b) for b in bins)) if bins else 0
    L = tokens.shape[1]
    dev = tokens.device
    out = []
    for b in bins:
        lens = [lengths[i] for i in b]
        total = sum(lens)
        T = width if equal_shapes else padded_length(total)
        seg = lens + padding_segments(T - total)
        rid = [rows[i] for i in b]
        # built on the host as indices into the [B * L] tokens, then one gather on the device:
        # no per-sequence device work or host sync
        src = torch.zeros(T, dtype=torch.long)       # token at each packed position
        nxt = torch.zeros(T, dtype=torch.long)       # the token it scores (the next one)
        pos = torch.zeros(T, dtype=torch.long)
        unpack = torch.zeros(len(b), L - 1, dtype=torch.long)
        valid = torch.zeros(len(b), L - 1, dtype=torch.bool)
        start = 0
        for j, n in enumerate(lens):
            span = torch.arange(n)
            src[start:start + n] = rid[j] * L + span
            nxt[start:start + n] = rid[j] * L + torch.clamp(span + 1, max=n - 1)
            pos[start:start + n] = span
            unpack[j, :n - 1] = start + span[:n - 1]
            valid[j, :n - 1] = True
            start += n
        flat_tokens = tokens.reshape(-1)
        inputs = {"tokens": flat_tokens[src.to(dev)][None], "position_ids": pos.to(dev)[None],
                  **segment_inputs(seg, dev)}
        if routes is not None:
            flat_routes = routes.reshape(-1, *routes.shape[2:])
            inputs["routed_experts"] = flat_routes[src.to(routes.device)][None]
        r = torch.as_tensor(rid, dtype=torch.long).to(dev)
        out.append(Microbatch(r, inputs, flat_tokens[nxt.to(dev)][None], unpack.to(dev),
                              valid.to(dev)))
    return out


@dataclasses.dataclass(frozen=True)
class Layout:
    """How microbatches are formed (--sequence-packing, --max-tokens-per-microbatch,
    --micro-batch-size). max_tokens 0: micro_batch_size times the batch's padded length L, the
    tokens of one padded microbatch. bucket: packed rows padded to at most SHAPE_BUCKETS
    lengths per token budget (`bucketed_length`; the trainer's choice: update.layout)."""
    packed: bool = True
    micro_batch_size: int = 8
    max_tokens: int = 0
    bucket: bool = False

    def microbatches(self, tokens: torch.Tensor, seq_lengths: Sequence[int] | None = None,
                     rows: Sequence[int] | None = None, pad_multiple: int = 8,
                     equal_shapes: bool = False,
                     routes: torch.Tensor | None = None) -> list[Microbatch]:
        """The microbatches of `rows` (default: all) of the right-padded [B, L] `tokens`, whose
        sequences have `seq_lengths` tokens (default: L each); `routes` [B, L, M, k]: the
        experts to replay (models.routing), laid out with the tokens."""
        B, L = tokens.shape
        rows = range(B) if rows is None else rows
        if not self.packed:
            return padded_microbatches(tokens, rows, self.micro_batch_size, equal_shapes, routes)
        lengths = [L] * B if seq_lengths is None else seq_lengths
        cap = self.max_tokens or self.micro_batch_size * L
        return packed_microbatches(tokens, lengths, rows, cap, pad_multiple, equal_shapes,
                                   routes, self.bucket)
