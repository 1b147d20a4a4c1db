"""GPU-scale model and optimizer options, single process.

- activation recompute (--recompute-granularity full/selective, --recompute-method
  uniform/block, --recompute-num-layers) gives the gradients of no recompute, and recomputes;
- the learning-rate schedule (--lr-warmup-iters, --lr-decay-style, --lr-decay-iters, --min-lr),
  megatron-core's OptimizerParamScheduler stepped by Policy.step(), against its closed forms;
- bf16 parameters train with fp32 main parameters and fp32 main gradients;
- each option's validation names the flag; fusions are off without CUDA (auto) and refused
  when forced;
- on CUDA (gpu marker): fusions on by default, SDPA reaches flash / memory-efficient kernels,
  the distributed optimizer equals the plain one, bf16 keeps fp32 main parameters.

Multi-rank checks (distributed optimizer at DP2, sequence parallelism at TP2) are in
tests/distributed/test_gpu_scale_flags.py.
"""
import math

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_rl.models.config import ModelArgs, ModelOptions  # noqa: E402
from megatron_rl.models.optim import OptimConfig  # noqa: E402
from megatron_rl.models.policy import Policy  # noqa: E402
from megatron_rl.parallel import ParallelConfig, set_seed  # noqa: E402

TINY = dict(architecture="Qwen2ForCausalLM", vocab_size=96, hidden_size=32, intermediate_size=64,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            qkv_bias=True, max_position_embeddings=64)


def _args(**kw):
    return ModelArgs(**{**TINY, **kw})


def _loss_fn(batch, logits):
    loss = logits.float().logsumexp(-1).mean() - logits.float()[..., 0].mean()
    return loss, {"loss": loss.detach()}


def _policy(args, weights=None, **kw):
    set_seed(0)  # on a GPU megatron initialises from its own CUDA RNG tracker: seeded here
    policy = Policy(args, trainable=True, **kw)
    if weights is not None:
        policy.load_full_state_dict(weights)
    return policy


def _grads(policy, tokens):
    policy.forward_backward([{"tokens": tokens[:2]}, {"tokens": tokens[2:]}], _loss_fn)
    return {k: v.clone() for k, v in policy.full_grads(dst=None).items()}


# -- activation recompute ------------------------------------------------------------------------

RECOMPUTE = [("full", "uniform", 1), ("full", "uniform", 2), ("full", "block", 3),
             ("selective", None, None)]


@pytest.mark.distributed
def test_recompute_gives_the_gradients_of_no_recompute(dist_env):
    args = _args()
    base = _policy(args)
    weights = {k: v.clone() for k, v in base.full_state_dict(dst=None).items()}
    tokens = torch.randint(0, args.vocab_size, (4, 11), generator=torch.Generator().manual_seed(1))
    ref = _grads(base, tokens)
    assert max(float(g.abs().max()) for g in ref.values()) > 1e-3
    for granularity, method, n in RECOMPUTE:
        options = ModelOptions(recompute_granularity=granularity, recompute_method=method,
                               recompute_num_layers=n)
        policy = _policy(args, weights, options=options)
        assert policy.config.recompute_granularity == granularity
        calls = []  # the recomputed module runs again in the backward pass
        if granularity == "full":
            module = policy.module.decoder.layers[0]
        else:
            module = policy.module.decoder.layers[0].self_attention.core_attention
        module.register_forward_hook(lambda *_: calls.append(1))
        got = _grads(policy, tokens)
        assert len(calls) == 4, (granularity, method, n, len(calls))  # 2 microbatches x 2
        for k in ref:  # bit-identical on CPU; atomics in CUDA backward kernels may round
            torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{granularity}/{method}/{n} {k}: {m}")


def _parse_yaml(tmp_path, text: str):
    from megatron_rl.config import parse_config

    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return parse_config(["--config", str(path), "--hf-checkpoint", "m", "--train-data", "d"])


def test_recompute_options_are_validated_with_the_flag_names(tmp_path):
    with pytest.raises(ValueError, match="--recompute-method needs --recompute-granularity full"):
        ModelOptions(recompute_method="uniform").validate()
    with pytest.raises(ValueError, match="--recompute-method needs --recompute-granularity full"):
        ModelOptions(recompute_granularity="selective", recompute_method="block").validate()
    with pytest.raises(ValueError, match="--recompute-granularity full needs --recompute-method"):
        ModelOptions(recompute_granularity="full").validate()
    with pytest.raises(ValueError, match="--recompute-num-layers needs"):
        ModelOptions(recompute_granularity="selective", recompute_num_layers=1).validate()
    with pytest.raises(ValueError, match="--recompute-num-layers must be between 1 and the 2"):
        ModelOptions(recompute_granularity="full", recompute_method="block",
                     recompute_num_layers=3).validate(layers_per_stage=2)
    # the choices are the flags' (argparse; TrainConfig.validate for YAML values)
    with pytest.raises(ValueError, match="--recompute-granularity 'all'; valid: full, selective"):
        _parse_yaml(tmp_path, "recompute_granularity: all\n")
    with pytest.raises(ValueError, match="--attention-backend 'sdpa'; valid: auto, local"):
        _parse_yaml(tmp_path, "attention_backend: sdpa\n")
    ModelOptions(recompute_granularity="full", recompute_method="uniform",
                 recompute_num_layers=1).validate(layers_per_stage=4)


# -- learning-rate schedule ----------------------------------------------------------------------

def closed_form_lr(k, style, lr, min_lr, warmup, decay, init=0.0):
    """The learning rate of optimizer step k (0-based), megatron's schedule written out."""
    if warmup > 0 and k <= warmup:
        return init + (lr - init) * k / warmup
    if style == "constant":
        return lr
    if k > decay:
        return min_lr
    r = (k - warmup) / (decay - warmup)
    coeff = 1 - r if style == "linear" else 0.5 * (1 + math.cos(math.pi * r))
    return min_lr + (lr - min_lr) * coeff


@pytest.mark.distributed
@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_lr_schedule_follows_the_closed_forms(dist_env, style):
    args = _args(num_hidden_layers=1)
    optim = OptimConfig(lr=1e-3, min_lr=1e-4, weight_decay=0.1, lr_warmup_iters=3,
                        lr_decay_style=style, lr_decay_iters=9, lr_warmup_init=1e-5)
    policy = _policy(args, optim=optim)
    tokens = torch.randint(0, args.vocab_size, (2, 6), generator=torch.Generator().manual_seed(2))
    seen = []
    for k in range(12):
        groups = policy.optimizer.param_groups
        assert len({g["lr"] for g in groups}) == 1  # every group follows the schedule
        # megatron: no weight decay for biases and 1-D parameters (wd_mult 0)
        assert {g["weight_decay"] for g in groups} == {0.0, 0.1}
        seen.append(policy.lr)
        policy.forward_backward([{"tokens": tokens}], _loss_fn)
        assert policy.step()[0]
    want = [closed_form_lr(k, style, 1e-3, 1e-4, 3, 9, 1e-5) for k in range(12)]
    assert seen == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert policy.scheduler.num_steps == 12
    assert seen[0] == pytest.approx(1e-5) and seen[3] == pytest.approx(1e-3)
    if style != "constant":
        assert seen[10] == pytest.approx(1e-4) and seen[11] == pytest.approx(1e-4)


def test_lr_schedule_is_validated_with_the_flag_names(tmp_path):
    with pytest.raises(ValueError, match="--lr-decay-style 'WSD'; valid: constant"):
        _parse_yaml(tmp_path, "lr_decay_style: WSD\n")
    with pytest.raises(ValueError, match="--lr-decay-style cosine needs --lr-decay-iters"):
        OptimConfig(lr_decay_style="cosine").validate()
    with pytest.raises(ValueError, match="--lr-decay-iters .5. must be larger than "
                                         "--lr-warmup-iters .5."):
        OptimConfig(lr_decay_style="linear", lr_warmup_iters=5, lr_decay_iters=5).validate()
    with pytest.raises(ValueError, match="--min-lr"):
        OptimConfig(lr=1e-6, min_lr=1e-5).validate()
    with pytest.raises(ValueError, match="--lr-warmup-iters must be >= 0"):
        OptimConfig(lr_warmup_iters=-1).validate()
    OptimConfig(lr_warmup_iters=10).validate()  # constant: no decay horizon needed


# -- bf16: fp32 main parameters and gradients ---------------------------------------------------

@pytest.mark.distributed
def test_bf16_trains_with_fp32_main_params_and_grads(dist_env):
    args = _args(num_hidden_layers=2)
    policy = _policy(args, params_dtype=torch.bfloat16, optim=OptimConfig(lr=1e-2))
    linear = policy.module.decoder.layers[0].mlp.linear_fc1.weight
    assert linear.dtype == torch.bfloat16
    opt = policy.optimizer.chained_optimizers[0]
    assert type(opt).__name__ == "Float16OptimizerWithFloat16Params"
    main = [p for g in opt.optimizer.param_groups for p in g["params"]]
    assert main and all(p.dtype == torch.float32 for p in main)
    before = linear.detach().float().clone()
    tokens = torch.randint(0, args.vocab_size, (2, 6), generator=torch.Generator().manual_seed(3))
    policy.forward_backward([{"tokens": tokens}], _loss_fn)
    assert all(p.main_grad.dtype == torch.float32 for p in policy.parameters())
    assert float(linear.main_grad.abs().max()) > 0
    assert policy.step()[0]
    assert all(p.dtype == torch.float32 for g in opt.optimizer.param_groups for p in g["params"])
    # the bf16 weights are the rounded fp32 main weights
    g, i = next((g, i) for g, group in enumerate(opt.float16_groups)
                for i, p in enumerate(group) if p is linear)
    fp32 = opt.fp32_from_float16_groups[g][i]
    assert float((linear.detach().float() - before).abs().max()) > 0
    torch.testing.assert_close(fp32.to(torch.bfloat16), linear.detach(), rtol=0, atol=0)


# -- sequence parallelism and the distributed optimizer: validation -----------------------------

@pytest.mark.distributed
def test_sequence_parallel_needs_tensor_parallelism(dist_env):
    with pytest.raises(ValueError, match="--sequence-parallel needs --tensor-model-parallel-size"):
        Policy(_args(num_hidden_layers=1), parallel=ParallelConfig(sequence_parallel=True))
    with pytest.raises(ValueError, match="megatron's groups are TP1 x PP1"):
        Policy(_args(num_hidden_layers=1), parallel=ParallelConfig(2))


@pytest.mark.distributed
def test_distributed_optimizer_runs_on_cpu_and_matches_the_plain_one(dist_env):
    """DP1 here (DP2 in tests/distributed): same parameters after 2 steps, Adam state sharded
    by megatron's DistributedOptimizer."""
    args = _args(num_hidden_layers=2)
    tokens = torch.randint(0, args.vocab_size, (4, 7), generator=torch.Generator().manual_seed(4))
    out = {}
    for distributed in (False, True):
        policy = _policy(args, optim=OptimConfig(lr=1e-2, clip_grad=0.0),
                         parallel=ParallelConfig(use_distributed_optimizer=distributed))
        assert policy.model[0].ddp_config.use_distributed_optimizer == distributed
        for _ in range(2):
            policy.forward_backward([{"tokens": tokens}], _loss_fn)
            assert policy.step()[0]
        out[distributed] = ({k: v.clone() for k, v in policy.full_state_dict(dst=None).items()},
                            type(policy.optimizer.chained_optimizers[0]).__name__)
    assert out[True][1] == "DistributedOptimizer" and out[False][1] == "FP32Optimizer"
    for k, v in out[False][0].items():
        torch.testing.assert_close(out[True][0][k], v, rtol=0, atol=1e-6)


def test_deterministic_mode_reaches_megatron():
    """--deterministic-mode turns torch's deterministic algorithms on (init_distributed) and
    megatron's TransformerConfig follows it (its embedding then avoids F.embedding's atomics)."""
    from megatron_rl.models.config import transformer_config

    assert not transformer_config(_args()).deterministic_mode
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        assert transformer_config(_args()).deterministic_mode
    finally:
        torch.use_deterministic_algorithms(False)


# -- fusions and attention backend ---------------------------------------------------------------

def test_fusions_are_off_without_cuda_and_refused_when_forced(monkeypatch):
    from megatron_rl.models import config

    monkeypatch.setattr(config, "use_cuda", lambda: False)
    assert config.resolve_fusions(ModelOptions(), use_te=False) == dict(
        bias_activation_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False)
    for name in ("bias_swiglu_fusion", "rope_fusion", "gradient_accumulation_fusion"):
        flag = name.replace("_", "-")
        with pytest.raises(ValueError, match=f"--no-{flag}"):
            config.resolve_fusions(ModelOptions(**{name: True}), use_te=False)
    off = ModelOptions(bias_swiglu_fusion=False, rope_fusion=False,
                       gradient_accumulation_fusion=False)
    assert not any(config.resolve_fusions(off, use_te=False).values())


def test_fusions_default_on_where_cuda_and_the_kernel_are(monkeypatch):
    """The auto decision on a CUDA machine (faked here): bias-SwiGLU on (a torch.compile'd
    kernel), RoPE fusion and gradient-accumulation fusion on exactly when their kernels import;
    each --no-* flag turns its fusion off."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.tensor_parallel import layers

    from megatron_rl.models import config

    monkeypatch.setattr(config, "use_cuda", lambda: True)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", None)
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", False)
    assert config.resolve_fusions(ModelOptions(), use_te=False) == dict(
        bias_activation_fusion=True, apply_rope_fusion=False, gradient_accumulation_fusion=False)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", lambda *a, **k: None)
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", True)
    assert all(config.resolve_fusions(ModelOptions(), use_te=True).values())
    assert config.resolve_fusions(ModelOptions(bias_swiglu_fusion=False, rope_fusion=False),
                                  use_te=True) == dict(
        bias_activation_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=True)


def test_te_attention_backends_need_transformer_engine(monkeypatch):
    from megatron_rl.models import gpt

    monkeypatch.setattr(gpt, "te_available", lambda: False)
    assert gpt.use_transformer_engine(ModelOptions()) is False
    assert gpt.use_transformer_engine(ModelOptions(attention_backend="local")) is False
    with pytest.raises(ValueError, match="--attention-backend flash is a TransformerEngine"):
        gpt.use_transformer_engine(ModelOptions(attention_backend="flash"))
    monkeypatch.setattr(gpt, "te_available", lambda: True)
    assert gpt.use_transformer_engine(ModelOptions()) is True
    assert gpt.use_transformer_engine(ModelOptions(attention_backend="local")) is False


# -- the GPU tier --------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.distributed
def test_fusions_are_on_by_default_on_cuda_and_match_unfused(dist_env):
    """On CUDA: bias-SwiGLU fusion on by default (RoPE and gradient-accumulation fusion where
    their kernels import) and the fused model's bf16 logits and gradients equal the unfused
    model's to bf16 rounding."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.tensor_parallel import layers

    args = _args()
    fused = _policy(args, params_dtype=torch.bfloat16)
    cfg = fused.config
    assert cfg.bias_activation_fusion
    assert cfg.apply_rope_fusion == (rope_utils.fused_apply_rotary_pos_emb is not None)
    assert cfg.gradient_accumulation_fusion == layers._grad_accum_fusion_available
    assert next(fused.module.parameters()).is_cuda
    weights = {k: v.clone() for k, v in fused.full_state_dict(dst=None).items()}
    plain = _policy(args, weights, params_dtype=torch.bfloat16,
                    options=ModelOptions(bias_swiglu_fusion=False, rope_fusion=False,
                                         gradient_accumulation_fusion=False))
    assert not plain.config.bias_activation_fusion
    tokens = torch.randint(0, args.vocab_size, (4, 16), generator=torch.Generator().manual_seed(5))
    got, ref = _grads(fused, tokens), _grads(plain, tokens)
    for k in ref:
        scale = float(ref[k].abs().max()) + 1e-6
        assert float((got[k] - ref[k]).abs().max()) <= 0.05 * scale, k


@pytest.mark.gpu
def test_sdpa_attention_reaches_flash_and_memory_efficient_kernels():
    """Nothing pins SDPA's math path: a bf16 causal call without a mask runs under flash
    attention alone (grouped KV heads as they are); an fp32 call with an explicit mask runs
    under the memory-efficient kernel alone (KV heads repeated for it). Each raises if SDPA
    cannot use the one allowed kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megatron_rl.models.gpt import _sdpa_attention_class

    from megatron.core.transformer.transformer_config import TransformerConfig

    cls = _sdpa_attention_class()

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                               use_cpu_initialization=True)
    attn = cls(config, 1, None, None)
    dev = torch.device("cuda")
    s, b, nh, ng, d = 32, 2, 4, 2, 16
    for dtype, backend, with_mask in ((torch.bfloat16, SDPBackend.FLASH_ATTENTION, False),
                                      (torch.float32, SDPBackend.EFFICIENT_ATTENTION, True),
                                      (torch.bfloat16, SDPBackend.EFFICIENT_ATTENTION, True)):
        q = torch.randn(s, b, nh, d, device=dev, dtype=dtype, requires_grad=True)
        k = torch.randn(s, b, ng, d, device=dev, dtype=dtype, requires_grad=True)
        v = torch.randn(s, b, ng, d, device=dev, dtype=dtype, requires_grad=True)
        mask = None
        if with_mask:  # True = masked out: causal plus one padded key
            mask = ~torch.ones(s, s, dtype=torch.bool, device=dev).tril()
            mask = mask.expand(b, 1, s, s).clone()
            mask[0, :, :, 0] = True
            mask[0, :, 0, 0] = False
        with sdpa_kernel([backend]):
            out = attn(q, k, v, mask)
            out.float().sum().backward()
        with sdpa_kernel([SDPBackend.MATH]):
            ref = attn(q.detach().float(), k.detach().float(), v.detach().float(), mask)
        assert out.shape == (s, b, nh * d)
        atol = 1e-5 if dtype == torch.float32 else 4e-2  # bf16 rounding of values of size ~1
        torch.testing.assert_close(out.float(), ref, rtol=0, atol=atol)


@pytest.mark.gpu
@pytest.mark.distributed
def test_distributed_optimizer_and_bf16_main_params_on_cuda(dist_env):
    args = _args(num_hidden_layers=2)
    tokens = torch.randint(0, args.vocab_size, (4, 7), generator=torch.Generator().manual_seed(6))
    out = {}
    for distributed in (False, True):
        policy = _policy(args, params_dtype=torch.bfloat16, optim=OptimConfig(lr=1e-2,
                                                                             clip_grad=0.0),
                         parallel=ParallelConfig(use_distributed_optimizer=distributed))
        opt = policy.optimizer.chained_optimizers[0]
        for _ in range(2):
            policy.forward_backward([{"tokens": tokens}], _loss_fn)
            assert policy.step()[0]
        assert all(p.dtype == torch.float32 and p.is_cuda
                   for g in opt.optimizer.param_groups for p in g["params"])
        assert all(p.main_grad.dtype == torch.float32 for p in policy.parameters())
        out[distributed] = {k: v.float().clone()
                            for k, v in policy.full_state_dict(dst=None).items()}
    for k, v in out[False].items():
        torch.testing.assert_close(out[True][k], v, rtol=0, atol=1e-6)
