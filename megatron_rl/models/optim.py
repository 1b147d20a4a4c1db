"""The optimizer of a trainable Policy: Adam and its learning-rate schedule (OptimConfig, with
megatron's flag names and semantics), and building megatron-core's DDP wrapper, optimizer and
schedule around a model (`build_trainable`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

LR_DECAY_STYLES = ("constant", "linear", "cosine")


def _field(default, help: str, **metadata):
    """An OptimConfig field: its default and its flag's help (and choices and bounds, which
    the trainer's TrainConfig.validate checks), which the trainer's command line shows
    (megatron_rl.config)."""
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

    lr: float = _field(1e-6, min=0, help="peak learning rate, reached after --lr-warmup-iters")
    min_lr: float = _field(0.0, help=(
        "learning rate at the end of the decay (linear, cosine), kept after --lr-decay-iters"))
    weight_decay: float = _field(0.0, min=0, help=(
        "AdamW weight decay (biases and 1-D parameters such as norm weights excluded)"))
    adam_beta1: float = _field(0.9, min=0, lt=1, help=(
        "Adam's beta1 (first-moment decay), in [0, 1)"))
    adam_beta2: float = _field(0.999, min=0, lt=1, help=(
        "Adam's beta2 (second-moment decay), in [0, 1)"))
    adam_eps: float = _field(1e-8, gt=0, help=(
        "Adam's epsilon, added to the denominator for numerical stability; > 0 (at 0 a "
        "parameter whose gradient has always been 0, such as an unseen token's embedding, "
        "would get 0/0)"))
    clip_grad: float = _field(1.0, min=0, help=(
        "clip the global gradient norm to this (0: no clipping)"))
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
        config (megatron's --override-opt_param-scheduler), as do the optimizer's param groups'
        (checkpoint.load_checkpoint), so an unchanged command line resumes exactly and a
        changed one, which a resume refuses unless --allow-config-change accepts it
        (config_changes), takes effect."""
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.validate()
        decay = self.lr_decay_iters if self.lr_decay_iters is not None else self.lr_warmup_iters + 1
        return OptimizerParamScheduler(
            optimizer, init_lr=self.lr_warmup_init, max_lr=self.lr, min_lr=self.min_lr,
            lr_warmup_steps=self.lr_warmup_iters, lr_decay_steps=decay,
            lr_decay_style=self.lr_decay_style, start_wd=self.weight_decay,
            end_wd=self.weight_decay, wd_incr_steps=decay, wd_incr_style="constant",
            use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)


def build_trainable(model: GPTModel, config: TransformerConfig, optim: OptimConfig,
                    params_dtype: torch.dtype, distributed_optimizer: bool) -> tuple[Any, Any, Any]:
    """(megatron DDP around `model`, megatron's Adam over it, its OptimizerParamScheduler).

    DDP reduces gradients in fp32 into fp32 `main_grad` buffers; with bf16/fp16 parameters the
    optimizer keeps fp32 main parameters. `config` (the model's TransformerConfig) receives the
    hooks megatron-core's pipeline schedule calls: finalize_model_grads (the DP gradient
    reduction), DDP's no_sync, and the optimizer's loss scaling."""
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    optim.validate()
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                               overlap_grad_reduce=False,
                                               use_distributed_optimizer=distributed_optimizer)
    ddp = DistributedDataParallel(config, ddp_config, model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=optim.lr, min_lr=optim.min_lr,
                        weight_decay=optim.weight_decay, adam_beta1=optim.adam_beta1,
                        adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps,
                        clip_grad=optim.clip_grad, params_dtype=params_dtype,
                        bf16=params_dtype == torch.bfloat16,
                        fp16=params_dtype == torch.float16,
                        use_distributed_optimizer=distributed_optimizer),
        [ddp])
    scheduler = optim.scheduler(optimizer)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    config.grad_scale_func = optimizer.scale_loss
    return ddp, optimizer, scheduler
