"""KV-cached incremental decoding over the live weights of a megatron-core GPT (one pipeline stage).

The in-process rollout engine samples from the model that trains. Running a one-token decode
step through megatron-core's modules costs far more in per-module Python than in arithmetic for
the batch sizes of a rollout (measured on the CPU benchmark: ~10 ms per step of 40 sequences,
mostly module dispatch, re-rotation of every cached key and GQA head repetition). `KVDecoder`
reads this rank's parameter tensors of that very model (no copy, so no weight sync: an optimizer
step is seen by the next call) and runs the same arithmetic with a preallocated cache:

    x = E[token]                                                     (vocab-parallel lookup)
    per layer:  h = RMSNorm(x);  q, k, v = split_groups(W_qkv h + b_qkv)
                [Qwen3: q, k = RMSNorm_head(q), RMSNorm_head(k)]
                q, k = RoPE(q, pos), RoPE(k, pos);  K, V <- cache[:, :, :t] ++ (k, v)
                x = x + W_proj softmax(q K^T / sqrt(d) + mask) V                   (sum over TP)
                h = RMSNorm(x);  g, u = W_fc1 h;  x = x + W_fc2 (silu(g) * u)      (sum over TP)
                [mixture of experts: z = W_router h;  e_1..e_k = top-k of z (pre-softmax routers:
                 of softmax(z));  w = softmax(z_e1..z_ek) (pre-softmax: softmax(z)_e1..ek);
                 x = x + sum_j w_j W_fc2^(e_j) (silu(g) * u)^(e_j)                 (sum over TP)]
    logits = W_out RMSNorm(x)[:, -1]                                 (gathered over TP)

with megatron-core's layouts (megatron_rl.models.hf_mapping): W_qkv rows grouped per query
group as [q heads of the group; k; v]; W_fc1 = [gate; up] of this TP rank. Rotary frequencies
come from the model's own RotaryEmbedding (theta and Llama-3.1 scaling included). Keys are
cached after rotation, at positions counted from each sequence's first real token, so left
padding (masked) changes nothing. Tensor parallelism works on the local shards with one
all-reduce after the attention and MLP outputs; sequence parallelism needs no special case
(weights are the same). Agreement with megatron-core's forward: tests/unit/models/test_decode.py.

Mixture-of-experts layers (Qwen3-MoE) compute megatron-core's softmax top-k router on the same
weights (the router is replicated over TP, each expert split like a dense MLP) and send each token
through its k experts; `forward(..., routes=list)` also returns the chosen experts of every new
position, which the rollout engine hands to routing replay (megatron_rl.models.routing).

Supported: the Qwen2 / Qwen3 / Qwen3-MoE / Llama models megatron_rl.models builds (RMSNorm,
SwiGLU, RoPE, GQA, qkv bias, q/k norms, tied or untied output, softmax-routed experts),
pipeline-parallel size 1, expert-parallel size 1. `unsupported_reason` says why not.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_rl.models import hf_mapping


def unsupported_reason(policy) -> str | None:
    """None when `KVDecoder(policy, ...)` can run, otherwise why not."""
    if policy.pp_size != 1:
        return "KV-cached decoding needs pipeline-parallel size 1"
    cfg = policy.config
    if not (cfg.gated_linear_unit and cfg.normalization == "RMSNorm"):
        return "KV-cached decoding supports RMSNorm + SwiGLU models only"
    if getattr(cfg, "num_moe_experts", None):
        if policy.ep_size != 1:
            return "KV-cached decoding of mixture-of-experts layers needs expert-parallel size 1"
        if cfg.moe_router_score_function != "softmax" or cfg.moe_router_num_groups:
            return "KV-cached decoding supports softmax top-k routers only"
    if getattr(cfg, "rotary_interleaved", False):
        return "KV-cached decoding supports non-interleaved RoPE only"
    return None


class KVDecoder:
    """One generation's KV cache plus the forward that fills it.

    decoder = KVDecoder(policy, batch_size=B, max_len=S)
    logits = decoder.forward(tokens [B, s], positions [B, s], allowed [B, 1, s, t + s])
    appends s positions to the cache (t = positions already cached) and returns the fp32
    full-vocabulary logits [B, V] of the last new position, on every TP rank. `allowed` is
    boolean, True = may attend (causality and padding both expressed in it).
    """

    def __init__(self, policy, batch_size: int, max_len: int):
        """batch_size: rows of the first `forward` (the prefill); `repeat_rows` may grow it."""
        reason = unsupported_reason(policy)
        if reason:
            raise ValueError(reason)
        model = policy.module
        cfg = policy.config
        self.eps = cfg.layernorm_epsilon
        self.tp_size, self.tp_group = policy.tp_size, policy.tp_group
        self.vocab_start = policy.vocab_start
        self.n_heads = cfg.num_attention_heads // self.tp_size
        self.n_groups = cfg.num_query_groups // self.tp_size
        self.head_dim = cfg.kv_channels
        self.scale = self.head_dim ** -0.5
        # parameter tensors by megatron local-spec name (TE names mapped), shared with the model
        p = hf_mapping.from_te_names(dict(model.state_dict(keep_vars=True)))
        p = {k: v.detach() for k, v in p.items() if v is not None and not k.endswith("_extra_state")}
        self.embedding = p["embedding.word_embeddings.weight"]
        self.final_norm = p["decoder.final_layernorm.weight"]
        self.output = p.get("output_layer.weight", self.embedding)
        self.layers = []
        for i in range(len(model.decoder.layers)):
            pre = f"decoder.layers.{i}."
            self.layers.append({k: p.get(pre + k) for k in (
                "input_layernorm.weight", "self_attention.linear_qkv.weight",
                "self_attention.linear_qkv.bias", "self_attention.linear_proj.weight",
                "pre_mlp_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight",
                "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight",
                "mlp.router.weight")})
            if self.layers[-1]["mlp.router.weight"] is not None:  # the experts, in id order
                n_experts = cfg.num_moe_experts
                self.layers[-1]["experts"] = [
                    (p[f"{pre}mlp.experts.local_experts.{e}.linear_fc1.weight"],
                     p[f"{pre}mlp.experts.local_experts.{e}.linear_fc2.weight"])
                    for e in range(n_experts)]
        self.topk = getattr(cfg, "moe_router_topk", 0)
        self.pre_softmax = getattr(cfg, "moe_router_pre_softmax", False)
        dev, dtype = self.embedding.device, self.embedding.dtype
        rot = model.rotary_pos_emb(max_len).reshape(max_len, -1).to(dev)  # [S, rot_dim] angles
        self.cos, self.sin = rot.cos().to(dtype), rot.sin().to(dtype)
        shape = (batch_size, self.n_groups, max_len, self.head_dim)
        self.cache = [(torch.empty(shape, device=dev, dtype=dtype),
                       torch.empty(shape, device=dev, dtype=dtype)) for _ in self.layers]
        self.length = 0

    # -- pieces ----------------------------------------------------------------------------------
    def _tp_sum(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(tokens, self.embedding)
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.embedding.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.embedding)
        return self._tp_sum(x.masked_fill(outside[..., None], 0.0))

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, s, n, d]; cos/sin [B, s, 1, rot_dim]: rotate_half form on the first rot_dim."""
        rot_dim = cos.shape[-1]
        xr, x_pass = x[..., :rot_dim], x[..., rot_dim:]
        x1, x2 = xr.chunk(2, dim=-1)
        out = xr * cos + torch.cat((-x2, x1), dim=-1) * sin
        return out if x_pass.shape[-1] == 0 else torch.cat((out, x_pass), dim=-1)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.output).float()
        if self.tp_size == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
        dist.all_gather(parts, logits.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)

    def repeat_rows(self, n: int) -> None:
        """Each cached row becomes n consecutive rows (row i -> rows i*n .. i*n+n-1): a prompt
        prefilled once serves its n samples (the group shares the prompt)."""
        if n > 1:
            self.cache = [(k.repeat_interleave(n, 0), v.repeat_interleave(n, 0))
                          for k, v in self.cache]

    def _experts(self, h: torch.Tensor, w: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """A mixture-of-experts MLP on h [B, s, H]: (this TP rank's partial output [B, s, H],
        the chosen experts [B, s, k]), as megatron-core's softmax top-k router and experts.

        Each token's output is sum_j g_j expert_{e_j}(h), accumulated over the experts in id
        order, computed one of two ways with the same per-token arithmetic:
        - a decode step (s == 1): every expert runs on every token, and tokens an expert was
          not chosen for add 0. Nothing is read back to the host, where selecting each
          expert's tokens takes one host synchronisation per expert and layer at every step
          (the host waits for the device E times a layer). The price: E/k times the expert
          FLOPs, while a step of B single tokens reads the weights of every expert they chose
          (up to B * k of E: most of them in a rollout batch) either way; a step large enough
          to be bound by those FLOPs would want a grouped GEMM over device-side offsets.
        - several positions per row (the prefill, once per generation): each expert runs on
          its own tokens only, gathered by a stable sort of the (token, choice) pairs by expert
          (tokens ascending within an expert); the per-expert token counts are read to the host
          once per layer.
        """
        z = F.linear(h, w["mlp.router.weight"])  # [B, s, E]
        if self.pre_softmax:
            gates, idx = torch.softmax(z, dim=-1, dtype=torch.float32).type_as(z).topk(self.topk)
        else:
            top, idx = z.topk(self.topk)
            gates = torch.softmax(top, dim=-1, dtype=torch.float32).type_as(z)
        flat_h, flat_idx, flat_g = h.reshape(-1, h.shape[-1]), idx.reshape(-1, self.topk), \
            gates.reshape(-1, self.topk)
        out = torch.zeros_like(flat_h)
        if h.shape[1] == 1:
            for e, (fc1, fc2) in enumerate(w["experts"]):
                hit = flat_idx == e  # [tokens, k]
                gate, up = F.linear(flat_h, fc1).chunk(2, dim=-1)
                y = F.linear(F.silu(gate) * up, fc2)
                weight = (flat_g * hit).sum(-1, keepdim=True)  # g of expert e, 0 if not chosen
                out += torch.where(hit.any(-1, keepdim=True), y * weight, 0.0)
            return out.view_as(h), idx
        pairs = flat_idx.reshape(-1)  # [tokens * k], token-major
        order = torch.sort(pairs, stable=True).indices
        counts = torch.zeros(len(w["experts"]), dtype=torch.long, device=pairs.device)
        counts = counts.scatter_add_(0, pairs, torch.ones_like(pairs)).tolist()  # the one sync
        tokens_by_expert = (order // self.topk).split(counts)
        gates_by_expert = flat_g.reshape(-1)[order].split(counts)
        for (fc1, fc2), rows, g in zip(w["experts"], tokens_by_expert, gates_by_expert):
            if rows.numel() == 0:
                continue
            gate, up = F.linear(flat_h[rows], fc1).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, fc2)
            out.index_add_(0, rows, y * g[:, None])
        return out.view_as(h), idx

    # -- the forward -----------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor,
                allowed: torch.Tensor, routes: list | None = None) -> torch.Tensor:
        """routes: a list that receives the chosen experts of the new positions, [B, s, M, k]
        (M = the model's mixture-of-experts layers), when the model has any."""
        B, s = tokens.shape
        chosen = []
        t0, t1 = self.length, self.length + s
        if t1 > self.cos.shape[0]:
            raise ValueError(f"KV cache holds {self.cos.shape[0]} positions, asked for {t1}")
        dev = self.embedding.device
        tokens, positions, allowed = tokens.to(dev), positions.to(dev), allowed.to(dev)
        cos, sin = self.cos[positions][:, :, None], self.sin[positions][:, :, None]
        ng, qpg, d = self.n_groups, self.n_heads // self.n_groups, self.head_dim
        x = self._embed(tokens)
        for w, (k_cache, v_cache) in zip(self.layers, self.cache):
            h = torch.rms_norm(x, (x.shape[-1],), w["input_layernorm.weight"], self.eps)
            qkv = F.linear(h, w["self_attention.linear_qkv.weight"],
                           w["self_attention.linear_qkv.bias"]).view(B, s, ng, qpg + 2, d)
            q, k = qkv[:, :, :, :qpg].reshape(B, s, ng * qpg, d), qkv[:, :, :, qpg]
            if w["self_attention.q_layernorm.weight"] is not None:  # Qwen3: per-head RMSNorm
                q = torch.rms_norm(q, (d,), w["self_attention.q_layernorm.weight"], self.eps)
                k = torch.rms_norm(k, (d,), w["self_attention.k_layernorm.weight"], self.eps)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            k_cache[:, :, t0:t1] = k.transpose(1, 2)
            v_cache[:, :, t0:t1] = qkv[:, :, :, qpg + 1].transpose(1, 2)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k_cache[:, :, :t1],
                                               v_cache[:, :, :t1], attn_mask=allowed,
                                               scale=self.scale, enable_gqa=qpg > 1)
            a = a.transpose(1, 2).reshape(B, s, ng * qpg * d)
            x = x + self._tp_sum(F.linear(a, w["self_attention.linear_proj.weight"]))
            h = torch.rms_norm(x, (x.shape[-1],), w["pre_mlp_layernorm.weight"], self.eps)
            if w["mlp.router.weight"] is not None:
                partial, idx = self._experts(h, w)
                chosen.append(idx)
                x = x + self._tp_sum(partial)
                continue
            gate, up = F.linear(h, w["mlp.linear_fc1.weight"]).chunk(2, dim=-1)
            x = x + self._tp_sum(F.linear(F.silu(gate) * up, w["mlp.linear_fc2.weight"]))
        if routes is not None and chosen:
            routes.append(torch.stack(chosen, dim=2))
        self.length = t1
        x = torch.rms_norm(x[:, -1], (x.shape[-1],), self.final_norm, self.eps)
        return self._logits(x)
