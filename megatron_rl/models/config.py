"""Model architecture read from a Hugging Face `config.json` (Qwen2, Qwen3 and Llama families).

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

SUPPORTED_ARCHITECTURES = {
    # HF architecture name -> family
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
}


@dataclasses.dataclass
class ModelArgs:
    """Decoder-only transformer hyper-parameters, in HF terms.

    Shapes: head_dim = hidden_size / num_attention_heads unless given; the KV projection has
    num_key_value_heads * head_dim rows (grouped-query attention when fewer than query heads).
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
    hf_config: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

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
        if family in ("qwen2", "qwen3") and config.get("use_sliding_window"):
            raise ValueError(f"{source}: sliding-window attention is not supported "
                             "(field 'use_sliding_window')")

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
            qk_norm=family == "qwen3",
            rope_scaling_factor=factor,
            bos_token_id=config.get("bos_token_id"),
            eos_token_id=config.get("eos_token_id"),
            torch_dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"),
            hf_config=dict(config),
        )

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
        return cfg


def transformer_config(args: ModelArgs, *, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                       params_dtype: torch.dtype = torch.float32, sequence_parallel: bool = False,
                       **overrides):
    """Build megatron-core's TransformerConfig for `args` and the given parallel layout."""
    from megatron.core.transformer.transformer_config import TransformerConfig

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
    on_gpu = torch.cuda.is_available()
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
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        sequence_parallel=sequence_parallel and tensor_parallel > 1,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=not on_gpu,
        perform_initialization=True,
        init_method_std=float(args.hf_config.get("initializer_range", 0.02)),
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)
