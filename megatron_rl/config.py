"""Training configuration: grouped dataclasses, filled from flat Megatron-style flags and/or YAML.

    TrainConfig
      model       ModelConfig      hf/ref checkpoints, bf16, options: ModelOptions (recompute, fusions)
      parallel    ParallelConfig   TP, PP, sequence parallelism, distributed optimizer
      data        DataConfig       prompt files and how prompts are built
      rollout     RolloutConfig    engine and sampling
      algorithm   AlgorithmConfig  batch shape, PPO minibatches, loss: LossConfig (with its KLConfig)
      optimizer   OptimConfig      Adam and the learning-rate schedule
      eval        EvalConfig       periodic evaluation
      checkpoint  CheckpointConfig save / load / finetune
      train_iters, seed, deterministic_mode, log_interval

Each setting is declared once, in the dataclass of the module that consumes it (ParallelConfig in
parallel.py, ModelOptions in models/config.py, OptimConfig in models/policy.py, LossConfig in
loss.py, KLConfig in kl.py). The command line and YAML keep one flat namespace: a field's flag is
`--<field-name>` with '_' -> '-', prefixed by its group's `prefix` metadata where a name would be
ambiguous (KLConfig's fields are `--kl-*`) or renamed by its `flag` metadata (`--loss-aggregation`).
YAML keys are those flag names with '-' -> '_'.

Precedence: defaults < `--config FILE.yaml` < command-line flags. The KL switch defaults to the
paper's recommended configuration: K1 in the reward, beta 0.05, RLOO, loss normalised by the
batch's token count.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from typing import Any

import yaml

from megatron_rl.advantages import ADVANTAGE_ESTIMATORS
from megatron_rl.kl import ESTIMATOR_NAMES, OFF_POLICY_CORRECTIONS, PLACEMENTS
from megatron_rl.loss import AGGREGATIONS, LossConfig
from megatron_rl.models.config import (ATTENTION_BACKENDS, RECOMPUTE_GRANULARITIES,
                                       RECOMPUTE_METHODS, ModelOptions)
from megatron_rl.models.policy import LR_DECAY_STYLES, OptimConfig
from megatron_rl.parallel import ParallelConfig

_field = dataclasses.field


@dataclasses.dataclass
class ModelConfig:
    hf_checkpoint: str = ""               # initial weights and tokenizer (HF dir)
    ref_checkpoint: str | None = None     # reference policy weights (HF dir; default: the initial weights)
    bf16: bool = False
    options: ModelOptions = _field(default_factory=ModelOptions)


@dataclasses.dataclass
class DataConfig:
    train_data: list[str] = _field(default_factory=list)  # prepared JSONL files
    eval_data: list[str] = _field(default_factory=list)
    chat_template: bool = False
    prompt_template: str = "{prompt}"
    task_instruction: bool = True         # append the task's answer-format instruction


@dataclasses.dataclass
class RolloutConfig:
    # local: the training model itself; process: the same decoder in a process of its own (own
    # weights, overlaps training under --async-level); vllm | sglang: servers
    rollout_engine: str = "local"
    # attach to running servers (one URL or several) instead of starting them
    rollout_url: list[str] = _field(default_factory=list)
    rollout_num_servers: int = 1          # servers to start (vLLM/SGLang), one engine over all
    rollout_host: str = "127.0.0.1"       # bind address of a started server; 0.0.0.0: other nodes
    # how the trainer's weights reach a server after every step: auto = the fastest measured
    # (benchmarks/RESULTS.md "Weight sync": tensor for the process engine; disk for vLLM, and
    # for SGLang on CPU, its tensor path on GPUs); disk = an HF export reloaded by the server; tensor = in memory, same
    # host (process, vLLM: shared-memory buckets; SGLang: update_weights_from_tensor);
    # distributed = SGLang NCCL broadcast (GPUs)
    weight_sync: str = "auto"
    weight_sync_bucket_mb: int = 512     # bucket of a bucketed transfer (tensor, distributed)
    # CPU cores the process engine's child is pinned to (its torch threads: their count);
    # empty: the trainer's affinity and thread count
    rollout_process_cores: list[int] = _field(default_factory=list)
    # GPU memory share of a vLLM/SGLang server started on the trainer's GPUs (vLLM's
    # --gpu-memory-utilization, SGLang's --mem-fraction-static); None: the server's default
    rollout_gpu_memory_utilization: float | None = None
    # a vLLM/SGLang server on the trainer's GPUs frees its GPU memory while the trainer trains
    # (weights to host memory, KV cache dropped: vLLM sleep mode, SGLang
    # release_memory_occupation) and takes it back before the weight sync; GPUs, --async-level 0
    rollout_release_memory: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256

    def __post_init__(self):
        # YAML may give one URL as a string (and None for none)
        if self.rollout_url is None:
            self.rollout_url = []
        elif isinstance(self.rollout_url, str):
            self.rollout_url = [self.rollout_url]
        else:
            self.rollout_url = list(self.rollout_url)
        if self.rollout_num_servers < 1:
            raise ValueError(f"--rollout-num-servers {self.rollout_num_servers}: must be >= 1")
        if self.rollout_num_servers > 1 and self.rollout_url:
            raise ValueError("--rollout-num-servers starts servers, --rollout-url attaches to "
                             "running ones: give one of them")
        if self.rollout_num_servers > 1 and self.rollout_engine in ("local", "process"):
            raise ValueError("--rollout-num-servers needs --rollout-engine vllm or sglang")
        if self.rollout_url and self.rollout_engine in ("local", "process"):
            raise ValueError(f"--rollout-url needs --rollout-engine vllm or sglang, not "
                             f"{self.rollout_engine}")


@dataclasses.dataclass
class AlgorithmConfig:
    num_prompts_per_step: int = 8         # per global batch
    group_size: int = 5                   # samples per prompt (the paper: 5)
    ppo_minibatches: int = 1              # optimizer steps per rollout batch (1 = on-policy)
    ppo_epochs: int = 1
    micro_batch_size: int = 8             # sequences per microbatch without packing
    # pack each microbatch's sequences into one row (attention within each sequence, RoPE
    # restarting), microbatches by token count; --no-sequence-packing: right-padded rows of
    # --micro-batch-size sequences
    sequence_packing: bool = True
    # tokens per packed microbatch (slime's --max-tokens-per-gpu, verl's
    # ppo_max_token_len_per_gpu); 0: --micro-batch-size x the batch's longest sequence
    max_tokens_per_microbatch: int = 0
    loss: LossConfig = _field(default_factory=LossConfig)
    ref_reset_interval: int = 0           # reset the reference to the policy every N steps (0: never)
    async_level: int = 0                  # rollouts may come from a policy up to k steps stale
    # behaviour-policy log-probs for the ratio and the KL: "recompute" = one forward of the
    # trainer over the batch; "rollout" = the engine's; "auto" = the engine's where they are the
    # policy's own (local engine, fp32, temperature 1, top-p 1), else recompute
    old_logprobs: str = "auto"
    max_nonfinite_steps: int = 3          # stop after this many consecutive NaN/inf updates


@dataclasses.dataclass
class EvalConfig:
    eval_interval: int = 0
    eval_samples: int = 4                 # k of mean@k / pass@k
    eval_max_prompts: int = 0             # 0: all


@dataclasses.dataclass
class CheckpointConfig:
    """save: where checkpoints and logs go; a run restarted with the same --save resumes from its
    newest checkpoint there (exactly: optimizer, RNG, data position). load: a checkpoint to start
    from when --save has none: a run's checkpoint resumes it (into --save); a weights-only one
    (tools/convert_checkpoint.py) starts at step 0 with a fresh optimizer, and becomes the
    reference unless --ref-checkpoint is given. finetune: treat even a run's checkpoint under
    --load as weights only (megatron's --finetune)."""
    save: str = "outputs/run"
    load: str | None = None
    finetune: bool = False
    save_interval: int = 0


@dataclasses.dataclass
class TrainConfig:
    model: ModelConfig = _field(default_factory=ModelConfig)
    parallel: ParallelConfig = _field(default_factory=ParallelConfig)
    data: DataConfig = _field(default_factory=DataConfig)
    rollout: RolloutConfig = _field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = _field(default_factory=AlgorithmConfig)
    optimizer: OptimConfig = _field(default_factory=OptimConfig)
    eval: EvalConfig = _field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = _field(default_factory=CheckpointConfig)
    train_iters: int = 100
    seed: int = 1234
    # Megatron's --deterministic-mode: deterministic kernels (parallel.init_distributed), for
    # bitwise-reproducible GPU runs and resumes; slower. CPU runs are deterministic already.
    deterministic_mode: bool = False
    log_interval: int = 1

    @property
    def loss(self) -> LossConfig:
        return self.algorithm.loss

    def use_rollout_logprobs(self) -> bool:
        """Whether the engine's log-probs serve as the behaviour policy's (see old_logprobs).
        The local engine samples from the live fp32 weights (the process engine from an fp32
        copy of them), so at temperature 1 without truncation its log-probs are the policy's up
        to float rounding (~1e-6) and the trainer's recompute forward would only repeat them."""
        mode = self.algorithm.old_logprobs
        if mode != "auto":
            return mode == "rollout"
        if self.overlaps_rollout():
            return True  # the generating weights are gone by the time the batch is trained on
        r = self.rollout
        return (r.rollout_engine in ("local", "process") and not self.model.bf16
                and r.temperature == 1.0
                and r.top_p == 1.0)

    def overlaps_rollout(self) -> bool:
        """Whether an engine with weights of its own (a server, or the process engine) generates
        ahead in the background while the trainer trains (--async-level >= 1): the batch of step
        s comes from weights up to k updates old, and its behaviour log-probs are the engine's
        (those weights' own)."""
        return self.rollout.rollout_engine != "local" and self.algorithm.async_level >= 1

    def validate(self) -> None:
        for name, (path, _) in flag_fields().items():  # YAML values bypass argparse's choices
            value = _get(self, path)
            if name in _CHOICES and value is not None and value not in _CHOICES[name]:
                raise ValueError(f"{_flag(name)} {value!r}; valid: " + ", ".join(_CHOICES[name]))
        a = self.algorithm
        if a.max_tokens_per_microbatch < 0:
            raise ValueError(f"--max-tokens-per-microbatch {a.max_tokens_per_microbatch}: must "
                             "be >= 0 (0: --micro-batch-size x the batch's longest sequence)")
        if a.num_prompts_per_step % a.ppo_minibatches:
            raise ValueError("--ppo-minibatches must divide --num-prompts-per-step")
        if not self.model.hf_checkpoint:
            raise ValueError("--hf-checkpoint is required (model config and tokenizer; initial "
                             "weights unless --load gives them)")
        if not self.data.train_data:
            raise ValueError("--train-data is required (JSONL files from tools/prepare_data.py)")
        engine, sync = self.rollout.rollout_engine, self.rollout.weight_sync
        if engine == "vllm" and sync not in ("auto", "disk", "tensor"):
            raise ValueError(f"--weight-sync {sync} is SGLang's; vLLM takes disk (an HF export "
                             "it reloads) or tensor (shared memory, servers on this host)")
        if engine == "process" and sync not in ("auto", "disk", "tensor"):
            raise ValueError(f"--weight-sync {sync}: the process engine takes tensor (shared "
                             "memory, the default) or disk")
        if self.overlaps_rollout() and self.algorithm.old_logprobs == "recompute":
            raise ValueError("--async-level >= 1 with a server engine generates in the background:"
                             " the generating weights are gone when the batch is trained on, so "
                             "the behaviour log-probs are the engine's (--old-logprobs auto or "
                             "rollout), not a recompute")
        if self.rollout.rollout_release_memory:
            if engine not in ("vllm", "sglang"):
                raise ValueError("--rollout-release-memory frees a vLLM or SGLang server's GPU "
                                 f"memory; --rollout-engine is {engine}")
            if self.algorithm.async_level:
                raise ValueError("--rollout-release-memory needs --async-level 0: under async "
                                 "the server generates while the trainer trains")
            from megatron_rl.parallel import use_cuda

            if not use_cuda():
                raise ValueError("--rollout-release-memory frees GPU memory (vLLM sleep mode, "
                                 "SGLang release_memory_occupation): it needs GPUs")
        if self.checkpoint.finetune and not self.checkpoint.load:
            raise ValueError("--finetune needs --load (the checkpoint whose weights to start from)")
        self.model.options.validate()
        self.optimizer.validate()


_CHOICES = {
    "kl_estimator": list(ESTIMATOR_NAMES), "kl_placement": list(PLACEMENTS),
    "kl_off_policy_correction": list(OFF_POLICY_CORRECTIONS),
    "loss_aggregation": sorted(AGGREGATIONS), "advantage_estimator": sorted(ADVANTAGE_ESTIMATORS),
    "rollout_engine": ["local", "process", "vllm", "sglang"], "old_logprobs": ["auto", "recompute", "rollout"],
    "recompute_granularity": list(RECOMPUTE_GRANULARITIES),
    "recompute_method": list(RECOMPUTE_METHODS), "attention_backend": list(ATTENTION_BACKENDS),
    "lr_decay_style": list(LR_DECAY_STYLES),
    "weight_sync": ["auto", "disk", "tensor", "distributed"],
}


# -- the flat namespace over the groups -------------------------------------------------------

def _walk(cls, path: tuple = (), prefix: str = ""):
    """(flat name, field path, type) for every leaf field under dataclass `cls`."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            yield from _walk(kind, path + (f.name,), prefix + f.metadata.get("prefix", ""))
        else:
            yield f.metadata.get("flag", prefix + f.name), path + (f.name,), kind


def flag_fields() -> dict[str, tuple[tuple[str, ...], Any]]:
    """{flat name (YAML key; flag with '_' -> '-'): (path of attributes in TrainConfig, type)}."""
    out = {}
    for name, path, kind in _walk(TrainConfig):
        if name in out:
            raise TypeError(f"flag --{name} declared twice: {out[name][0]} and {path}")
        out[name] = (path, kind)
    return out


def _get(obj, path):
    for p in path:
        obj = getattr(obj, p)
    return obj


def _build(cls, values: dict[tuple, Any], path: tuple = ()):
    """An instance of dataclass `cls` from {field path: value} (absent: the field's default)."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        p = path + (f.name,)
        if dataclasses.is_dataclass(hints[f.name]):
            kwargs[f.name] = _build(hints[f.name], values, p)
        elif p in values:
            kwargs[f.name] = values[p]
    return cls(**kwargs)


def to_flat_dict(cfg: TrainConfig) -> dict[str, Any]:
    """{flat name: value}: the YAML form of `cfg`."""
    return {name: _get(cfg, path) for name, (path, _) in flag_fields().items()}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _argparse_kwargs(name: str, kind) -> dict[str, Any]:
    kw: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS}
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    base = args[0] if args and typing.get_origin(kind) is not list else kind
    if base is bool:
        kw["action"] = argparse.BooleanOptionalAction
    elif typing.get_origin(kind) is list:
        kw["nargs"] = "+"
        if typing.get_args(kind) in ((int,), (float,)):
            kw["type"] = typing.get_args(kind)[0]
    elif base in (int, float):
        kw["type"] = base
    if name in _CHOICES:
        kw["choices"] = _CHOICES[name]
    return kw


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-rl train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML file with the flags' names as keys (flags override it)")
    groups: dict[str, Any] = {}
    defaults = TrainConfig()
    for name, (path, kind) in flag_fields().items():
        group = path[0] if len(path) > 1 else "run"
        if group not in groups:
            groups[group] = p.add_argument_group(group)
        groups[group].add_argument(_flag(name), help=f"default: {_get(defaults, path)}",
                                   **_argparse_kwargs(name, kind))
    return p


def parse_config(argv=None) -> TrainConfig:
    """TrainConfig from defaults, an optional YAML file and flags; validated."""
    ns = vars(build_parser().parse_args(argv))
    fields = flag_fields()
    flat: dict[str, Any] = {}
    path = ns.pop("config", None)
    if path:
        with open(path) as fh:
            loaded = yaml.safe_load(fh) or {}
        unknown = sorted(set(loaded) - set(fields))
        if unknown:
            raise ValueError(f"{path}: unknown keys {unknown}; valid: {sorted(fields)}")
        flat.update(loaded)
    flat.update(ns)
    cfg = _build(TrainConfig, {fields[k][0]: v for k, v in flat.items()})
    cfg.checkpoint.save = os.path.abspath(cfg.checkpoint.save)
    if cfg.optimizer.lr_decay_iters is None and cfg.optimizer.lr_decay_style != "constant":
        # the schedule counts optimizer steps: ppo_minibatches x ppo_epochs per RL iteration
        a = cfg.algorithm
        cfg.optimizer.lr_decay_iters = cfg.train_iters * a.ppo_minibatches * a.ppo_epochs
    cfg.validate()
    return cfg
