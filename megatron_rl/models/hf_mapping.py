"""The one HF <-> Megatron weight mapping (Qwen2 / Qwen3 / Qwen3-MoE / Llama), used by the
conversion tools and by weight sync to rollout servers.

Three layers, each a plain function on state dicts:
1. `hf_to_megatron` / `megatron_to_hf`: full (unsharded) tensors, megatron-core local-spec names
   with global layer numbers. Layout changes:
   - QKV: per query group g, [q heads of g; k_g; v_g] stacked along the output dim, i.e. q viewed as
     [ng, nh/ng, d, h] and k, v as [ng, 1, d, h] concatenated on dim 1 -> [ng*(nh/ng+2)*d, h]
     (Qwen2's q/k/v biases the same way, without the h dim).
   - SwiGLU fc1 = cat([gate_proj, up_proj]) along the output dim.
   - Mixture-of-experts layers (Qwen3-MoE): the router `mlp.gate.weight` [E, h] is
     `mlp.router.weight`; expert e's `mlp.experts.e.{gate,up,down}_proj.weight` are
     `mlp.experts.local_experts.e.linear_fc1.weight` (cat(gate, up), as the dense fc1) and
     `...linear_fc2.weight`; the norm before the MLP is `pre_mlp_layernorm` as in dense layers.
     These are the names on disk: transformers 5 fuses a layer's experts in memory
     (`gate_up_proj` [E, 2 f, h], `down_proj` [E, h, f]) but its save_pretrained writes, and
     from_pretrained reads, the per-expert tensors.
2. `shard_for_rank` / `gather_shards`: TP slicing along each parameter's partition dim and PP
   selection of layers (global <-> local layer numbers); per tensor, `merge_tp_shards` and
   `full_name` undo the split and the renaming. Under TP, fc1 of rank r holds
   [gate_r; up_r], not a contiguous slice of the full fc1; each expert's fc1 / fc2 are split
   like the dense ones (expert-tensor-parallel size = TP), the router is replicated. Under
   expert parallelism (EP > 1) expert-parallel rank p holds the experts
   [p E/EP, (p + 1) E/EP) as local_experts.0 .. E/EP - 1 (global id = p E/EP + local id).
3. `check_state_dict`: every expected tensor present with the expected shape, or a ValueError that
   names the tensor and the expected and found shapes.
Plus HF safetensors I/O (sharded or single file), written atomically.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile

import torch

from megatron_rl.models.config import ModelArgs

# Partition kinds of megatron-core parameters under tensor parallelism.
REPLICATED, COLUMN, ROW, GATED_COLUMN = "replicated", "column", "row", "gated_column"

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# megatron local-spec suffix within a layer -> (HF suffix within a layer or None, partition kind)
_LAYER_PARAMS = {
    "input_layernorm.weight": ("input_layernorm.weight", REPLICATED),
    "self_attention.linear_qkv.weight": (None, COLUMN),
    "self_attention.linear_qkv.bias": (None, COLUMN),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight", ROW),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight", REPLICATED),
    "mlp.linear_fc1.weight": (None, GATED_COLUMN),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight", ROW),
}
# Qwen3's per-head RMSNorm of queries and keys (head_dim weights, the same on every TP rank).
_QK_NORM_PARAMS = {
    "self_attention.q_layernorm.weight": ("self_attn.q_norm.weight", REPLICATED),
    "self_attention.k_layernorm.weight": ("self_attn.k_norm.weight", REPLICATED),
}


_ALL_LAYER_PARAMS = {**_LAYER_PARAMS, **_QK_NORM_PARAMS}


_DENSE_MLP_PARAMS = ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight")
_ROUTER = "mlp.router.weight"
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")


_EXPERT_NAME_RE = re.compile(
    r"^(decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)(\d+)(\.linear_fc[12]\.weight)$")


def expert_range(args: ModelArgs, ep_size: int = 1, ep_rank: int = 0) -> range:
    """Global ids of the experts (of every sparse layer) that expert-parallel rank ep_rank holds."""
    if args.num_experts % ep_size:
        raise ValueError(f"--expert-model-parallel-size {ep_size} must divide num_experts "
                         f"({args.num_experts})")
    per = args.num_experts // ep_size
    return range(ep_rank * per, (ep_rank + 1) * per)


def is_expert_param(name: str) -> bool:
    """Whether megatron tensor `name` belongs to one expert (split by expert parallelism)."""
    return _EXPERT_NAME_RE.match(name) is not None


def _renumber_expert(name: str, offset: int) -> tuple[str, int] | None:
    """(name with its expert id shifted by `offset`, the original id); None for a non-expert."""
    m = _EXPERT_NAME_RE.match(name)
    if m is None:
        return None
    e = int(m.group(2))
    return f"{m.group(1)}{e + offset}{m.group(3)}", e


def _expert(e: int, which: str) -> str:
    """megatron suffix (within a layer) of expert e's linear_fc1 or linear_fc2 weight."""
    return f"mlp.experts.local_experts.{e}.{which}.weight"


def _layer_params(args: ModelArgs, layer: int = 0) -> dict[str, tuple[str | None, str]]:
    """The megatron suffix -> (HF suffix, partition kind) table of global layer `layer`: in a
    mixture-of-experts layer, the router and each expert's fc1 / fc2 instead of the dense MLP."""
    table = dict(_ALL_LAYER_PARAMS if args.qk_norm else _LAYER_PARAMS)
    if args.is_moe_layer(layer):
        for name in _DENSE_MLP_PARAMS:
            del table[name]
        table[_ROUTER] = ("mlp.gate.weight", REPLICATED)
        for e in range(args.num_experts):
            table[_expert(e, "linear_fc1")] = (None, GATED_COLUMN)
            table[_expert(e, "linear_fc2")] = (f"mlp.experts.{e}.down_proj.weight", ROW)
    return table


# TransformerEngine specs fuse the pre-norms into the following linear layer.
_TE_RENAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Full (TP=1) megatron parameter names -> shapes, all layers."""
    h, d = args.hidden_size, args.head_dim
    qkv_rows = (args.num_attention_heads + 2 * args.num_key_value_heads) * d
    shapes = {"embedding.word_embeddings.weight": (args.vocab_size, h),
              "decoder.final_layernorm.weight": (h,)}
    if not args.tie_word_embeddings:
        shapes["output_layer.weight"] = (args.vocab_size, h)
    for i in range(args.num_hidden_layers):
        p = f"decoder.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attention.linear_qkv.weight"] = (qkv_rows, h)
        if args.qkv_bias:
            shapes[p + "self_attention.linear_qkv.bias"] = (qkv_rows,)
        shapes[p + "self_attention.linear_proj.weight"] = (h, args.num_attention_heads * d)
        shapes[p + "pre_mlp_layernorm.weight"] = (h,)
        if args.is_moe_layer(i):
            f = args.moe_intermediate_size
            shapes[p + _ROUTER] = (args.num_experts, h)
            for e in range(args.num_experts):
                shapes[p + _expert(e, "linear_fc1")] = (2 * f, h)
                shapes[p + _expert(e, "linear_fc2")] = (h, f)
        else:
            shapes[p + "mlp.linear_fc1.weight"] = (2 * args.intermediate_size, h)
            shapes[p + "mlp.linear_fc2.weight"] = (h, args.intermediate_size)
        if args.qk_norm:
            shapes[p + "self_attention.q_layernorm.weight"] = (d,)
            shapes[p + "self_attention.k_layernorm.weight"] = (d,)
    return shapes


def hf_expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """HF parameter names -> shapes."""
    h, d = args.hidden_size, args.head_dim
    nq, nkv, f = args.num_attention_heads * d, args.num_key_value_heads * d, args.intermediate_size
    shapes = {"model.embed_tokens.weight": (args.vocab_size, h), "model.norm.weight": (h,)}
    if not args.tie_word_embeddings:
        shapes["lm_head.weight"] = (args.vocab_size, h)
    for i in range(args.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (nq, h), p + "self_attn.k_proj.weight": (nkv, h),
            p + "self_attn.v_proj.weight": (nkv, h), p + "self_attn.o_proj.weight": (h, nq),
        })
        if args.is_moe_layer(i):
            fe = args.moe_intermediate_size
            shapes[p + "mlp.gate.weight"] = (args.num_experts, h)
            for e in range(args.num_experts):
                x = f"{p}mlp.experts.{e}."
                shapes.update({x + "gate_proj.weight": (fe, h), x + "up_proj.weight": (fe, h),
                               x + "down_proj.weight": (h, fe)})
        else:
            shapes.update({p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                           p + "mlp.down_proj.weight": (h, f)})
        if args.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (nq,), p + "self_attn.k_proj.bias": (nkv,),
                           p + "self_attn.v_proj.bias": (nkv,)})
        if args.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
    return shapes


def check_state_dict(sd: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]],
                     source: str, allow_extra: bool = True) -> None:
    """Raise ValueError naming each missing tensor or shape mismatch (and the source)."""
    problems = []
    for name, shape in expected.items():
        if name not in sd:
            problems.append(f"missing tensor {name!r} (expected shape {list(shape)})")
        elif tuple(sd[name].shape) != tuple(shape):
            problems.append(f"tensor {name!r}: expected shape {list(shape)}, "
                            f"found {list(sd[name].shape)}")
    if not allow_extra:
        problems += [f"unexpected tensor {n!r}" for n in sd if n not in expected]
    if problems:
        raise ValueError(f"{source}: " + "; ".join(problems))


def _qkv_merge(q, k, v, args: ModelArgs) -> torch.Tensor:
    ng, d = args.num_key_value_heads, args.head_dim
    per_group = args.num_attention_heads // ng
    rest = q.shape[1:]
    q = q.reshape(ng, per_group, d, *rest)
    k = k.reshape(ng, 1, d, *rest)
    v = v.reshape(ng, 1, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(ng * (per_group + 2) * d, *rest)


def _qkv_split(qkv, args: ModelArgs):
    ng, d = args.num_key_value_heads, args.head_dim
    per_group = args.num_attention_heads // ng
    rest = qkv.shape[1:]
    qkv = qkv.reshape(ng, per_group + 2, d, *rest)
    q = qkv[:, :per_group].reshape(ng * per_group * d, *rest)
    k = qkv[:, per_group].reshape(ng * d, *rest)
    v = qkv[:, per_group + 1].reshape(ng * d, *rest)
    return q, k, v


_ANY_LAYER_RE = re.compile(r"(?:model|decoder)\.layers\.(\d+)\.")
_FIRST_STAGE = ("model.embed_tokens.weight", "embedding.word_embeddings.weight")
_LAST_STAGE = ("model.norm.weight", "decoder.final_layernorm.weight", "lm_head.weight",
               "output_layer.weight")


def stage_names(names, args: ModelArgs, pp_size: int = 1, pp_rank: int = 0) -> set[str]:
    """The HF or megatron tensor names (global layer numbers) that pipeline stage `pp_rank`
    needs: its layers, the embedding on the first stage (and on the last with tied
    embeddings), the final norm and output layer on the last."""
    layers = pp_layer_range(args, pp_size, pp_rank)
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    keep = set()
    for n in names:
        m = _ANY_LAYER_RE.match(n)
        if m:
            ok = int(m.group(1)) in layers
        elif n in _FIRST_STAGE:
            ok = first or (last and args.tie_word_embeddings)
        else:
            ok = last if n in _LAST_STAGE else True
        if ok:
            keep.add(n)
    return keep


def hf_to_megatron(hf: dict[str, torch.Tensor], args: ModelArgs,
                   source: str = "HF checkpoint", pp_size: int = 1,
                   pp_rank: int = 0) -> dict[str, torch.Tensor]:
    """HF state dict -> megatron state dict (global layer numbers): the full model, or with
    pp_size > 1 only what pipeline stage pp_rank needs (see stage_names; `hf` may hold only that)."""
    expected = hf_expected_shapes(args)
    wanted = stage_names(expected, args, pp_size, pp_rank)
    check_state_dict(hf, {n: s for n, s in expected.items() if n in wanted}, source)
    names = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
             "decoder.final_layernorm.weight": "model.norm.weight"}
    if not args.tie_word_embeddings:
        names["output_layer.weight"] = "lm_head.weight"
    out = {mg: hf[h] for mg, h in names.items() if h in wanted}
    for i in pp_layer_range(args, pp_size, pp_rank):
        hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
        for mg_suffix, (hf_suffix, _) in _layer_params(args, i).items():
            if hf_suffix is not None:
                out[mp + mg_suffix] = hf[hp + hf_suffix]
        a = hp + "self_attn."
        out[mp + "self_attention.linear_qkv.weight"] = _qkv_merge(
            hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"], args)
        if args.qkv_bias:
            out[mp + "self_attention.linear_qkv.bias"] = _qkv_merge(
                hf[a + "q_proj.bias"], hf[a + "k_proj.bias"], hf[a + "v_proj.bias"], args)
        if args.is_moe_layer(i):
            for e in range(args.num_experts):
                x = f"{hp}mlp.experts.{e}."
                out[mp + _expert(e, "linear_fc1")] = torch.cat(
                    [hf[x + "gate_proj.weight"], hf[x + "up_proj.weight"]], dim=0)
        else:
            out[mp + "mlp.linear_fc1.weight"] = torch.cat(
                [hf[hp + "mlp.gate_proj.weight"], hf[hp + "mlp.up_proj.weight"]], dim=0)
    return {k: v.contiguous() for k, v in out.items()}


def megatron_to_hf(mg: dict[str, torch.Tensor], args: ModelArgs,
                   source: str = "Megatron checkpoint") -> dict[str, torch.Tensor]:
    """Full megatron state dict (global layer numbers) -> full HF state dict."""
    mg = {k: v for k, v in mg.items() if not k.endswith("_extra_state")}
    check_state_dict(mg, expected_shapes(args), source)
    out = {"model.embed_tokens.weight": mg["embedding.word_embeddings.weight"],
           "model.norm.weight": mg["decoder.final_layernorm.weight"]}
    if not args.tie_word_embeddings:
        out["lm_head.weight"] = mg["output_layer.weight"]
    for i in range(args.num_hidden_layers):
        hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
        for mg_suffix, (hf_suffix, _) in _layer_params(args, i).items():
            if hf_suffix is not None:
                out[hp + hf_suffix] = mg[mp + mg_suffix]
        a = hp + "self_attn."
        q, k, v = _qkv_split(mg[mp + "self_attention.linear_qkv.weight"], args)
        out.update({a + "q_proj.weight": q, a + "k_proj.weight": k, a + "v_proj.weight": v})
        if args.qkv_bias:
            q, k, v = _qkv_split(mg[mp + "self_attention.linear_qkv.bias"], args)
            out.update({a + "q_proj.bias": q, a + "k_proj.bias": k, a + "v_proj.bias": v})
        if args.is_moe_layer(i):
            f = args.moe_intermediate_size
            for e in range(args.num_experts):
                fc1, x = mg[mp + _expert(e, "linear_fc1")], f"{hp}mlp.experts.{e}."
                out[x + "gate_proj.weight"], out[x + "up_proj.weight"] = fc1[:f], fc1[f:]
        else:
            f = args.intermediate_size
            fc1 = mg[mp + "mlp.linear_fc1.weight"]
            out[hp + "mlp.gate_proj.weight"], out[hp + "mlp.up_proj.weight"] = fc1[:f], fc1[f:]
    return {k: v.contiguous() for k, v in out.items()}


def partition_kind(name: str) -> str:
    """How a megatron parameter (local-spec name) is split under tensor parallelism."""
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return COLUMN  # vocab-parallel along dim 0
    m = _LAYER_RE.match(name)
    if m:
        suffix = m.group(2)
        for te_name, local in ((v, k) for k, v in _TE_RENAMES.items()):
            if suffix == te_name:
                suffix = local
        if suffix in _ALL_LAYER_PARAMS:
            return _ALL_LAYER_PARAMS[suffix][1]
        expert = _EXPERT_RE.match(suffix)
        if expert:  # split like the dense MLP's fc1 / fc2
            return GATED_COLUMN if expert.group(2) == "linear_fc1" else ROW
    return REPLICATED  # norms, the router


def _split(t: torch.Tensor, kind: str, tp: int, r: int) -> torch.Tensor:
    if kind == COLUMN:
        return t.chunk(tp, dim=0)[r]
    if kind == ROW:
        return t.chunk(tp, dim=1)[r]
    if kind == GATED_COLUMN:
        gate, up = t.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[r], up.chunk(tp, dim=0)[r]], dim=0)
    return t


def _merge(parts: list[torch.Tensor], kind: str) -> torch.Tensor:
    if kind == COLUMN:
        return torch.cat(parts, dim=0)
    if kind == ROW:
        return torch.cat(parts, dim=1)
    if kind == GATED_COLUMN:
        gates, ups = zip(*(p.chunk(2, dim=0) for p in parts))
        return torch.cat([*gates, *ups], dim=0)
    return parts[0]


def pp_layer_range(args: ModelArgs, pp_size: int, pp_rank: int) -> range:
    """Global layer numbers held by pipeline stage pp_rank (even split)."""
    per = args.num_hidden_layers // pp_size
    return range(pp_rank * per, (pp_rank + 1) * per)


def shard_for_rank(full: dict[str, torch.Tensor], args: ModelArgs, *, tp_size: int = 1,
                   tp_rank: int = 0, pp_size: int = 1, pp_rank: int = 0, ep_size: int = 1,
                   ep_rank: int = 0) -> dict[str, torch.Tensor]:
    """Full megatron state dict -> this (tp_rank, pp_rank, ep_rank)'s local state dict (local
    layer ids; with ep_size > 1 only this rank's experts, with local expert ids).

    With tied embeddings and PP > 1 the last stage also gets `output_layer.weight` (megatron keeps
    a copy of the embedding there).
    """
    if ep_size > 1:
        experts = expert_range(args, ep_size, ep_rank)
        local_experts = {}
        for name, t in full.items():
            renamed = _renumber_expert(name, -experts.start)
            if renamed is None:
                local_experts[name] = t
            elif renamed[1] in experts:
                local_experts[renamed[0]] = t
        full = local_experts
    layers = pp_layer_range(args, pp_size, pp_rank)
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    out = {}
    for name, t in full.items():
        m = _LAYER_RE.match(name)
        if m:
            g = int(m.group(1))
            if g not in layers:
                continue
            local_name = f"decoder.layers.{g - layers.start}.{m.group(2)}"
        elif name == "embedding.word_embeddings.weight":
            if first:
                out[name] = _split(t, COLUMN, tp_size, tp_rank).clone()
            if last and not first and args.tie_word_embeddings:
                out["output_layer.weight"] = _split(t, COLUMN, tp_size, tp_rank).clone()
            continue
        elif name in ("decoder.final_layernorm.weight", "output_layer.weight"):
            if not last:
                continue
            local_name = name
        else:
            local_name = name
        out[local_name] = _split(t, partition_kind(name), tp_size, tp_rank).clone()
    return out


def merge_tp_shards(parts: list[torch.Tensor], name: str) -> torch.Tensor:
    """Local tensor `name`'s shards of every TP rank (in TP rank order) -> the unsplit tensor
    (the inverse of shard_for_rank's split; a replicated tensor is TP rank 0's)."""
    return _merge(parts, partition_kind(name))


def full_name(name: str, args: ModelArgs, pp_size: int = 1, pp_rank: int = 0, ep_size: int = 1,
              ep_rank: int = 0) -> str | None:
    """The full state dict's name (global layer and expert ids) of local tensor `name` of
    pipeline stage pp_rank and expert-parallel rank ep_rank: the inverse of shard_for_rank's
    renaming. None for a local tensor that the full state dict takes from another rank: the
    last stage's copy of a tied embedding, and on expert-parallel ranks p > 0 everything but
    their experts (expert-parallel rank 0 holds the same)."""
    local_name = name
    if ep_size > 1:
        renamed = _renumber_expert(name, expert_range(args, ep_size, ep_rank).start)
        if renamed is None and ep_rank > 0:
            return None
        local_name = name if renamed is None else renamed[0]
    if args.tie_word_embeddings and name == "output_layer.weight":
        return None
    m = _LAYER_RE.match(local_name)
    if m is None:
        return local_name
    offset = pp_layer_range(args, pp_size, pp_rank).start
    return f"decoder.layers.{int(m.group(1)) + offset}.{m.group(2)}"


def gather_shards(shards: dict[tuple[int, ...], dict[str, torch.Tensor]], args: ModelArgs,
                  tp_size: int, pp_size: int, ep_size: int = 1) -> dict[str, torch.Tensor]:
    """Inverse of shard_for_rank: {(tp_rank, pp_rank): local state dict} -> full state dict.
    With ep_size > 1 the keys are (tp_rank, pp_rank, ep_rank); expert-parallel rank p > 0 need
    only hold its experts (the other tensors are taken from p = 0)."""
    full = {}
    for pp_rank in range(pp_size):
        for ep_rank in range(ep_size):
            key = (pp_rank, ep_rank) if ep_size > 1 else (pp_rank,)
            for name in shards[(0, *key)]:
                if name.endswith("_extra_state"):
                    continue
                global_name = full_name(name, args, pp_size, pp_rank, ep_size, ep_rank)
                if global_name is not None:
                    full[global_name] = merge_tp_shards(
                        [shards[(r, *key)][name] for r in range(tp_size)], name)
    return full


def _rename_layer_suffixes(sd: dict[str, torch.Tensor], renames: dict[str, str]):
    out = {}
    for name, t in sd.items():
        m = _LAYER_RE.match(name)
        if m and m.group(2) in renames:
            name = f"decoder.layers.{m.group(1)}.{renames[m.group(2)]}"
        out[name] = t
    return out


def to_te_names(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename local-spec layer norms to the TransformerEngine spec's fused names."""
    return _rename_layer_suffixes(sd, _TE_RENAMES)


def from_te_names(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of to_te_names."""
    return _rename_layer_suffixes(sd, {v: k for k, v in _TE_RENAMES.items()})


# ---------------------------------------------------------------------------------------------
# HF safetensors I/O
# ---------------------------------------------------------------------------------------------

def load_hf_state_dict(path: str, names=None) -> dict[str, torch.Tensor]:
    """Load `model.safetensors` or the shards listed in `model.safetensors.index.json`; with
    `names` only those tensors (the others are never read: safetensors maps the files and
    copies out just the tensors asked for, so ranks on one node share the page cache)."""
    from safetensors import safe_open

    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(single):
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
    sd = {}
    for fn in files:
        full = os.path.join(path, fn)
        if not os.path.exists(full):
            raise FileNotFoundError(f"{index}: lists shard {fn!r}, which does not exist")
        with safe_open(full, framework="pt") as f:
            for name in f.keys():
                if names is None or name in names:
                    sd[name] = f.get_tensor(name)
    return sd


def save_hf_checkpoint(sd: dict[str, torch.Tensor], args: ModelArgs, path: str,
                       extra_files: tuple[str, ...] = (), max_shard_bytes: int = 4 << 30,
                       dtype: torch.dtype | None = None) -> None:
    """Write config.json + safetensors (sharded above max_shard_bytes) atomically.

    Files go to a temporary sibling directory first, which replaces `path` by rename, so an
    interrupted export never leaves a half-written checkpoint. `extra_files` (e.g. tokenizer
    files) are copied alongside.
    """
    from safetensors.torch import save_file

    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-" + os.path.basename(path) + "-", dir=parent)
    try:
        tensors = {k: (v.to(dtype) if dtype is not None else v).detach().cpu().contiguous()
                   for k, v in sd.items()}
        shards, cur, size = [], {}, 0
        for k in sorted(tensors):
            nbytes = tensors[k].numel() * tensors[k].element_size()
            if cur and size + nbytes > max_shard_bytes:
                shards.append(cur)
                cur, size = {}, 0
            cur[k], size = tensors[k], size + nbytes
        shards.append(cur)
        if len(shards) == 1:
            save_file(shards[0], os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, os.path.join(tmp, fn), metadata={"format": "pt"})
                weight_map.update({k: fn for k in shard})
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
        cfg = args.to_hf_config()
        if dtype is not None:
            cfg["torch_dtype"] = str(dtype).replace("torch.", "")
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        for fn in extra_files:
            shutil.copy(fn, tmp)
        if os.path.exists(path):
            old = path + ".old"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(path, old)
            os.rename(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
