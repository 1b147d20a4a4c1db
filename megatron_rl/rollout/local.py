"""The embedded default engine: samples from the training model itself, in its TP/PP layout.

No weight copy and no server: `update_weights` only records the version, because generation
reads the live parameters. Every data-parallel rank generates for its own prompts; inside a
model-parallel group all ranks run the same forward (TP shards gathered, PP through the pipeline
schedule) and one rank (the last stage's TP rank 0) samples, then broadcasts the tokens and
their log-probs to the group: no rank relies on sampling bit-for-bit like another.

Prompts are left-padded, with position ids counted from each prompt's first real token and an
attention mask that hides the padding, so each sequence is computed as if alone (RoPE is relative
and the pads are masked, so left padding does not change the result).

Two decoding paths, which draw the same tokens for the same seed (same logits up to float
rounding, same generator use):
- KV-cached (default where megatron_rl.models.decode supports the layout: pipeline-parallel size
  1, any TP): `KVDecoder` on the live weights, one prefill of the left-padded block of distinct
  prompts (the n samples of a prompt share its cache rows), then one token per step.
- full recompute (PP > 1, or `kv_cache=False`, or MEGATRON_RL_LOCAL_KV_CACHE=0): the whole prefix
  through megatron-core's pipeline schedule at every step (`Policy.last_token_logits`);
  quadratic in length.

rollout_logprobs are log-probs under the temperature-scaled distribution softmax(z / T), before
top-k / top-p truncation (with T = 1 and no truncation: the policy's own log-probs).

Mixture-of-experts policies: with SamplingParams.return_routed_experts each completion carries
the experts its tokens were routed to (megatron_rl.models.routing): the prompt's from the first
forward, each generated token's from the step that fed it in (each position is routed once, as
in any engine with a KV cache). Under expert parallelism (full recompute: the experts of other
ranks are reached through megatron-core's token exchange) the data-parallel ranks exchange
tokens inside every forward, so all ranks decode in lockstep: a rank whose sequences have all
stopped keeps stepping until every rank's have.
"""

from __future__ import annotations

from typing import Callable, Sequence

import os

import torch
import torch.distributed as dist

from megatron_rl.models.decode import KVDecoder, unsupported_reason
from megatron_rl.parallel import device, to_device
from megatron_rl.rollout.base import Completion, SamplingParams


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask logits [B, V] outside the top-k and the top-p nucleus with -inf."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p
        drop = probs.cumsum(-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    return logits


def sample_tokens(logits: torch.Tensor, params: SamplingParams,
                  gen: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens [B] and their log-probs [B] (under softmax(z / T), before truncation) from
    full-vocabulary logits [B, V], on the logits' device."""
    scaled = logits.float() / max(params.temperature, 1e-6)
    logp = scaled.log_softmax(-1)
    if params.temperature <= 1e-6:
        nxt = scaled.argmax(-1)
    else:
        probs = _filter_logits(scaled, params.top_k, params.top_p).softmax(-1)
        nxt = torch.multinomial(probs, 1, generator=gen)[:, 0]
    return nxt, logp.gather(-1, nxt[:, None])[:, 0]


class LocalEngine:
    """Generation with the training `Policy` (megatron_rl.models.policy) itself: every rank
    generates its data-parallel share, each model-parallel group together (client_rank None),
    from the policy's own weights (nothing to copy at a weight update)."""

    client_rank = None
    holds_own_weights = False
    concurrent_generate = False  # one decoding loop: each turn of all episodes in one call

    def __init__(self, policy, pad_token_id: int = 0, kv_cache: bool | None = None):
        """kv_cache: True = KV-cached decoding (error where the layout does not support it),
        False = full recompute at every step, None = KV cache where supported, unless the
        environment sets MEGATRON_RL_LOCAL_KV_CACHE=0."""
        self.policy = policy
        self.pad_token_id = pad_token_id
        self.weight_version = 0
        reason = unsupported_reason(policy)
        if kv_cache is None:
            kv_cache = reason is None and os.environ.get("MEGATRON_RL_LOCAL_KV_CACHE", "1") != "0"
        elif kv_cache and reason:
            raise ValueError(f"{reason}; use kv_cache=False")
        self.kv_cache = bool(kv_cache)

    def update_weights(self, version: int) -> None:
        self.weight_version = version

    def stats(self) -> dict[str, float]:
        return {}

    def release_memory(self) -> None:
        pass

    def resume_memory(self) -> None:
        pass

    def health(self) -> bool:
        return True

    def shutdown(self) -> None:
        pass

    def _routes_buffer(self, batch: int, length: int, dev) -> torch.Tensor:
        """[batch, length, M, k] int16 for the experts of every position (return_routed_experts);
        an error where the policy cannot record them."""
        if not self.policy.args.num_experts:
            raise ValueError("return_routed_experts needs a mixture-of-experts model; "
                             f"{self.policy.args.architecture} has no experts")
        if self.policy.pp_size > 1:
            raise ValueError("the local engine records routed experts at pipeline-parallel "
                             "size 1 only (each stage sees its own layers); use "
                             "--rollout-engine process")
        args = self.policy.args
        return torch.zeros(batch, length, sum(args.moe_layer_pattern), args.num_experts_per_tok,
                           dtype=torch.int16, device=dev)

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams,
                 interrupt: Callable[[], bool] | None = None) -> list[list[Completion]]:
        """`n` samples for each prompt (token ids). Collective over the model-parallel group.

        interrupt: asked after every decoding step (the process engine's child: whether a
        weight update waits, --partial-rollouts); when it answers True the call returns at once,
        each response that had not ended with what it has so far and finish_reason "abort"."""
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        seqs = [list(p) for p in prompts for _ in range(n)]
        B, P = len(seqs), max(len(p) for p in seqs)
        max_len = P + params.max_new_tokens
        if max_len > self.policy.args.max_position_embeddings:
            raise ValueError(f"prompt ({P}) + max_new_tokens ({params.max_new_tokens}) exceeds the "
                             f"model's max_position_embeddings "
                             f"({self.policy.args.max_position_embeddings})")
        # every buffer lives on the model's device and sampling draws from a device generator;
        # only the token ids and log-probs of the finished batch are copied to the host
        dev = device()
        tokens = torch.full((B, max_len), self.pad_token_id, dtype=torch.long)
        valid = torch.zeros(B, max_len, dtype=torch.bool)
        for i, p in enumerate(seqs):
            tokens[i, P - len(p):P] = torch.tensor(p)
            valid[i, P - len(p):P] = True
        tokens, valid = to_device(tokens, dev), to_device(valid, dev)
        # an explicit seed makes the samples a function of (seed, prompts, weights) alone, so a
        # resumed run draws exactly what the uninterrupted run would have drawn
        seed = params.seed if params.seed is not None else torch.seed() % (2 ** 31)
        gen = torch.Generator(device=dev).manual_seed(seed)
        stop_ids = to_device(sorted(set(params.stop_token_ids)), dev, torch.long)
        finished = torch.zeros(B, dtype=torch.bool, device=dev)
        new_logprobs = torch.zeros(B, params.max_new_tokens, device=dev)
        lengths = torch.zeros(B, dtype=torch.long, device=dev)
        hit_stop = torch.zeros(B, dtype=torch.bool, device=dev)
        eye = torch.eye(max_len, dtype=torch.bool, device=dev)
        causal = torch.ones(max_len, max_len, dtype=torch.bool, device=dev).tril()
        # positions counted from each prompt's first real token (pads left of it: 0, masked)
        pads = to_device([P - len(p) for p in seqs], dev)
        pos = (torch.arange(max_len, device=dev)[None, :] - pads[:, None]).clamp(min=0)
        decoder = KVDecoder(self.policy, len(prompts), max_len) if self.kv_cache else None
        routes = None  # [B, max_len, M, k]: the experts each forwarded position was routed to
        if params.return_routed_experts:
            routes = self._routes_buffer(B, max_len, dev)
        lockstep = self.policy.ep_size > 1 and dist.is_initialized()
        allowed = valid  # set at t == 0 (the whole prefix), then per step
        aborted = False
        for t in range(params.max_new_tokens):
            s = P + t
            v = valid[:, :s]
            if decoder is None or t == 0:  # the whole prefix: causal, pads hidden
                allowed = (causal[:s, :s] & v[:, None, :]) | eye[:s, :s]
            recorded: list | None = [] if routes is not None else None  # this step's experts
            if decoder is None:  # full recompute of the prefix
                logits = self.policy.last_token_logits(tokens[:, :s], ~allowed[:, None],
                                                       pos[:, :s], routes_out=recorded)
            elif t == 0:  # prefill with each distinct prompt once, then one cache row per sample
                logits = decoder.forward(tokens[::n, :s], pos[::n, :s], allowed[::n, None],
                                         routes=recorded)
                decoder.repeat_rows(n)
                logits = logits.repeat_interleave(n, 0)
            else:  # one new query (position s-1) over the s cached keys, pads hidden
                allowed = v.clone()
                allowed[:, s - 1] = True
                logits = decoder.forward(tokens[:, s - 1:s], pos[:, s - 1:s],
                                         allowed[:, None, None], routes=recorded)
            if routes is not None and recorded:  # the prompt at t == 0, then the new token
                first = 0 if t == 0 else s - 1
                got = recorded[0][:, -(s - first):]  # [rows, s - first, M, k]
                if got.shape[0] != B:  # the prefill's one row per prompt
                    got = got.repeat_interleave(n, 0)
                routes[:, first:s] = got.to(routes.dtype)
            if self.policy.is_sampler:  # one rank decides, every rank of the group follows
                nxt, lp = sample_tokens(logits, params, gen)
            else:
                nxt = torch.zeros(B, dtype=torch.long, device=dev)
                lp = torch.zeros(B, device=dev)
            nxt = self.policy.broadcast_from_sampler(nxt, (B,), torch.long)
            lp = self.policy.broadcast_from_sampler(lp.float(), (B,), torch.float32)
            active = ~finished
            tokens[:, s] = torch.where(active, nxt, tokens[:, s])
            valid[:, s] |= active
            new_logprobs[:, t] = torch.where(active, lp, new_logprobs[:, t])
            lengths += active.long()
            stopped = active & torch.isin(nxt, stop_ids)
            hit_stop |= stopped
            finished |= stopped
            done = finished.all()
            if lockstep:  # expert-parallel peers run every forward together
                done = done.to(torch.int32)
                dist.all_reduce(done, op=dist.ReduceOp.MIN)
            if bool(done):  # the one host sync per decoding step
                break
            if interrupt is not None and t + 1 < params.max_new_tokens and interrupt():
                aborted = True
                break
        tokens, new_logprobs = tokens[:, P:].cpu(), new_logprobs.cpu()
        routes = None if routes is None else routes.cpu()
        lengths, hit_stop = lengths.cpu(), hit_stop.cpu()
        open_rows = (~finished).cpu() if aborted else torch.zeros(B, dtype=torch.bool)
        out: list[list[Completion]] = []
        for i in range(B):
            n_i = int(lengths[i])
            reason = "stop" if bool(hit_stop[i]) else "abort" if bool(open_rows[i]) else "length"
            c = Completion(token_ids=tokens[i, :n_i].tolist(),
                           rollout_logprobs=new_logprobs[i, :n_i].tolist(), finish_reason=reason)
            if routes is not None:  # prompt + response, less the last token (never fed in)
                c.routed_experts = routes[i, P - len(seqs[i]):P + n_i - 1]
            if i % n == 0:
                out.append([])
            out[-1].append(c)
        return out

