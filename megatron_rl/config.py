"""Training configuration: one typed dataclass, filled from Megatron-style flags and/or YAML.

Precedence: defaults < `--config FILE.yaml` < command-line flags. YAML keys are the dataclass
field names (the flag names with '-' -> '_'). The KL switch defaults to the paper's recommended
configuration: K1 in the reward, beta 0.05, RLOO, loss normalized by the batch's token count.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

import yaml

from megatron_rl.kl import ESTIMATORS, OFF_POLICY_CORRECTIONS, PLACEMENTS, KLConfig
from megatron_rl.loss import AGGREGATIONS, LossConfig
from megatron_rl.advantages import ADVANTAGE_ESTIMATORS


@dataclasses.dataclass
class TrainConfig:
    # model and parallelism
    hf_checkpoint: str = ""               # initial weights and tokenizer (HF dir)
    ref_checkpoint: str | None = None     # reference policy weights (HF dir; default: hf_checkpoint)
    load: str | None = None               # resume from this checkpoint root (default: save dir)
    save: str = "outputs/run"             # checkpoints, logs, plots
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    bf16: bool = False
    # data and task
    train_data: list[str] = dataclasses.field(default_factory=list)  # prepared JSONL files
    eval_data: list[str] = dataclasses.field(default_factory=list)
    chat_template: bool = False
    prompt_template: str = "{prompt}"
    task_instruction: bool = True         # append the task's answer-format instruction
    # RL
    train_iters: int = 100
    num_prompts_per_step: int = 8         # per global batch
    group_size: int = 5                   # samples per prompt (the paper: 5)
    ppo_minibatches: int = 1              # optimizer steps per rollout batch (1 = on-policy)
    ppo_epochs: int = 1
    micro_batch_size: int = 8
    advantage_estimator: str = "rloo"
    loss_aggregation: str = "token-sum-over-batch-tokens"
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_estimator: str = "k1"
    kl_placement: str = "reward"
    kl_coef: float = 0.05
    kl_reward_to_go: bool = False
    kl_off_policy_correction: str = "none"
    kl_is_truncation: float | None = None
    ref_reset_interval: int = 0           # reset the reference to the policy every N steps (0: never)
    async_level: int = 0                  # rollouts may come from a policy up to k steps stale
    # behaviour-policy log-probs for the ratio and the KL: "recompute" = one forward of the
    # trainer over the batch; "rollout" = the engine's; "auto" = the engine's where they are the
    # policy's own (local engine, fp32, temperature 1, top-p 1), else recompute
    old_logprobs: str = "auto"
    # optimizer
    lr: float = 1e-6
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    adam_beta2: float = 0.999
    # sampling
    rollout_engine: str = "local"         # local | vllm | sglang
    rollout_url: str | None = None        # attach to a running server instead of starting one
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    # evaluation, checkpoints, logging
    eval_interval: int = 0
    eval_samples: int = 4                 # k of mean@k / pass@k
    eval_max_prompts: int = 0             # 0: all
    save_interval: int = 0
    log_interval: int = 1
    max_nonfinite_steps: int = 3          # stop after this many consecutive NaN/inf updates
    seed: int = 1234

    def loss_config(self) -> LossConfig:
        return LossConfig(
            clip_low=self.clip_low, clip_high=self.clip_high, aggregation=self.loss_aggregation,
            advantage_estimator=self.advantage_estimator,
            kl=KLConfig(estimator=self.kl_estimator, placement=self.kl_placement,
                        coef=self.kl_coef, reward_to_go=self.kl_reward_to_go,
                        off_policy_correction=self.kl_off_policy_correction,
                        is_truncation=self.kl_is_truncation))

    def use_rollout_logprobs(self) -> bool:
        """Whether the engine's log-probs serve as the behaviour policy's (see old_logprobs).
        The local engine samples from the live fp32 weights, so at temperature 1 without
        truncation its log-probs are the policy's up to float rounding (~1e-6) and the trainer's
        recompute forward would only repeat them."""
        if self.old_logprobs != "auto":
            return self.old_logprobs == "rollout"
        return (self.rollout_engine == "local" and not self.bf16 and self.temperature == 1.0
                and self.top_p == 1.0)

    def validate(self) -> None:
        self.loss_config()  # raises ValueError listing valid names
        for name in ("rollout_engine", "old_logprobs"):  # YAML values bypass argparse's choices
            if getattr(self, name) not in _CHOICES[name]:
                raise ValueError(f"{_flag(name)} {getattr(self, name)!r}; valid: "
                                 + ", ".join(_CHOICES[name]))
        if self.num_prompts_per_step % self.ppo_minibatches:
            raise ValueError("--ppo-minibatches must divide --num-prompts-per-step")
        if not self.hf_checkpoint:
            raise ValueError("--hf-checkpoint is required (initial weights and tokenizer)")
        if not self.train_data:
            raise ValueError("--train-data is required (JSONL files from tools/prepare_data.py)")


_CHOICES = {
    "kl_estimator": sorted(ESTIMATORS), "kl_placement": list(PLACEMENTS),
    "kl_off_policy_correction": list(OFF_POLICY_CORRECTIONS),
    "loss_aggregation": sorted(AGGREGATIONS), "advantage_estimator": sorted(ADVANTAGE_ESTIMATORS),
    "rollout_engine": ["local", "vllm", "sglang"], "old_logprobs": ["auto", "recompute", "rollout"],
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-rl train", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", help="YAML file with TrainConfig fields (flags override it)")
    for f in dataclasses.fields(TrainConfig):
        kw: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS}
        if f.type in ("bool",):
            kw["action"] = argparse.BooleanOptionalAction
        elif f.type.startswith("list"):
            kw["nargs"] = "+"
        elif f.type in ("int",):
            kw["type"] = int
        elif f.type in ("float",):
            kw["type"] = float
        elif f.type == "float | None":
            kw["type"] = float
        if f.name in _CHOICES:
            kw["choices"] = _CHOICES[f.name]
        p.add_argument(_flag(f.name), **kw)
    return p


def parse_config(argv=None) -> TrainConfig:
    """TrainConfig from defaults, an optional YAML file and flags; validated."""
    ns = vars(build_parser().parse_args(argv))
    values: dict[str, Any] = {}
    if ns.get("config"):
        path = ns.pop("config")
        with open(path) as fh:
            loaded = yaml.safe_load(fh) or {}
        known = {f.name for f in dataclasses.fields(TrainConfig)}
        unknown = sorted(set(loaded) - known)
        if unknown:
            raise ValueError(f"{path}: unknown keys {unknown}; valid: {sorted(known)}")
        values.update(loaded)
    ns.pop("config", None)
    values.update(ns)
    cfg = TrainConfig(**values)
    if cfg.load is None:
        cfg.load = cfg.save
    cfg.save = os.path.abspath(cfg.save)
    cfg.validate()
    return cfg
