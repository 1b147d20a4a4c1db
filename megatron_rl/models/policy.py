"""A policy (or frozen reference) model in its parallel layout: build, load, run, update, export.

`Policy` owns this rank's pipeline stage of the GPT model (models.gpt), wrapped in megatron-core
DDP with megatron's optimizer when trainable (models.optim), and composes what works on it:
running microbatches through megatron-core's pipeline schedule, so TP/PP/DP/EP all take the
same path (models.runner: forward_backward, collect_per_token, the loss convention), scoring
their outputs (`score`: logits or, with --fused-lm-head, hidden states), and the weights in and
out (models.weights: HF / full state dict loading, gathering the full state dict or gradients).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable, Iterable, cast

import torch
import torch.distributed as dist

from megatron_rl.models import runner, weights
from megatron_rl.models.config import ModelArgs, ModelOptions
from megatron_rl.models.gpt import build_gpt_model
from megatron_rl.models.optim import OptimConfig, build_trainable
from megatron_rl.parallel import ParallelConfig

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel


class Policy:
    """This rank's stage of a GPT model, trainable (with optimizer) or frozen (reference)."""

    def __init__(self, args: ModelArgs, *, trainable: bool = True,
                 optim: OptimConfig | None = None, params_dtype: torch.dtype = torch.float32,
                 parallel: ParallelConfig | None = None, options: ModelOptions | None = None):
        """parallel: the layout's options (sequence parallelism, the distributed optimizer); its
        TP/PP sizes must be those megatron's groups were initialised with (default: those, with
        no options). options: recompute, fusions and the attention backend (ModelOptions).
        Trainable: megatron DDP (gradients reduced in fp32 into fp32 `main_grad` buffers) and
        megatron's Adam; with bf16/fp16 parameters it keeps fp32 main parameters."""
        from megatron.core import parallel_state as ps

        self.args = args
        self.tp_size = ps.get_tensor_model_parallel_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_size = ps.get_pipeline_model_parallel_world_size()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        self.ep_size = ps.get_expert_model_parallel_world_size()
        self.ep_rank = ps.get_expert_model_parallel_rank()
        self.is_last_stage = ps.is_pipeline_last_stage()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.vocab_start = self.tp_rank * (args.vocab_size // self.tp_size)
        self.params_dtype = params_dtype
        self.trainable = trainable
        parallel = parallel or ParallelConfig(self.tp_size, self.pp_size,
                                              expert_model_parallel_size=self.ep_size)
        if (parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
                parallel.expert_model_parallel_size) != (self.tp_size, self.pp_size, self.ep_size):
            raise ValueError(
                f"ParallelConfig asks for TP{parallel.tensor_model_parallel_size} x "
                f"PP{parallel.pipeline_model_parallel_size} x "
                f"EP{parallel.expert_model_parallel_size}, but megatron's groups are "
                f"TP{self.tp_size} x PP{self.pp_size} x EP{self.ep_size} (init_distributed with "
                "the same config)")
        self.parallel = parallel
        self.options = options or ModelOptions()
        self.sequence_parallel = parallel.sequence_parallel
        # score tokens from the final hidden states and the output weight (ops.lm_head)
        # instead of from the logits (--fused-lm-head)
        self.fused_lm_head = self.options.fused_lm_head
        model = build_gpt_model(args, tensor_parallel=self.tp_size,
                                pipeline_parallel=self.pp_size, params_dtype=params_dtype,
                                sequence_parallel=parallel.sequence_parallel, options=self.options,
                                expert_parallel=self.ep_size)
        self.config = model.config
        self.optimizer = None
        self.scheduler = None
        if trainable:
            model, self.optimizer, self.scheduler = build_trainable(
                model, self.config, optim or OptimConfig(), params_dtype,
                parallel.use_distributed_optimizer)
        else:
            for p in model.parameters():
                p.requires_grad_(False)
        self.model = [model]

    # -- the unwrapped GPTModel ------------------------------------------------------------------
    @property
    def module(self) -> GPTModel:
        m = self.model[0]
        # nn.Module's __getattr__ types `.module` (of megatron's DDP wrapper) as Tensor | Module
        return cast("GPTModel", m.module if hasattr(m, "module") else m)

    def output_weight(self) -> torch.Tensor:
        """This rank's output-layer shard [V/TP, H] (the word embedding when tied); last stage."""
        m = self.module
        if m.share_embeddings_and_output_weights:
            return m.shared_embedding_or_output_weight()
        weight = m.output_layer.weight
        assert weight is not None  # allocated when the embedding is not shared
        return weight

    @property
    def pad_multiple(self) -> int:
        """Token counts of packed rows are multiples of this (8; and of TP under sequence
        parallelism, which splits the sequence over the TP ranks)."""
        return 8 * self.tp_size if self.sequence_parallel else 8

    def score(self, out: torch.Tensor, targets: torch.Tensor, *,
              ref_out: torch.Tensor | None = None, reference: "Policy | None" = None,
              return_entropy: bool = False, temperature: float = 1.0):
        """ops.TokenLogprobOutput (log-probs, entropy, and the exact KL when `ref_out` is given)
        of `targets` [b, s] from this model's forward output `out`: the final hidden states
        [b, s, H] with --fused-lm-head (ops.lm_head_logprobs_and_kl with this rank's output
        weight, and the reference's), else the vocab-parallel logits [b, s, V/TP]
        (ops.token_logprobs_and_kl). The one place that knows which of the two it is."""
        from megatron_rl.ops import lm_head_logprobs_and_kl, token_logprobs_and_kl

        targets = targets.to(out.device)
        if self.fused_lm_head:
            ref_weight = None
            if ref_out is not None:
                if reference is None:
                    raise ValueError("the exact KL from hidden states needs the reference Policy")
                ref_weight = reference.output_weight()
            return lm_head_logprobs_and_kl(out, self.output_weight(), targets,
                                           tp_group=self.tp_group, vocab_start=self.vocab_start,
                                           temperature=temperature, return_entropy=return_entropy,
                                           ref_hidden=ref_out, ref_weight=ref_weight)
        return token_logprobs_and_kl(out, targets, tp_group=self.tp_group,
                                     vocab_start=self.vocab_start, temperature=temperature,
                                     return_entropy=return_entropy, ref_logits=ref_out)

    # -- running ---------------------------------------------------------------------------------
    def forward_backward(self, microbatches: list[dict], loss_fn: Callable | None,
                         forward_only: bool = False, collect: Callable | None = None,
                         reference: "Policy | None" = None, for_scoring: bool = False) -> list:
        """Run all microbatches through the pipeline schedule.

        microbatches: dicts with "tokens" [b, s] (int64), optional "position_ids" [b, s] and
        "attention_mask" [b, 1, s, s] (bool, True = masked out); all of equal shape under
        pipeline parallelism. A packed microbatch (megatron_rl.packing) has b = 1 and also
        "cu_seqlens" and "max_seqlen": its sequences attend only within themselves; with
        "cu_seqlens_host", the same boundaries on the host (packing.segment_inputs), nothing is
        read back from the device to attend them.
        loss_fn(batch, out) -> (loss, metrics dict), with `out` the last stage's output: the
        vocab-parallel logits [b, s, V/TP]; or, when `for_scoring` (the caller turns `out` into
        log-probs with `score`) and --fused-lm-head, the final hidden states [b, s, H]. It runs
        on the last stage only. When `collect` is given (forward_only), collect(batch, out) ->
        tensor is stored instead of a loss.
        Returns the list of metrics dicts (or collected values) on the last stage, [] elsewhere.

        reference: a frozen Policy in the same layout (the KL's reference model). Each
        microbatch then also runs through the reference's stage, under no_grad, inside the same
        forward step, and loss_fn / collect get its logits too: fn(batch, logits, ref_logits).
        This is how the "exact" KL estimator, which needs both full next-token distributions,
        gets the reference's logits without storing them: [B, L, V] per batch (152k vocab:
        ~0.6 MB per token in fp32) cannot be precomputed and streamed, while the reference's
        forward costs about a third of the policy's forward+backward and its logits live only
        until the microbatch's backward. Pipeline parallelism: the reference's activations
        travel with the policy's through megatron's unchanged schedule: each stage sends
        cat([policy hidden, reference hidden]) along the sequence dim (the schedule is told a
        sequence twice as long, so its p2p buffers have that shape), the next stage splits the
        received tensor and feeds each half to its model; the reference half is detached, so
        backward sends it a zero gradient and nothing else changes.
        """
        return runner.forward_backward(self, microbatches, loss_fn, forward_only=forward_only,
                                       collect=collect, reference=reference,
                                       for_scoring=for_scoring)

    def broadcast_from_last_stage(self, t: torch.Tensor | None, shape, dtype) -> torch.Tensor:
        """Give every pipeline stage the last stage's tensor `t` (same shape/dtype everywhere)."""
        from megatron.core import parallel_state as ps

        if self.pp_size == 1:
            assert t is not None  # the only stage is the last
            return t
        dev = next(self.module.parameters()).device
        buf = t.to(dev).contiguous() if self.is_last_stage else torch.empty(shape, dtype=dtype,
                                                                              device=dev)
        dist.broadcast(buf, src=ps.get_pipeline_model_parallel_last_rank(),
                       group=ps.get_pipeline_model_parallel_group())
        return buf

    @property
    def is_sampler(self) -> bool:
        """The one rank of this model-parallel group that makes sampling decisions: the last
        pipeline stage's tensor-parallel rank 0."""
        return self.is_last_stage and self.tp_rank == 0

    def broadcast_from_sampler(self, t: torch.Tensor, shape, dtype) -> torch.Tensor:
        """Give every rank of this model-parallel group the sampler's tensor `t` (TP broadcast
        on the last stage, then from the last stage down the pipeline), so that no rank relies
        on drawing bit-for-bit what another drew."""
        from megatron.core import parallel_state as ps

        if self.tp_size > 1 and self.is_last_stage:
            t = t.contiguous()
            dist.broadcast(t, src=ps.get_tensor_model_parallel_src_rank(), group=self.tp_group)
        return self.broadcast_from_last_stage(t, shape, dtype)

    def collect_per_token(self, tokens: torch.Tensor, layout, fn: Callable, num_outputs: int,
                          *, seq_lengths=None, reference: "Policy | None" = None,
                          routes: torch.Tensor | None = None,
                          own_routes: list | None = None) -> torch.Tensor:
        """[num_outputs, B, L-1] fp32 per-token values of a right-padded batch, on every rank of
        this pipeline: one forward-only pass over `layout`'s microbatches (packing.Layout, or an
        int: padded microbatches of that many rows). fn(microbatch, out[, ref_out]) -> a list of
        `num_outputs` per-position tensors shaped like microbatch.targets (from `score`);
        they come back in the batch's layout (position t scores token t+1). routes: [B, L, M, k]
        experts this model's MoE layers replay (models.routing; the reference's do not);
        own_routes: a list that receives the experts this stage's routers chose themselves
        (while replaying `routes`), [B, L-1, M_stage, k] int16 on the host, in the batch's
        layout."""
        return runner.collect_per_token(self, tokens, layout, fn, num_outputs,
                                        seq_lengths=seq_lengths, reference=reference,
                                        routes=routes, own_routes=own_routes)

    def token_logprobs(self, tokens: torch.Tensor, layout, temperature: float = 1.0, *,
                       seq_lengths=None, routes: torch.Tensor | None = None,
                       own_routes: list | None = None) -> torch.Tensor:
        """log pi(tokens[:, t+1] | tokens[:, :t+1]) for a right-padded batch: [B, L-1] fp32 on
        every rank of this pipeline, on the model's device (0 past each sequence's end when
        `seq_lengths` are given). Forward only, microbatches as `layout` says (see
        collect_per_token), through `score`; `routes`: experts to replay and `own_routes` the
        routers' own choice (models.routing, collect_per_token)."""
        def fn(mb, out):
            return [self.score(out, mb.targets, temperature=temperature).logprobs]
        return self.collect_per_token(tokens, layout, fn, 1, seq_lengths=seq_lengths,
                                      routes=routes, own_routes=own_routes)[0]

    def last_token_logits(self, tokens: torch.Tensor, attention_mask: torch.Tensor,
                          position_ids: torch.Tensor,
                          routes_out: list | None = None) -> torch.Tensor:
        """Full-vocabulary logits [B, V] (fp32) at the last position, on every rank (used by
        the local rollout engine; TP shards are gathered, PP broadcasts from the last stage).
        routes_out: a list to which the forward appends the experts this stage's MoE layers
        chose, [B, s, M_stage, k] (models.routing)."""
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        def collect(batch, logits):
            return gather_from_tensor_model_parallel_region(logits[:, -1].float().contiguous())

        batch = {"tokens": tokens, "attention_mask": attention_mask, "position_ids": position_ids,
                 "record_routes": routes_out}
        outs = self.forward_backward([batch], None, forward_only=True, collect=collect)
        out = outs[0] if self.is_last_stage else None
        return self.broadcast_from_last_stage(out, (tokens.shape[0], self.args.vocab_size),
                                              torch.float32)

    def step(self) -> tuple[bool, float | None]:
        """Optimizer step after forward_backward, then the learning-rate schedule advances
        (only when the update was applied, as in megatron's train_step). Returns (update
        applied, grad norm)."""
        # megatron-core's abstract MegatronOptimizer.step() is unannotated with a `pass` body
        # (inferred None); every optimizer returns (update applied, grad norm, zeros in grad)
        ok, grad_norm, _ = self.optimizer.step()  # pyright: ignore[reportGeneralTypeIssues]
        if ok and self.scheduler is not None:
            self.scheduler.step(increment=1)
        return bool(ok), (float(grad_norm) if grad_norm is not None else None)

    @property
    def lr(self) -> float | None:
        """The learning rate the next optimizer step uses (None when frozen)."""
        if self.optimizer is None:
            return None
        from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging

        return get_canonical_lr_for_logging(self.optimizer.param_groups)

    # -- weights in and out ----------------------------------------------------------------------
    def load_full_state_dict(self, full: dict[str, torch.Tensor], source: str = "state dict") -> None:
        """Load a megatron state dict (global names, see hf_mapping) into this rank: the full
        model, or at least what this rank's pipeline stage holds (hf_mapping.stage_names)."""
        weights.load_full_state_dict(self, full, source)

    def load_hf(self, path: str) -> None:
        """Load a HF safetensors checkpoint directory: this rank reads only the tensors of its
        pipeline stage (memory-mapped; the ranks of a node share the page cache)."""
        weights.load_hf(self, path)

    def full_state_dict(self, dst: int | None = 0) -> dict[str, torch.Tensor] | None:
        """Gather the full megatron state dict (global names, host tensors).

        Collective over the whole world. Returned on global rank `dst` (None elsewhere), or on
        every rank when dst is None. Only dst holds it on the host (models.weights.gather).
        """
        return weights.gather(self, weights.local_state_dict(self), dst)

    def full_grads(self, dst: int | None = 0) -> dict[str, torch.Tensor] | None:
        """Gather the full gradient state dict after forward_backward (DP-reduced main grads,
        fp32), as full_state_dict does the weights."""
        return weights.gather(self, weights.local_grads(self), dst)

    @functools.cached_property
    def places(self) -> list[weights.Place]:
        """Every global rank's place in megatron's groups (models.weights.exchange_places),
        which the gathers route by; asked on first use, a collective over the world."""
        return weights.exchange_places()

    def parameters(self) -> Iterable[torch.nn.Parameter]:
        return self.module.parameters()
