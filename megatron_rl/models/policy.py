"""A policy (or frozen reference) model in its parallel layout: build, load, run, update, export.

`Policy` owns this rank's pipeline stage of the GPT model, wrapped in megatron-core DDP with
megatron's optimizer when trainable, and runs every forward/backward through megatron-core's
pipeline schedule (`get_forward_backward_func`), so TP/PP/DP all take the same path.

Loss convention: the `loss_fn` given to `forward_backward` returns each microbatch's loss already
normalised by *global* batch quantities (e.g. sum over tokens / total tokens of the whole global
batch, see megatron_rl.loss). The sum of those losses over microbatches and DP ranks is the
global loss. megatron-core's schedule divides each microbatch loss by the number of microbatches
and DDP averages gradients over DP ranks; `_schedule_scale` undoes both, so gradients equal the
gradient of the global loss, independent of the layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Callable, Iterable, cast

import torch
import torch.distributed as dist

from megatron_rl.models.config import ModelArgs, ModelOptions
from megatron_rl.models.gpt import build_gpt_model, thd_params
from megatron_rl.models import hf_mapping, routing
from megatron_rl.parallel import ParallelConfig

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

LR_DECAY_STYLES = ("constant", "linear", "cosine")


def _field(default, help: str, **metadata):
    """An OptimConfig field: its default and its flag's help (and choices), which the trainer's
    command line shows (megatron_rl.config)."""
    return dataclasses.field(default=default, metadata={"help": help, **metadata})


@dataclasses.dataclass
class OptimConfig:
    """Adam and its learning-rate schedule, with megatron's flag names and semantics.

    The schedule is megatron-core's `OptimizerParamScheduler`, counted in optimizer steps that
    applied an update (megatron's iterations): the update of step k (k = 0, 1, ...) uses
    lr(k) = lr_warmup_init + (lr - lr_warmup_init) * k / lr_warmup_iters for k <= lr_warmup_iters,
    then, with r = (k - lr_warmup_iters) / (lr_decay_iters - lr_warmup_iters):
    constant: lr; linear: min_lr + (lr - min_lr) * (1 - r); cosine: min_lr + (lr - min_lr) *
    (1 + cos(pi r)) / 2; min_lr after lr_decay_iters. lr_decay_iters None: the trainer passes
    --train-iters (needed for linear/cosine; unused by constant).
    Weight decay skips biases and 1-D parameters (norm weights), as megatron does.
    """

    lr: float = _field(1e-6, help="peak learning rate, reached after --lr-warmup-iters")
    min_lr: float = _field(0.0, help=(
        "learning rate at the end of the decay (linear, cosine), kept after --lr-decay-iters"))
    weight_decay: float = _field(0.0, help=(
        "AdamW weight decay (biases and 1-D parameters such as norm weights excluded)"))
    adam_beta1: float = _field(0.9, help="Adam's beta1 (first-moment decay)")
    adam_beta2: float = _field(0.999, help="Adam's beta2 (second-moment decay)")
    adam_eps: float = _field(1e-8, help=(
        "Adam's epsilon, added to the denominator for numerical stability"))
    clip_grad: float = _field(1.0, help="clip the global gradient norm to this (0: no clipping)")
    lr_warmup_iters: int = _field(0, help=(
        "optimizer steps of linear warmup from --lr-warmup-init to --lr"))
    lr_decay_style: str = _field("constant", choices=list(LR_DECAY_STYLES), help=(
        "learning-rate schedule after the warmup (megatron's): constant = --lr; linear, cosine "
        "= from --lr down to --min-lr at --lr-decay-iters"))
    lr_decay_iters: int | None = _field(None, help=(
        "optimizer step at which the decay reaches --min-lr; unset: --train-iters x "
        "--ppo-minibatches x --ppo-epochs (linear, cosine)"))
    lr_warmup_init: float = _field(0.0, help="learning rate at the start of the warmup")

    def validate(self) -> None:
        """Raise ValueError naming the flag for an inconsistent schedule."""
        if self.lr < 0 or not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"need 0 <= --min-lr ({self.min_lr}) <= --lr ({self.lr})")
        if not 0 <= self.lr_warmup_init <= self.lr:
            raise ValueError(f"need 0 <= --lr-warmup-init ({self.lr_warmup_init}) <= --lr "
                             f"({self.lr})")
        if self.lr_warmup_iters < 0:
            raise ValueError(f"--lr-warmup-iters must be >= 0, got {self.lr_warmup_iters}")
        if self.lr_decay_iters is None:
            if self.lr_decay_style != "constant":
                raise ValueError(f"--lr-decay-style {self.lr_decay_style} needs --lr-decay-iters "
                                 "(the trainer defaults it to --train-iters x --ppo-minibatches x --ppo-epochs)")
        elif self.lr_decay_iters <= self.lr_warmup_iters:
            raise ValueError(f"--lr-decay-iters ({self.lr_decay_iters}) must be larger than "
                             f"--lr-warmup-iters ({self.lr_warmup_iters})")

    def scheduler(self, optimizer):
        """megatron-core's OptimizerParamScheduler for `optimizer` (already at step 0).

        On resume the checkpoint restores the step count; the other values come from this
        config (megatron's --override-opt_param-scheduler), so an unchanged command line resumes
        exactly and a changed one (say a longer --train-iters) takes effect."""
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.validate()
        decay = self.lr_decay_iters if self.lr_decay_iters is not None else self.lr_warmup_iters + 1
        return OptimizerParamScheduler(
            optimizer, init_lr=self.lr_warmup_init, max_lr=self.lr, min_lr=self.min_lr,
            lr_warmup_steps=self.lr_warmup_iters, lr_decay_steps=decay,
            lr_decay_style=self.lr_decay_style, start_wd=self.weight_decay,
            end_wd=self.weight_decay, wd_incr_steps=decay, wd_incr_style="constant",
            use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)


def _schedule_scale(num_microbatches: int, dp_size: int) -> float:
    """Factor that cancels the schedule's 1/num_microbatches and DDP's 1/dp_size."""
    return float(num_microbatches * dp_size)


def _pad_sequence(tokens: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor | None,
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


def _match_expert_peers(microbatches: list[dict], group) -> list[dict]:
    """`microbatches` padded so that every rank of the expert-parallel `group` runs the same
    number of microbatches of one shape. Under expert parallelism each MoE layer of every forward
    exchanges the ranks' tokens (megatron-core's allgather dispatcher, which needs equal sizes),
    while data-parallel ranks hold batches of their own lengths. Each microbatch grows to the
    group's largest [b, s]: padded rows take copies of the first row and right padding, cut off
    the output again (its "_shape" is the original), a packed row a padding segment (its outputs
    are read through its layout, so nothing to cut). Missing microbatches are padding only,
    marked "_dummy": loss 0, results dropped."""
    from megatron_rl.packing import padding_segments
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
            cu = mb["cu_seqlens"]
            ends = cu[-1] + torch.cumsum(torch.tensor(segs, dtype=cu.dtype), 0).to(cu.device)
            mb.update(tokens=torch.cat([tokens, tokens.new_zeros(1, extra)], dim=1),
                      position_ids=torch.cat([mb["position_ids"], torch.cat(
                          [torch.arange(n_, device=tokens.device) for n_ in segs])[None]], dim=1),
                      cu_seqlens=torch.cat([cu, ends]), max_seqlen=max(mb["max_seqlen"],
                                                                       max(segs)))
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
                mb["tokens"], mb["position_ids"], mask = _pad_sequence(
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
            cu = torch.zeros(len(segs) + 1, dtype=torch.int32)
            cu[1:] = torch.cumsum(torch.tensor(segs), 0)
            dummy.update(position_ids=torch.cat([torch.arange(n_) for n_ in segs])[None].to(dev),
                         cu_seqlens=cu.to(dev), max_seqlen=max(segs))
        out.append(dummy)
    return out


@contextlib.contextmanager
def _hidden_states_output(gpt_model):
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


def _packed_seq_params(batch: dict, device):
    """megatron-core's THD PackedSeqParams for a packed microbatch (see megatron_rl.packing),
    None for a padded one."""
    if "cu_seqlens" not in batch:
        return None
    return thd_params(batch["cu_seqlens"], batch["max_seqlen"], device)


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
            from megatron.core.distributed import (DistributedDataParallel,
                                                   DistributedDataParallelConfig,
                                                   finalize_model_grads)
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

            optim = optim or OptimConfig()
            optim.validate()
            distributed = parallel.use_distributed_optimizer
            ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                       overlap_grad_reduce=False,
                                                       use_distributed_optimizer=distributed)
            model = DistributedDataParallel(self.config, ddp_config, model)
            self.optimizer = get_megatron_optimizer(
                OptimizerConfig(optimizer="adam", lr=optim.lr, min_lr=optim.min_lr,
                                weight_decay=optim.weight_decay, adam_beta1=optim.adam_beta1,
                                adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps,
                                clip_grad=optim.clip_grad, params_dtype=params_dtype,
                                bf16=params_dtype == torch.bfloat16,
                                fp16=params_dtype == torch.float16,
                                use_distributed_optimizer=distributed),
                [model])
            self.scheduler = optim.scheduler(self.optimizer)
            self.config.finalize_model_grads_func = finalize_model_grads
            self.config.no_sync_func = model.no_sync
            self.config.grad_scale_func = self.optimizer.scale_loss
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
        "cu_seqlens" and "max_seqlen": its sequences attend only within themselves.
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
        from megatron.core.pipeline_parallel import get_forward_backward_func

        num_real = len(microbatches)
        if self.ep_size > 1:  # the expert-parallel peers run matching forwards
            from megatron.core import parallel_state as ps

            microbatches = _match_expert_peers(microbatches,
                                               ps.get_expert_model_parallel_group())
        if not microbatches:
            return []
        if reference is not None:
            self._check_same_layout(reference)
        b, s = max((mb["tokens"].shape for mb in microbatches), key=lambda bs: bs[0] * bs[1])
        if self.pp_size > 1 and any(mb["tokens"].shape != (b, s) for mb in microbatches):
            raise ValueError("pipeline parallelism needs microbatches of one shape")
        hidden = self.fused_lm_head and for_scoring
        scale = _schedule_scale(len(microbatches), self.dp_size)
        dev = next(self.module.parameters()).device
        # sequence parallelism splits the sequence over TP ranks: pad it to a multiple of TP on
        # the right (causal attention: the real positions never see the padding), cut it off
        # the logits before the loss
        padded = -(-s // self.tp_size) * self.tp_size if self.sequence_parallel else s

        def loss_wrapper(batch, ref_logits, logits):
            if batch.get("_dummy"):  # expert-parallel padding: no loss, nothing collected
                return logits.float().sum() * 0.0, {}
            if "cu_seqlens" not in batch:  # cut the padding off (sequence parallel, EP peers)
                rows, length = batch.get("_shape", (logits.shape[0], s))
                if (rows, length) != tuple(logits.shape[:2]):
                    logits = logits[:rows, :length].contiguous()
                    if ref_logits is not None:
                        ref_logits = ref_logits[:rows, :length].contiguous()
            extra = () if reference is None else (ref_logits,)
            if collect is not None:
                return torch.zeros((), device=logits.device), collect(batch, logits, *extra)
            loss, metrics = loss_fn(batch, logits, *extra)
            return loss * scale, metrics

        def run(policy, model, tokens, pos, mask, packed, batch=None):
            head = (_hidden_states_output(policy.module) if hidden and policy.is_last_stage
                    else contextlib.nullcontext())
            routes = None if batch is None else batch.get("routed_experts")
            record = None if batch is None else batch.get("record_routes")
            if routes is None and record is None:
                with head:
                    return model(tokens, pos, mask, packed_seq_params=packed)
            if routes is not None:  # replay; with `record`: and note the routers' own choice
                routes = routing.router_order(routes.to(dev), tokens.shape[1], policy.tp_rank,
                                              policy.tp_size, policy.sequence_parallel)
                rec: list = []
                with head, routing.replaying(policy.module, routes,
                                             None if record is None else rec):
                    out = model(tokens, pos, mask, packed_seq_params=packed)
                if record is None:
                    return out
            else:  # the experts chosen
                with head, routing.recording(policy.module) as rec:
                    out = model(tokens, pos, mask, packed_seq_params=packed)
            if record is not None:  # as [b, s, M_stage, k] in the batch's layout
                rows, length = batch.get("_shape", batch["tokens"].shape)
                got = routing.gather_recorded(rec, tokens.shape[0], policy.tp_group,
                                              policy.tp_size, policy.sequence_parallel)
                record.append(got[:rows, :length])
            return out

        def forward_step(data_iterator, model):
            batch = next(data_iterator)
            tokens = batch["tokens"].to(dev)
            bs, ss = tokens.shape
            pos = batch.get("position_ids")
            pos = (torch.arange(ss, device=dev).expand(bs, ss) if pos is None else pos.to(dev))
            mask = batch.get("attention_mask")
            mask = None if mask is None else mask.to(dev)
            packed = _packed_seq_params(batch, dev)
            if packed is not None and ss % self.pad_multiple:
                raise ValueError(f"a packed row of {ss} tokens: it must be a multiple of "
                                 f"{self.pad_multiple} (packing.packed_microbatches pad_multiple)")
            if packed is None and padded != s:
                tokens, pos, mask = _pad_sequence(tokens, pos, mask, padded)
            # the policy replays or records routes (models.routing), the reference neither
            if reference is None:
                return (run(self, model, tokens, pos, mask, packed, batch),
                        functools.partial(loss_wrapper, batch, None))
            received = self.module.decoder.input_tensor  # set by the schedule; None on stage 0
            if received is not None:
                half = received.shape[0] // 2
                self.module.set_input_tensor(received[:half])
                reference.module.set_input_tensor(received[half:])
            out = run(self, model, tokens, pos, mask, packed, batch)
            with torch.no_grad():
                ref_out = run(reference, reference.model[0], tokens, pos, mask, packed)
            if self.is_last_stage:
                return out, functools.partial(loss_wrapper, batch, ref_out)
            return torch.cat([out, ref_out]), functools.partial(loss_wrapper, batch, None)

        for m in self.model:
            m.train(not forward_only)
        if reference is not None:
            for m in reference.model:
                m.train(False)
        # megatron DDP's (a frozen model is not wrapped)
        zero_grad_buffer = getattr(self.model[0], "zero_grad_buffer", None)
        if not forward_only and zero_grad_buffer is not None:
            zero_grad_buffer()
        if self.optimizer is not None and not forward_only:
            self.optimizer.zero_grad()
        fb = get_forward_backward_func()
        context = torch.no_grad() if forward_only else contextlib.nullcontext()
        # with a reference, the stages exchange [2 s, b, h]: both models' hidden states
        seq_length = padded if reference is None or self.pp_size == 1 else 2 * padded
        with context:
            out = fb(forward_step_func=forward_step, data_iterator=iter(microbatches),
                     model=self.model, num_microbatches=len(microbatches), seq_length=seq_length,
                     micro_batch_size=b, forward_only=forward_only)
        if reference is not None:
            reference.module.set_input_tensor(None)
        return out[:num_real] if self.is_last_stage else []

    def _check_same_layout(self, other: "Policy") -> None:
        """`other` must be a frozen model of the same architecture in this rank's layout (the
        reference run inside forward_backward)."""
        mine = (self.tp_size, self.pp_size, self.pp_rank, self.ep_size, self.sequence_parallel,
                self.args.vocab_size, self.args.hidden_size, self.args.num_hidden_layers,
                self.params_dtype, self.fused_lm_head)
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
        from megatron_rl.packing import Layout

        if isinstance(layout, int):
            layout = Layout(packed=False, micro_batch_size=layout)
        B, L = tokens.shape
        mbs = layout.microbatches(tokens, seq_lengths, None, self.pad_multiple, self.pp_size > 1,
                                  routes)

        def collect(batch, out, *ref):
            mb = batch["layout"]
            return torch.stack([mb.to_rows(v.float()) for v in fn(mb, out, *ref)])

        recorded: list = []
        record = {} if own_routes is None else {"record_routes": recorded}
        outs = self.forward_backward([{**mb.inputs, "layout": mb, **record} for mb in mbs], None,
                                     forward_only=True, collect=collect, reference=reference,
                                     for_scoring=True)
        if own_routes is not None:  # int16 on the host, like the batch's routed_experts
            rows = torch.zeros(B, L - 1, *recorded[0].shape[2:], dtype=torch.int16)
            for mb, got in zip(mbs, recorded):
                rows[mb.rows.cpu()] = mb.to_rows(got).to("cpu", torch.int16)
            own_routes.append(rows)
        result = None
        if self.is_last_stage:
            result = torch.zeros(num_outputs, B, L - 1, device=outs[0].device if outs else None)
            for mb, o in zip(mbs, outs):
                result[:, mb.rows.to(result.device)] = o
        return self.broadcast_from_last_stage(result, (num_outputs, B, L - 1), torch.float32)

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
        expected = hf_mapping.expected_shapes(self.args)
        wanted = hf_mapping.stage_names(expected, self.args, self.pp_size, self.pp_rank)
        hf_mapping.check_state_dict(full, {n: s for n, s in expected.items() if n in wanted},
                                    source)
        local = hf_mapping.shard_for_rank(full, self.args, tp_size=self.tp_size,
                                          tp_rank=self.tp_rank, pp_size=self.pp_size,
                                          pp_rank=self.pp_rank, ep_size=self.ep_size,
                                          ep_rank=self.ep_rank)
        own = self.module.state_dict()
        if any(k.endswith("layer_norm_weight") for k in own):
            local = hf_mapping.to_te_names(local)
        with torch.no_grad():
            for name, t in own.items():
                if t is None or name.endswith("_extra_state"):
                    continue
                if name not in local:
                    raise ValueError(f"state dict has no tensor for parameter {name!r}")
                if tuple(local[name].shape) != tuple(t.shape):
                    raise ValueError(f"tensor {name!r}: expected shape {list(t.shape)}, "
                                     f"found {list(local[name].shape)}")
                t.copy_(local[name])
        if self.optimizer is not None:
            # fp16/bf16 training keeps fp32 main params: refresh them from the model.
            reload = getattr(self.optimizer, "reload_model_params", None)
            if reload is not None:
                reload()

    def load_hf(self, path: str) -> None:
        """Load a HF safetensors checkpoint directory: this rank reads only the tensors of its
        pipeline stage (memory-mapped; the ranks of a node share the page cache)."""
        names = hf_mapping.stage_names(hf_mapping.hf_expected_shapes(self.args), self.args,
                                       self.pp_size, self.pp_rank)
        hf = hf_mapping.load_hf_state_dict(path, names)
        self.load_full_state_dict(hf_mapping.hf_to_megatron(hf, self.args, source=path,
                                                            pp_size=self.pp_size,
                                                            pp_rank=self.pp_rank), source=path)

    def full_state_dict(self, dst: int | None = 0) -> dict[str, torch.Tensor] | None:
        """Gather the full megatron state dict (global names, host tensors).

        Collective over the whole world. Returned on global rank `dst` (None elsewhere), or on
        every rank when dst is None.
        """
        local = {k: v.detach() for k, v in self.module.state_dict().items()
                 if v is not None and not k.endswith("_extra_state")}
        return self._gather_full(local, dst)

    def full_grads(self, dst: int | None = 0) -> dict[str, torch.Tensor] | None:
        """Gather the full gradient state dict after forward_backward (DP-reduced main grads)."""
        local = {}
        for name, p in self.module.named_parameters():
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            local[name] = (torch.zeros_like(p) if g is None else g).detach().float()
        return self._gather_full(local, dst)

    def _gather_full(self, local: dict[str, torch.Tensor], dst: int | None):
        """TP shards are all-gathered on the device (NCCL on GPUs), then copied to the host;
        expert-parallel ranks exchange their experts, and pipeline stages everything, as host
        tensors in objects."""
        from megatron.core import parallel_state as ps

        local = hf_mapping.from_te_names(local)
        names = sorted(local)
        tp_group = ps.get_tensor_model_parallel_group()
        gathered = {}
        for name in names:
            if self.tp_size == 1:
                gathered[name] = [local[name]]
            else:
                parts = [torch.empty_like(local[name]) for _ in range(self.tp_size)]
                dist.all_gather(parts, local[name].contiguous(), group=tp_group)
                gathered[name] = parts
            # at TP1 a copy also on CPU: the caller must not hold the live parameters (the
            # all-gathered parts of TP > 1 are fresh tensors already)
            gathered[name] = [t.to("cpu", copy=self.tp_size == 1) for t in gathered[name]]
        shards = {(r, self.pp_rank): {n: gathered[n][r] for n in names}
                  for r in range(self.tp_size)}
        if self.ep_size > 1:
            # every EP rank holds the same non-expert tensors: send only the experts
            shards = {(*k, self.ep_rank): ({n: t for n, t in v.items()
                                            if hf_mapping.is_expert_param(n)}
                                           if self.ep_rank else v) for k, v in shards.items()}
            objs = [None] * self.ep_size
            dist.all_gather_object(objs, shards, group=ps.get_expert_model_parallel_group())
            shards = {k: v for o in objs for k, v in o.items()}
        if self.pp_size > 1:
            objs = [None] * self.pp_size
            dist.all_gather_object(objs, shards, group=ps.get_pipeline_model_parallel_group())
            shards = {k: v for o in objs for k, v in o.items()}
        full = hf_mapping.gather_shards(shards, self.args, self.tp_size, self.pp_size,
                                        self.ep_size)
        if dst is None or dist.get_rank() == dst:
            return full
        return None

    def parameters(self) -> Iterable[torch.nn.Parameter]:
        return self.module.parameters()
