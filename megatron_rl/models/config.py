"""Model architecture read from a Hugging Face `config.json` (Qwen2, Qwen3, Qwen3-MoE and Llama
families).

`ModelArgs` is the one description of the architecture used everywhere: it builds megatron-core's
`TransformerConfig`, drives the HF <-> Megatron weight mapping, and is written back into
`config.json` on export.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch

from megatron_rl.parallel import ParallelConfig, use_cuda

SUPPORTED_ARCHITECTURES = {
    # HF architecture name -> family
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "LlamaForCausalLM": "llama",
}


@dataclasses.dataclass
class ModelArgs:
    """Decoder-only transformer hyper-parameters, in HF terms.

    Shapes: head_dim = hidden_size / num_attention_heads unless given; the KV projection has
    num_key_value_heads * head_dim rows (grouped-query attention when fewer than query heads).

    Mixture of experts (Qwen3-MoE, num_experts > 0): layer i is sparse iff i is not in
    mlp_only_layers and (i + 1) % decoder_sparse_step == 0 (transformers' rule); a sparse
    layer's MLP is a softmax router over num_experts SwiGLU experts of moe_intermediate_size,
    num_experts_per_tok of them per token, their weights renormalised to sum to 1 when
    norm_topk_prob. Dense layers keep the intermediate_size MLP.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 has q/k/v biases; Llama has none (attention_bias=False)
    qk_norm: bool = False   # Qwen3: RMSNorm over head_dim on each query and key head, before RoPE
    rope_scaling_factor: float | None = None  # Llama-3.1 style ("llama3") rope scaling
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str = "float32"
    num_experts: int = 0  # 0: a dense model
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.0  # the checkpoint's (pretraining) value, kept for export
    hf_config: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer `layer` (0-based) has a mixture-of-experts MLP."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def moe_layer_pattern(self) -> list[int]:
        """Per layer, 1 for a mixture-of-experts MLP and 0 for a dense one (megatron-core's
        moe_layer_freq as a list)."""
        return [int(self.is_moe_layer(i)) for i in range(self.num_hidden_layers)]

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], source: str = "config.json") -> "ModelArgs":
        """Parse a HF config dict; raise ValueError naming the file and field on bad input."""
        archs = config.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"{source}: unsupported architecture {arch!r} (field 'architectures'); "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )

        def need(key):
            if key not in config:
                raise ValueError(f"{source}: missing required field {key!r} for {arch}")
            return config[key]

        n_heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        head_dim = config.get("head_dim") or hidden // n_heads
        family = SUPPORTED_ARCHITECTURES[arch]
        qkv_bias = True if family == "qwen2" else bool(config.get("attention_bias", False))
        if config.get("mlp_bias"):
            raise ValueError(f"{source}: mlp_bias=True is not supported (field 'mlp_bias')")
        if family in ("qwen2", "qwen3", "qwen3_moe") and config.get("use_sliding_window"):
            raise ValueError(f"{source}: sliding-window attention is not supported "
                             "(field 'use_sliding_window')")
        moe = cls._moe_fields(config, source, arch) if family == "qwen3_moe" else {}

        # transformers >= 4.5x moved rope_theta/rope_scaling into 'rope_parameters'.
        rope = dict(config.get("rope_parameters") or {})
        rope_theta = config.get("rope_theta", rope.get("rope_theta", 10000.0))
        scaling = config.get("rope_scaling") or (rope if rope.get("rope_type") not in
                                                  (None, "default") else None)
        factor = None
        if scaling:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind == "default":
                pass
            elif kind != "llama3" or (
                scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0),
                scaling.get("original_max_position_embeddings", 8192)) != (1.0, 4.0, 8192):
                raise ValueError(
                    f"{source}: unsupported rope scaling {scaling!r} (field 'rope_scaling'); only "
                    "llama3 scaling with low/high freq factors 1/4 and original length 8192 is "
                    "supported")
            else:
                factor = float(scaling["factor"])
        return cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=n_heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or n_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=family in ("qwen3", "qwen3_moe"),
            rope_scaling_factor=factor,
            bos_token_id=config.get("bos_token_id"),
            eos_token_id=config.get("eos_token_id"),
            torch_dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"),
            **moe,
            hf_config=dict(config),
        )

    @staticmethod
    def _moe_fields(config: dict[str, Any], source: str, arch: str) -> dict[str, Any]:
        """The mixture-of-experts fields of a Qwen3-MoE config. transformers 5 writes the expert
        count as num_local_experts, released checkpoints as num_experts; the optional fields
        take transformers' class defaults."""
        experts = config.get("num_experts", config.get("num_local_experts"))
        if experts is None:
            raise ValueError(f"{source}: missing required field 'num_experts' for {arch}")
        for key in ("num_experts_per_tok", "moe_intermediate_size"):
            if key not in config:
                raise ValueError(f"{source}: missing required field {key!r} for {arch}")
        experts, topk = int(experts), int(config["num_experts_per_tok"])
        if experts < 1 or not 1 <= topk <= experts:
            raise ValueError(f"{source}: num_experts_per_tok must be between 1 and num_experts "
                             f"({experts}), got {topk} (field 'num_experts_per_tok')")
        norm = bool(config.get("norm_topk_prob", False))
        if topk == 1 and norm:
            # renormalising one weight gives 1.0; megatron-core's softmax router with top-1
            # takes the softmax before the top-k only (transformer_config.py:1634-1641)
            raise ValueError(f"{source}: num_experts_per_tok=1 with norm_topk_prob=True is not "
                             "supported (field 'norm_topk_prob')")
        step = int(config.get("decoder_sparse_step") or 1)
        if step < 1:
            raise ValueError(f"{source}: decoder_sparse_step must be >= 1, got {step}")
        return dict(num_experts=experts, num_experts_per_tok=topk,
                    moe_intermediate_size=int(config["moe_intermediate_size"]),
                    norm_topk_prob=norm, decoder_sparse_step=step,
                    mlp_only_layers=tuple(int(i) for i in config.get("mlp_only_layers") or ()),
                    router_aux_loss_coef=float(config.get("router_aux_loss_coef", 0.001)))

    @classmethod
    def from_pretrained(cls, path: str) -> "ModelArgs":
        """Read `<path>/config.json` (or a config.json path)."""
        cfg_path = path if path.endswith(".json") else os.path.join(path, "config.json")
        if not os.path.exists(cfg_path):
            raise FileNotFoundError(f"no HF config at {cfg_path}")
        with open(cfg_path) as f:
            try:
                config = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{cfg_path}: invalid JSON: {e}") from e
        return cls.from_hf_config(config, source=cfg_path)

    def to_hf_config(self) -> dict:
        """The HF config.json dict for this architecture (original fields kept)."""
        cfg = dict(self.hf_config)
        cfg.update(
            architectures=[self.architecture],
            model_type=self.family,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
        )
        if "rope_parameters" not in cfg:
            cfg["rope_theta"] = self.rope_theta
        if self.head_dim != self.hidden_size // self.num_attention_heads:
            cfg["head_dim"] = self.head_dim
        if self.num_experts:
            cfg.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                       moe_intermediate_size=self.moe_intermediate_size,
                       norm_topk_prob=self.norm_topk_prob,
                       decoder_sparse_step=self.decoder_sparse_step,
                       mlp_only_layers=list(self.mlp_only_layers),
                       router_aux_loss_coef=self.router_aux_loss_coef)
            if "num_local_experts" in cfg:  # transformers 5's name of the same field
                cfg["num_local_experts"] = self.num_experts
        return cfg


RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
ATTENTION_BACKENDS = ("auto", "local", "flash", "fused", "unfused")


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """Model-level execution options, with megatron's flag names and semantics. Each field's
    metadata "help" says what it does; `validate` checks the combination."""

    recompute_granularity: str | None = dataclasses.field(default=None, metadata={
        "choices": RECOMPUTE_GRANULARITIES, "help": "activation recomputation in the backward "
        "pass, memory for compute: full = whole layers (needs --recompute-method and "
        "--recompute-num-layers), selective = the core attention only (takes neither); unset: "
        "none"})
    recompute_method: str | None = dataclasses.field(default=None, metadata={
        "choices": RECOMPUTE_METHODS, "help": "which layers --recompute-granularity full "
        "recomputes: uniform = every layer, in chunks of --recompute-num-layers; block = the "
        "first --recompute-num-layers layers of each pipeline stage"})
    recompute_num_layers: int | None = dataclasses.field(default=None, metadata={
        "help": "layers per recomputed chunk (uniform) or recomputed layers per pipeline stage "
        "(block); between 1 and the layers per stage; with --recompute-granularity full only"})
    bias_swiglu_fusion: bool | None = dataclasses.field(default=None, metadata={
        "help": "megatron's fused SwiGLU kernel (torch.compile'd). Unset: on with CUDA, off on "
        "the CPU; --bias-swiglu-fusion: on, an error where it cannot run; --no-...: off"})
    rope_fusion: bool | None = dataclasses.field(default=None, metadata={
        "help": "TransformerEngine's fused RoPE kernel. Unset: on with CUDA where TE provides "
        "it, else off; --rope-fusion: on, an error where it cannot run; --no-...: off"})
    gradient_accumulation_fusion: bool | None = dataclasses.field(default=None, metadata={
        "help": "apex's fused weight-gradient accumulation into the fp32 main gradients "
        "(fused_weight_gradient_mlp_cuda). Unset: on with CUDA where apex provides it, else "
        "off; --gradient-accumulation-fusion: on, an error where it cannot run; --no-...: off"})
    attention_backend: str = dataclasses.field(default="auto", metadata={
        "choices": ATTENTION_BACKENDS, "help": "auto = TransformerEngine's attention where TE is "
        "installed on a CUDA machine, else megatron-core's local layers with a "
        "scaled_dot_product_attention core (flash / memory-efficient kernels on CUDA); local = "
        "that SDPA path even where TE is installed; flash / fused / unfused = TE's backend of "
        "that name (needs TE on CUDA)"})
    fused_lm_head: bool = dataclasses.field(default=True, metadata={
        "help": "the trainer scores tokens (log-probs, entropy, the exact KL) from the final "
        "hidden states and the output weight a token chunk at a time (ops.lm_head) instead of "
        "materialising the [tokens, vocab/TP] logits and their gradient; generation always "
        "uses the logits"})
    moe_aux_loss_coeff: float = dataclasses.field(default=0.0, metadata={
        "min": 0.0, "help": "mixture-of-experts models: weight of megatron's load-balancing "
        "loss (aux_loss: experts' token shares times their mean router probabilities) added "
        "to the training loss through each router. 0 (default): none, as usual in RL "
        "post-training; the checkpoint's router_aux_loss_coef (a pretraining setting) is not "
        "applied unless given here. Dense models ignore it"})

    def validate(self, layers_per_stage: int | None = None) -> None:
        """Raise ValueError naming the flag for an inconsistent choice."""
        g, m, n = self.recompute_granularity, self.recompute_method, self.recompute_num_layers
        if m is not None and g != "full":
            raise ValueError("--recompute-method needs --recompute-granularity full "
                             f"(got --recompute-granularity {g})")
        if n is not None and g != "full":
            raise ValueError("--recompute-num-layers needs --recompute-granularity full "
                             f"(got --recompute-granularity {g})")
        if g == "full" and (m is None or n is None):
            raise ValueError("--recompute-granularity full needs --recompute-method "
                             "{uniform,block} and --recompute-num-layers N")
        if n is not None and (n < 1 or (layers_per_stage is not None and n > layers_per_stage)):
            hi = "" if layers_per_stage is None else f" and the {layers_per_stage} layers per stage"
            raise ValueError(f"--recompute-num-layers must be between 1{hi}, got {n}")
        for name in ("bias_swiglu_fusion", "rope_fusion", "gradient_accumulation_fusion"):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"ModelOptions.{name} must be None (auto), True or False")
        if not self.moe_aux_loss_coeff >= 0:
            raise ValueError(f"--moe-aux-loss-coeff must be >= 0, got {self.moe_aux_loss_coeff}")


def te_available() -> bool:
    """TransformerEngine importable on a CUDA machine."""
    if not use_cuda():
        return False
    try:
        import transformer_engine  # noqa: F401  # pyright: ignore[reportMissingImports] (GPU images only)
    except ImportError:
        return False
    return True


def fusion_availability(use_te: bool) -> dict[str, str | None]:
    """For each fusion, None when it can run here, else why not."""
    if not use_cuda():
        reason = "needs CUDA (this rank computes on the CPU)"
        return dict(bias_swiglu_fusion=reason, rope_fusion=reason,
                    gradient_accumulation_fusion=reason)
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.tensor_parallel import layers

    return dict(
        # megatron's bias_swiglu_impl: a torch.compile'd (jit_fuser) SwiGLU, any CUDA machine
        bias_swiglu_fusion=None,
        rope_fusion=None if rope_utils.fused_apply_rotary_pos_emb is not None else
        "needs TransformerEngine's fused RoPE kernel (not installed)",
        # megatron's ColumnParallelLinear (the output layer in every spec) needs apex's kernel
        gradient_accumulation_fusion=None if layers._grad_accum_fusion_available else
        "needs the fused_weight_gradient_mlp_cuda kernel (apex), not importable",
    )


def resolve_fusions(options: "ModelOptions", use_te: bool) -> dict[str, bool]:
    """TransformerConfig fusion fields for `options`: auto (None) follows availability,
    True where unavailable raises ValueError naming the flag."""
    why_not = fusion_availability(use_te)
    on = {}
    for name in ("bias_swiglu_fusion", "rope_fusion", "gradient_accumulation_fusion"):
        want = getattr(options, name)
        if want and why_not[name]:
            flag = name.replace("_", "-")
            raise ValueError(f"{name}=True, but {flag} {why_not[name]}: leave it unset (on where "
                             f"available) or pass --no-{flag}")
        on[name] = why_not[name] is None if want is None else want
    return dict(bias_activation_fusion=on["bias_swiglu_fusion"],
                apply_rope_fusion=on["rope_fusion"],
                gradient_accumulation_fusion=on["gradient_accumulation_fusion"])


def transformer_config(args: ModelArgs, *, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                       params_dtype: torch.dtype = torch.float32, sequence_parallel: bool = False,
                       options: ModelOptions | None = None, use_te: bool = False,
                       expert_parallel: int = 1, **overrides):
    """Build megatron-core's TransformerConfig for `args`, the parallel layout and `options`.
    expert_parallel: --expert-model-parallel-size (each rank builds num_experts /
    expert_parallel experts of every mixture-of-experts layer)."""
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    options = options or ModelOptions()
    if args.num_attention_heads % tensor_parallel or args.num_key_value_heads % tensor_parallel:
        raise ValueError(
            f"--tensor-model-parallel-size {tensor_parallel} must divide num_attention_heads "
            f"({args.num_attention_heads}) and num_key_value_heads ({args.num_key_value_heads})")
    if args.vocab_size % tensor_parallel:
        raise ValueError(
            f"--tensor-model-parallel-size {tensor_parallel} must divide vocab_size "
            f"({args.vocab_size})")
    if args.num_hidden_layers % pipeline_parallel:
        raise ValueError(
            f"--pipeline-model-parallel-size {pipeline_parallel} must divide num_hidden_layers "
            f"({args.num_hidden_layers})")
    ParallelConfig(tensor_parallel, pipeline_parallel, sequence_parallel).validate()
    options.validate(args.num_hidden_layers // pipeline_parallel)
    if args.num_experts and tensor_parallel > 1 and not sequence_parallel:
        # megatron-core refuses to train MoE layers under TP without it (moe_layer.py:379)
        raise ValueError(f"a mixture-of-experts model at --tensor-model-parallel-size "
                         f"{tensor_parallel} needs --sequence-parallel")
    if expert_parallel > 1:
        if not args.num_experts:
            raise ValueError(f"--expert-model-parallel-size {expert_parallel} needs a "
                             f"mixture-of-experts model; {args.architecture} has no experts")
        if args.num_experts % expert_parallel:
            raise ValueError(f"--expert-model-parallel-size {expert_parallel} must divide "
                             f"num_experts ({args.num_experts})")
    on_gpu = use_cuda()
    kwargs = dict(
        num_layers=args.num_hidden_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.intermediate_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_key_value_heads,
        kv_channels=args.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=args.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=args.qkv_bias,
        qk_layernorm=args.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        **resolve_fusions(options, use_te),
        recompute_granularity=options.recompute_granularity,
        recompute_method=options.recompute_method,
        recompute_num_layers=options.recompute_num_layers,
        # TE reads its backend from this (NVTE_* variables); the local SDPA path ignores it
        attention_backend=(AttnBackend[options.attention_backend] if use_te else AttnBackend.auto),
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        sequence_parallel=sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=not on_gpu,
        perform_initialization=True,
        init_method_std=float(args.hf_config.get("initializer_range", 0.02)),
        # --deterministic-mode (parallel.init_distributed turns torch's on): megatron's own
        # deterministic paths too, e.g. the embedding's backward without atomics
        deterministic_mode=torch.are_deterministic_algorithms_enabled(),
    )
    if args.num_experts:
        kwargs.update(moe_kwargs(args, options))
    if expert_parallel > 1:
        kwargs["expert_model_parallel_size"] = expert_parallel
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def moe_kwargs(args: ModelArgs, options: ModelOptions) -> dict[str, Any]:
    """megatron-core's TransformerConfig fields for a mixture-of-experts `args`.

    Routing as transformers' Qwen3-MoE: softmax over the router logits, top-k, and with
    norm_topk_prob the k weights renormalised; megatron-core's softmax router with
    moe_router_pre_softmax=False takes the softmax over the top-k logits, which is the same
    renormalised weights, and with pre_softmax=True the softmax over all experts before the top-k
    (unnormalised). Experts are megatron-core's SequentialMLP (moe_grouped_gemm off: the grouped
    GEMM needs TransformerEngine or the grouped_gemm package) behind the allgather dispatcher
    (no CUDA streams; all experts on each rank at expert-parallel size 1). The router computes
    in the activations' dtype, as transformers does. Every router holds megatron-core's
    RouterReplay hook (moe_enable_routing_replay), inert until megatron_rl.models.routing sets
    an action for one forward."""
    return dict(
        num_moe_experts=args.num_experts,
        moe_router_topk=args.num_experts_per_tok,
        moe_ffn_hidden_size=args.moe_intermediate_size,
        moe_layer_freq=args.moe_layer_pattern,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not args.norm_topk_prob,
        moe_grouped_gemm=False,
        moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=float(options.moe_aux_loss_coeff),
        moe_enable_routing_replay=True,
    )
