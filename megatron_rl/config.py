"""Training configuration: grouped dataclasses, filled from flat Megatron-style flags and/or YAML.

    TrainConfig
      model       ModelConfig      hf/ref checkpoints, bf16, options: ModelOptions (recompute, fusions)
      parallel    ParallelConfig   TP, PP, sequence parallelism, distributed optimizer
      data        DataConfig       prompt files and how prompts are built
      rollout     RolloutConfig    engine, sampling and the rollout function
      algorithm   AlgorithmConfig  batch shape, PPO minibatches, loss: LossConfig (with its KLConfig)
      optimizer   OptimConfig      Adam and the learning-rate schedule
      eval        EvalConfig       periodic evaluation
      checkpoint  CheckpointConfig save / load / finetune
      logging     LoggingConfig    Weights & Biases (metrics_log.py)
      agent       AgentConfig      tools and limits of --rollout-function agent (agent/settings.py)
      train_iters, seed, deterministic_mode

Each setting is declared once, in the dataclass of the module that consumes it (ParallelConfig in
parallel.py, ModelOptions in models/config.py, OptimConfig in models/optim.py, LossConfig in
loss.py, KLConfig in kl.py, LoggingConfig in metrics_log.py, AgentConfig in agent/settings.py), its
flag's help text (and its valid "choices" and bounds, where declared) in the field's metadata. The command line and YAML
keep one flat namespace: a field's flag is
`--<field-name>` with '_' -> '-', prefixed by its group's `prefix` metadata where a name would be
ambiguous (KLConfig's fields are `--kl-*`) or renamed by its `flag` metadata (`--loss-aggregation`).
YAML keys are those flag names with '-' -> '_'.

Checks: TrainConfig.validate (every flag's choices and bounds, every number finite, each group's
`validate`, the rules across groups), run by parse_config before any model is built;
TrainConfig.check_layout(dp_size) once the data-parallel size is known. A refused setting raises
ConfigError (errors.py) naming the flag or key: the commands print it and exit with status 2.

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

from megatron_rl.advantages import GROUP_BASELINE_ESTIMATORS
from megatron_rl.agent.settings import AgentConfig
from megatron_rl.errors import ConfigError
from megatron_rl.flags import add_flags, build, check_declared, file_settings, flag_fields
from megatron_rl.loss import LossConfig
from megatron_rl.metrics_log import LoggingConfig
from megatron_rl.models.config import ModelOptions
from megatron_rl.models.optim import OptimConfig
from megatron_rl.parallel import ParallelConfig, use_cuda
from megatron_rl.rollout.base import check_sampling
from megatron_rl.rollout.factory import ENGINES
from megatron_rl.rollout.multi import ROUTINGS
from megatron_rl.rollout.functions import resolve_rollout_function
from megatron_rl.rollout.needs import rollout_needs

_field = dataclasses.field


def _opt(default=dataclasses.MISSING, *, help: str, factory=dataclasses.MISSING,
         **metadata) -> typing.Any:
    """A setting's field: its default and its flag's help text (what it does, its unit, what it
    applies to), with optional "choices" and bounds ("min", "max", "gt", "lt"; "inf": True
    where infinity is a meaning of its own) that TrainConfig.validate checks (flags.check_declared)."""
    return _field(default=default, default_factory=factory, metadata={"help": help, **metadata})


@dataclasses.dataclass
class ModelConfig:
    hf_checkpoint: str = _opt("", help=(
        "Hugging Face checkpoint directory: the architecture (config.json), the tokenizer, and "
        "the initial weights unless --load gives them; the process engine and started servers "
        "load it too. Required"))
    ref_checkpoint: str | None = _opt(None, help=(
        "Hugging Face directory of the reference policy (pi_ref of the KL). Unset: the initial "
        "weights (a weights-only --load, else --hf-checkpoint)"))
    bf16: bool = _opt(False, help=(
        "bfloat16 parameters for the trainer and the reference (the optimizer keeps fp32 main "
        "parameters and gradients) and bfloat16 for the rollout engine; off: float32 "
        "everywhere. With --old-logprobs auto, bf16 makes the trainer recompute the behaviour "
        "log-probs"))
    options: ModelOptions = _field(default_factory=ModelOptions)

    def validate(self) -> None:
        if not self.hf_checkpoint:
            raise ValueError("--hf-checkpoint is required (model config and tokenizer; initial "
                             "weights unless --load gives them)")
        self.options.validate()


@dataclasses.dataclass
class DataConfig:
    train_data: list[str] = _opt(factory=list, help=(
        "training prompt files (JSONL from tools/prepare_data.py), read in epochs shuffled by "
        "--seed. Required"))
    eval_data: list[str] = _opt(factory=list, help=(
        "evaluation prompt files (JSONL), read in file order every --eval-interval steps; "
        "unset: no evaluation"))
    chat_template: bool = _opt(False, help=(
        "render each prompt with the tokenizer's chat template (a user message and the "
        "generation prompt; the tokenizer adds no special tokens of its own then); off, or a "
        "tokenizer without a template: --prompt-template"))
    prompt_template: str = _opt("{prompt}", help=(
        "format string of a prompt without chat template; {prompt} (required) is the user "
        "message: the problem and, with --task-instruction, its answer-format instruction"))
    task_instruction: bool = _opt(True, help=(
        "append the task's answer-format instruction (e.g. math: the final answer in "
        "\\boxed{}) to each problem; --no-task-instruction: the bare problem text"))
    filter_overlong_prompts: bool = _opt(False, help=(
        "skip the prompts (of --train-data, and of --eval-data where evaluated) whose tokens + "
        "--max-new-tokens exceed the context (the model's max_position_embeddings, or "
        "--rollout-max-context-len where set), with one warning naming them; off: such a "
        "prompt stops the run at startup, named by its file and line"))

    def validate(self) -> None:
        if not self.train_data:
            raise ValueError("--train-data is required (JSONL files from tools/prepare_data.py)")


WEIGHT_SYNC_MODES = ("auto", "disk", "tensor", "distributed")
OLD_LOGPROBS = ("auto", "recompute", "rollout")


@dataclasses.dataclass
class RolloutConfig:
    rollout_engine: str = _opt("local", choices=tuple(ENGINES), help=(
        "what generates the rollouts: local = the training model itself, each data-parallel "
        "replica its share, in the trainer's layout; process = the same decoder in a process "
        "of its own on rank 0 (own weights: overlaps training under --async-level); vllm, "
        "sglang = servers driven by rank 0, started here or attached with --rollout-url"))
    rollout_url: list[str] = _opt(factory=list, help=(
        "vllm/sglang only: attach to running servers at these URLs instead of starting them "
        "(several: one engine over all)"))
    rollout_num_servers: int = _opt(1, min=1, help=(
        "vllm/sglang only: servers to start, one engine over all (not with --rollout-url)"))
    rollout_host: str = _opt("127.0.0.1", help=(
        "vllm/sglang only: bind address of a started server; 0.0.0.0: reachable from other "
        "nodes"))
    rollout_routing: str = _opt("sticky", choices=ROUTINGS, help=(
        "vllm/sglang with several servers: where a request goes. sticky = a multi-turn "
        "episode's request to the server that served its previous turn (its first own turn: "
        "its group's first turn), where its context's KV is in the prefix cache, unless that "
        "server has more than --rollout-sticky-slack requests in flight over the least-loaded "
        "one; least-loaded = every request to the server with the fewest in flight. The "
        "samples are the same either way; calls that name no episode (single-turn rollouts, "
        "evaluation) are spread over the servers either way"))
    rollout_sticky_slack: int = _opt(4, min=0, help=(
        "--rollout-routing sticky: requests in flight a server may have over the least-loaded "
        "server and still take its episodes' next turns; past it a turn goes to the "
        "least-loaded server, and its episode stays there"))
    weight_sync: str = _opt("auto", choices=WEIGHT_SYNC_MODES, help=(
        "how the trainer's weights reach an engine with weights of its own after every step "
        "(ignored by the local engine): disk = an HF export the engine reloads; tensor = in "
        "memory on this host (process, vLLM: shared-memory buckets; SGLang: "
        "update_weights_from_tensor); distributed = SGLang's NCCL broadcast (GPUs); auto = the "
        "fastest measured (benchmarks/RESULTS.md \"Weight sync\"): tensor for the process "
        "engine, disk for vLLM, for SGLang disk on the CPU and tensor on GPUs"))
    weight_sync_bucket_mb: int = _opt(512, min=1, help=(
        "MiB per bucket of a bucketed weight sync: --weight-sync tensor of the process engine "
        "and vLLM, distributed of SGLang"))
    rollout_process_cores: list[int] = _opt(factory=list, help=(
        "process engine only: CPU cores its child is pinned to (its torch threads: their "
        "count); unset: the trainer's affinity and thread count"))
    rollout_process_gpu: int | None = _opt(None, min=0, help=(
        "process engine on GPUs only: CUDA device index its child generates on (e.g. a GPU "
        "no trainer rank uses); unset: global rank 0's own GPU (its LOCAL_RANK)"))
    rollout_gpus: list[int] = _opt(factory=list, help=(
        "vllm/sglang servers started here, on GPUs: the CUDA device of each of the "
        "--rollout-num-servers servers, in order (indices among the devices global rank 0 "
        "sees); unset: server i on device i, beside training rank i of rank 0's node. "
        "--weight-sync distributed needs devices other than 0: training rank 0 is on device 0 "
        "and NCCL refuses two members of one group on one GPU"))
    rollout_gpu_memory_utilization: float | None = _opt(None, help=(
        "vllm/sglang on GPUs only: share of its GPU's total memory a started server takes in "
        "all: weights, KV cache, activations, CUDA graphs. vLLM: its --gpu-memory-utilization. "
        "SGLang, whose --mem-fraction-static counts weights and KV cache only, as a share of "
        "the memory free when it starts: the KV cache this share leaves after the weights and "
        "a reserve (rollout/memory.py) becomes its --max-total-tokens, and weights + KV cache "
        "over the share its --mem-fraction-static. A share whose KV cache cannot hold one "
        "request of --rollout-max-context-len tokens is refused at startup; unset: the "
        "server's default"))
    rollout_max_context_len: int = _opt(0, min=0, help=(
        "vllm/sglang servers started here: tokens of one sequence, prompt and response, a "
        "server takes (vLLM's --max-model-len, SGLang's --context-length), which sizes the KV "
        "cache one request needs; 0: the longest prompt the run sends (--train-data, and "
        "--eval-data where evaluated) in tokens + --max-new-tokens. A longer prompt, or a "
        "length beyond the model's max_position_embeddings, is refused at startup"))
    rollout_release_memory: bool = _opt(False, help=(
        "vllm/sglang on the trainer's GPUs, --async-level 0 only: the server frees its GPU "
        "memory while the trainer trains (weights to host memory, KV cache dropped: vLLM's "
        "sleep mode, SGLang's release_memory_occupation) and takes it back before the weight "
        "sync"))
    partial_rollouts: bool = _opt(False, help=(
        "--async-level >= 1, process/vllm/sglang engines: a weight update does not wait for "
        "the generation in flight: it is cut (the servers paused, their requests aborted), the "
        "new weights are loaded, and each unfinished response continues from its token ids "
        "under them (a fresh prefill, no KV cache kept across the update); each token keeps "
        "the engine's log-prob and weight version that sampled it (logged: "
        "rollout/versions_per_sample, rollout/token_version_lag; docs/rollout.md \"Partial "
        "rollouts\")"))
    max_token_staleness: int | None = _opt(None, min=1, help=(
        "--partial-rollouts: a sample with a token sampled more than this many weight updates "
        "before the policy it trains (the step's) is masked out of the update and left out of "
        "its group's baseline, and counted (rollout/stale_dropped); unset: no limit. The lag "
        "is at most --async-level, so the limit is below it (a limit at or above it is refused) "
        "and drops the samples begun under the oldest weights (a batch with none left trains "
        "on nothing: its update is skipped as a non-finite one, and --max-nonfinite-steps "
        "such steps in a row stop the run)"))
    temperature: float = _opt(1.0, min=0, help=(
        "sampling temperature of the rollouts and of evaluation, >= 0 (0: greedy)"))
    top_p: float = _opt(1.0, help=(
        "nucleus sampling: sample from the smallest set of tokens holding this probability, "
        "in (0, 1] (1: the whole distribution); rollouts and evaluation"))
    max_new_tokens: int = _opt(256, min=1, help=(
        "tokens per response at most (rollouts and evaluation)"))
    rollout_function: str = _opt("single-turn", help=(
        "what turns a step's prompts into scored trajectories, in training and evaluation: "
        "a built-in (single-turn: one response per trajectory from one generate call, scored "
        "by its task's verifier) or the import path `module:function` of a function "
        "fn(ctx, records) -> groups of Trajectory, e.g. a multi-turn agent loop "
        "(megatron_rl/rollout/functions.py: the signature; rollout/needs.py: what it "
        "declares it needs of the run, e.g. the --agent-* settings; docs/rollout.md)"))
    rollout_function_args: dict[str, Any] = _opt(factory=dict, help=(
        "settings of the --rollout-function: a JSON object the function reads as ctx.args "
        "(YAML: a mapping)"))

    def __post_init__(self):
        # YAML may give one URL as a string (and None for none)
        if self.rollout_url is None:
            self.rollout_url = []
        elif isinstance(self.rollout_url, str):
            self.rollout_url = [self.rollout_url]
        else:
            self.rollout_url = list(self.rollout_url)

    def validate(self) -> None:
        """The engine's capabilities (rollout.factory.ENGINES) against the settings for it."""
        check_sampling(self.temperature, self.top_p)
        resolve_rollout_function(self.rollout_function)  # imports it: a bad path fails here
        engine, sync = self.rollout_engine, self.weight_sync
        spec = ENGINES[engine]
        servers = " or ".join(name for name, s in ENGINES.items() if s.servers)
        if self.rollout_num_servers > 1 and self.rollout_url:
            raise ValueError("--rollout-num-servers starts servers, --rollout-url attaches to "
                             "running ones: give one of them")
        if self.rollout_num_servers > 1 and not spec.servers:
            raise ValueError(f"--rollout-num-servers needs --rollout-engine {servers}")
        if self.rollout_url and not spec.servers:
            raise ValueError(f"--rollout-url needs --rollout-engine {servers}, not {engine}")
        if spec.holds_own_weights and sync not in spec.weight_syncs:
            raise ValueError(f"--weight-sync {sync}: --rollout-engine {engine} takes "
                             + ", ".join(spec.weight_syncs))
        if self.rollout_release_memory and not spec.release_memory:
            freeing = " or ".join(name for name, s in ENGINES.items() if s.release_memory)
            raise ValueError(f"--rollout-release-memory frees a {freeing} server's GPU memory; "
                             f"--rollout-engine is {engine}")
        u = self.rollout_gpu_memory_utilization
        if u is not None and not 0 < u <= 1:
            raise ValueError(f"--rollout-gpu-memory-utilization {u}: a share of the GPU's "
                             "memory, in (0, 1]")
        gpus = self.rollout_gpus
        if gpus:
            if not spec.servers or self.rollout_url:
                raise ValueError(f"--rollout-gpus places servers started here (--rollout-engine "
                                 f"{servers}, no --rollout-url)")
            if (len(gpus) != self.rollout_num_servers or len(set(gpus)) != len(gpus)
                    or min(gpus) < 0):
                raise ValueError(f"--rollout-gpus {' '.join(map(str, gpus))}: one device index "
                                 f"(>= 0) per server, a different one each; "
                                 f"--rollout-num-servers is {self.rollout_num_servers}")
        if (sync == "distributed" and spec.servers and not self.rollout_url
                and 0 in self.server_gpus()):
            raise ValueError("--weight-sync distributed broadcasts from training rank 0, on "
                             "device 0, to the servers over NCCL, which refuses two members of "
                             "one group on one GPU; a server started here runs on device 0 ("
                             f"--rollout-gpus {' '.join(map(str, self.server_gpus()))}): give "
                             "--rollout-gpus devices other than 0, or --weight-sync tensor")

    def server_gpus(self) -> list[int]:
        """The CUDA device of each server started here (on GPUs): --rollout-gpus, else server i
        on device i."""
        return list(self.rollout_gpus) or list(range(self.rollout_num_servers))


@dataclasses.dataclass
class AlgorithmConfig:
    num_prompts_per_step: int = _opt(8, min=1, help=(
        "prompts per RL step, over all data-parallel ranks; a batch holds num_prompts_per_step "
        "x --group-size responses. Must be divisible by the data-parallel size x "
        "--ppo-minibatches"))
    group_size: int = _opt(5, min=1, help=(
        "responses sampled per prompt: the group the advantage baseline is taken from (rloo, "
        "grpo and dr_grpo need >= 2)"))
    ppo_minibatches: int = _opt(1, min=1, help=(
        "optimizer steps per pass over a rollout batch, each on an equal share of its prompts; "
        "1: one on-policy update per RL step, more: the later updates are off-policy"))
    ppo_epochs: int = _opt(1, min=1, help=(
        "passes over a rollout batch, each of --ppo-minibatches optimizer steps"))
    micro_batch_size: int = _opt(8, min=1, help=(
        "sequences per microbatch of the trainer's forward/backward with "
        "--no-sequence-packing; with packing, the token budget per microbatch is "
        "micro_batch_size x the batch's longest sequence unless --max-tokens-per-microbatch "
        "gives one"))
    sequence_packing: bool = _opt(True, help=(
        "pack each microbatch's sequences into one row (attention within each sequence, RoPE "
        "restarting) and form microbatches by token count, the groups dealt to the "
        "data-parallel ranks by token count; --no-sequence-packing: right-padded rows of "
        "--micro-batch-size sequences"))
    max_tokens_per_microbatch: int = _opt(0, help=(
        "tokens per packed microbatch (slime's --max-tokens-per-gpu, verl's "
        "ppo_max_token_len_per_gpu); 0: --micro-batch-size x the batch's longest sequence. "
        "Packing only. On a GPU each packed row is padded up to a multiple of about 1/16 of "
        "this budget, or to the budget (not with --moe-aux-loss-coeff), so that a run meets "
        "at most 16 row shapes per budget"))
    loss: LossConfig = _field(default_factory=LossConfig)
    ref_reset_interval: int = _opt(0, min=0, help=(
        "every this many RL steps the reference takes the policy's weights (0: never; saved "
        "with the checkpoints when on)"))
    async_level: int = _opt(0, min=0, help=(
        "k: rollouts run up to k steps ahead of training, from weights up to k updates old. "
        "With the process engine or a server they are generated in the background while the "
        "trainer trains; the local engine generates them ahead in turn (stale, no overlap). "
        "0: generate, then train"))
    old_logprobs: str = _opt("auto", choices=OLD_LOGPROBS, help=(
        "behaviour-policy log-probs for the PPO ratio and the KL: recompute = one forward of "
        "the trainer over the batch; rollout = the engine's; auto = the engine's where they "
        "are the policy's own (local or process engine, fp32, temperature 1, top-p 1, or "
        "generated in the background under --async-level), else recompute"))
    routing_replay: bool = _opt(False, help=(
        "mixture-of-experts policies (R3, rollout routing replay): the engine returns the "
        "experts each token was routed to, and the trainer's forward passes over the rollout "
        "(the behaviour log-probs and the update; not the reference) route every token to "
        "those experts instead of computing their own top-k. The gate weights and the router's "
        "gradient stay the trainer's. Needs an engine that returns routes (local, process, "
        "sglang)"))
    max_nonfinite_steps: int = _opt(3, min=1, help=(
        "stop after this many consecutive RL steps whose update was skipped (a NaN/inf loss or "
        "gradient)"))
    dynamic_sampling: bool = _opt(False, help=(
        "DAPO's dynamic sampling: a group whose task rewards are all equal (no spread: its task "
        "advantage is 0 under rloo, grpo and dr_grpo) does not count towards the batch, and "
        "more prompts of the data, in data order, are generated (same --group-size) until "
        "--num-prompts-per-step groups with spread are in hand; the data position advances "
        "over exactly the prompts the batch consumed (dynamic_sampling.py "
        "sample_informative; docs/results.md \"Dynamic sampling\")"))
    dynamic_sampling_max_rounds: int = _opt(4, min=0, help=(
        "--dynamic-sampling: generation rounds after the first, at most, per RL step; when "
        "they do not find --num-prompts-per-step groups with spread, the step trains on those "
        "found, topped up with the first groups without spread in data order, and warns"))
    dynamic_sampling_keep_kl: bool = _opt(True, help=(
        "--dynamic-sampling with a KL term (--kl-placement other than none): the groups "
        "without spread stay in the batch (task advantage 0, their KL terms kept), so the "
        "update is the gradient of the KL-regularised objective over every prompt drawn and "
        "the batch holds at least --num-prompts-per-step groups with spread, a multiple of "
        "the data-parallel size x --ppo-minibatches groups in all. "
        "--no-dynamic-sampling-keep-kl: DAPO's plain filter, which drops their KL gradient "
        "(biased, docs/results.md \"Dynamic sampling\")"))

    def keeps_filtered_groups(self) -> bool:
        """--dynamic-sampling keeps the groups without spread in the batch for their KL terms
        (--dynamic-sampling-keep-kl, with a KL term placed)."""
        return (self.dynamic_sampling and self.dynamic_sampling_keep_kl
                and self.loss.kl.placement != "none")

    def validate(self) -> None:
        self.loss.validate()
        if self.max_tokens_per_microbatch < 0:
            raise ValueError(f"--max-tokens-per-microbatch {self.max_tokens_per_microbatch}: "
                             "must be >= 0 (0: --micro-batch-size x the batch's longest "
                             "sequence)")
        if self.num_prompts_per_step % self.ppo_minibatches:
            raise ValueError("--ppo-minibatches must divide --num-prompts-per-step")
        estimator = self.loss.advantage_estimator
        if self.dynamic_sampling and estimator not in GROUP_BASELINE_ESTIMATORS:
            raise ValueError(f"--dynamic-sampling with --advantage-estimator {estimator}: a "
                             "group with equal task rewards still has a task gradient without "
                             "a group baseline, so filtering it biases the update; use "
                             + ", ".join(sorted(GROUP_BASELINE_ESTIMATORS)))
        if self.group_size < 2 and estimator in GROUP_BASELINE_ESTIMATORS:
            raise ValueError(f"--group-size {self.group_size} with --advantage-estimator "
                             f"{estimator}: its baseline comes from the other responses to the "
                             "same prompt, so it needs --group-size >= 2 (or --advantage-"
                             "estimator reinforce, no baseline)")


@dataclasses.dataclass
class EvalConfig:
    eval_interval: int = _opt(0, min=0, help=(
        "evaluate on --eval-data every this many RL steps (0: never)"))
    eval_samples: int = _opt(4, min=1, help=(
        "responses per evaluation prompt: the k of mean@k and pass@k (sampled with "
        "--temperature, --top-p, --max-new-tokens)"))
    eval_max_prompts: int = _opt(0, min=0, help=(
        "evaluate the first this many prompts of --eval-data (0: all)"))


@dataclasses.dataclass
class CheckpointConfig:
    save: str = _opt("outputs/run", help=(
        "run directory: checkpoints, metrics.jsonl, tensorboard/, config.json (the current "
        "configuration, usable as --config), config_history.jsonl (one record per start) and "
        "the engines' work directories. A run restarted with the same --save resumes from its "
        "newest checkpoint there (exactly: optimizer, RNG, data position; other settings: "
        "--allow-config-change)"))
    load: str | None = _opt(None, help=(
        "a checkpoint to start from when --save has none: a run's checkpoint resumes it (into "
        "--save); a weights-only one (tools/convert_checkpoint.py) starts at step 0 with a "
        "fresh optimizer and becomes the reference unless --ref-checkpoint is given"))
    finetune: bool = _opt(False, help=(
        "take even a run's checkpoint under --load as weights only: step 0, fresh optimizer "
        "(megatron's --finetune); needs --load"))
    save_interval: int = _opt(0, min=0, help=(
        "save a checkpoint every this many RL steps (0: no periodic saves). The last step "
        "(--train-iters) is always saved, and so is the step a run stops at early "
        "(--exit-signal-handler, --exit-duration-in-mins)"))
    exit_signal_handler: bool = _opt(True, help=(
        "on SIGTERM (what SLURM and Kubernetes send before a time limit or a preemption) or "
        "SIGINT: finish the step in flight, save it to --save, stop the engines and helper "
        "processes, write <save>/stopped_early and exit with status 75 (EX_TEMPFAIL: stopped "
        "before --train-iters, resumable; requeue). All ranks stop at the same step (they agree "
        "at each step boundary). A second SIGINT more than 2 s after the first stops at once "
        "without saving; repeated SIGTERMs are ignored (SIGKILL stops at once). On by default: "
        "a signal costs at most one step instead of up to --save-interval - 1. "
        "--no-exit-signal-handler: the signals stop the run at once, without saving"))
    exit_duration_in_mins: float = _opt(0.0, min=0, help=(
        "wall-clock budget of this process in minutes (fractions allowed; 0: none): at the "
        "first step boundary past it the run saves and exits as on --exit-signal-handler's "
        "signals (status 75, <save>/stopped_early). Set it below a job's time limit by more "
        "than a step and a save"))
    allow_config_change: bool = _opt(False, help=(
        "resume a run checkpoint whose run was saved with other settings: without it such a "
        "resume is refused, listing each difference as --flag: <checkpoint> -> <new>; with it "
        "the new values take effect from the resumed step, the optimizer's --lr, --min-lr, "
        "--weight-decay, --adam-beta1/2, --adam-eps and the schedule (warm-up, decay style "
        "and iterations) included: megatron's --override-opt_param-scheduler, for every "
        "setting. Settings that only steer the run (--train-iters, --save-interval, "
        "--eval-*, --exit-*, timeouts, where generation runs) may change without it; those "
        "that cannot take effect on a resume (the model's architecture, --seed, --bf16, "
        "--use-distributed-optimizer) are refused even with it. Each start is recorded in "
        "<save>/config_history.jsonl"))

    def validate(self) -> None:
        if self.finetune and not self.load:
            raise ValueError("--finetune needs --load (the checkpoint whose weights to start from)")


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
    logging: LoggingConfig = _field(default_factory=LoggingConfig)
    agent: AgentConfig = _field(default_factory=AgentConfig)
    train_iters: int = _opt(100, min=0, help=(
        "RL steps (a rollout batch and its updates each); a resumed run continues to this step"))
    seed: int = _opt(1234, help=(
        "seed of the prompt order, the sampling (step s: seed + 7919 s), the model's "
        "initialisation RNGs and the engines"))
    deterministic_mode: bool = _opt(False, help=(
        "megatron's --deterministic-mode: deterministic kernels, cuBLAS with a fixed workspace "
        "and NCCL's ring algorithm (also in the process engine's child), for bitwise-"
        "reproducible GPU runs and resumes; slower. CPU runs are deterministic already"))

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
        return (ENGINES[r.rollout_engine].trainer_numerics and not self.model.bf16
                and r.temperature == 1.0
                and r.top_p == 1.0)

    def overlaps_rollout(self) -> bool:
        """Whether an engine with weights of its own (a server, or the process engine) generates
        ahead in the background while the trainer trains (--async-level >= 1): the batch of step
        s comes from weights up to k updates old, and its behaviour log-probs are the engine's
        (those weights' own)."""
        return (ENGINES[self.rollout.rollout_engine].holds_own_weights
                and self.algorithm.async_level >= 1)

    def validate(self, training: bool = True) -> None:
        """Raise ValueError naming the flag for an invalid or inconsistent setting: every flag's
        declared choices and minimum (YAML values bypass argparse's checks), then each group's
        own rules, then the rules across groups. The one place a TrainConfig is checked;
        `check_layout` adds what needs the data-parallel size. `training`: False for a
        configuration that only generates (`megatron-rl eval`), which reads no --train-data."""
        check_declared(self, TrainConfig)
        self.model.validate()
        self.parallel.validate()
        if training:
            self.data.validate()
        self.rollout.validate()
        self.algorithm.validate()
        self.checkpoint.validate()
        self.optimizer.validate()
        self.logging.validate()
        unread = self.agent.changed_flags()
        if unread and not rollout_needs(self.rollout.rollout_function).agent_settings:
            raise ValueError(f"{', '.join(unread)} set, but nothing reads them with "
                             f"--rollout-function {self.rollout.rollout_function}, which does "
                             "not read the agent settings (--rollout-function agent does, and "
                             "a function declaring RolloutNeeds.agent_settings): remove them")
        self.agent.validate()
        if self.loss.rollout_correction.enabled and self.use_rollout_logprobs():
            raise ValueError(f"--rollout-correction {self.loss.rollout_correction.mode} weighs "
                             "the engine's samples by pi_old/mu, but the behaviour log-probs are "
                             "the engine's own here (weight 1): set --old-logprobs recompute")
        if (self.overlaps_rollout() and self.algorithm.old_logprobs == "recompute"
                and not self.loss.rollout_correction.enabled):
            # with a rollout correction the recompute is the decoupled behaviour policy: the
            # current weights, with pi_old/mu correcting the engine's staler samples
            raise ValueError("--async-level >= 1 with a server engine generates in the background:"
                             " the generating weights are gone when the batch is trained on, so "
                             "the behaviour log-probs are the engine's (--old-logprobs auto or "
                             "rollout), not a recompute, unless --rollout-correction weighs the "
                             "engine's samples against the recompute")
        buffer = self.loss.overlong_buffer_len
        if buffer and buffer >= self.rollout.max_new_tokens:
            raise ValueError(f"--overlong-buffer-len {buffer}: the last tokens before "
                             f"--max-new-tokens ({self.rollout.max_new_tokens}) that are "
                             "penalised; must be less than it")
        function = self.rollout.rollout_function
        needs = rollout_needs(function)
        if buffer and not needs.single_response:
            raise ValueError(f"--overlong-buffer-len measures a response against "
                             f"--max-new-tokens, one generate call's budget; --rollout-function "
                             f"{function} does not declare one response per trajectory "
                             "(RolloutNeeds.single_response; --overlong-filtering works with "
                             "any)")
        if self.algorithm.routing_replay and not needs.routing_replay:
            raise ValueError(f"--routing-replay with --rollout-function {function}: the "
                             "engine's experts are recorded per generate call, and its "
                             "trajectories are not one call's (RolloutNeeds.routing_replay); "
                             "replay is for single-turn rollouts")
        if (needs.variable_groups and self.parallel.pipeline_model_parallel_size > 1
                and not self.algorithm.sequence_packing):
            raise ValueError(f"--rollout-function {function} returns groups of their own sizes "
                             "(RolloutNeeds.variable_groups), and --pipeline-model-parallel-size "
                             f"{self.parallel.pipeline_model_parallel_size} with "
                             "--no-sequence-packing needs every microbatch of one shape: drop "
                             "--no-sequence-packing")
        if self.algorithm.routing_replay:
            engine = self.rollout.rollout_engine
            if not ENGINES[engine].routed_experts:
                raise ValueError(f"--routing-replay needs an engine that returns each token's "
                                 f"experts; --rollout-engine {engine} does not (local, process "
                                 "do: " + ", ".join(n for n, e in ENGINES.items()
                                                   if e.routed_experts) + ")")
            if self.model.options.recompute_granularity:
                raise ValueError("--routing-replay with --recompute-granularity: the recomputed "
                                 "forward would route the tokens again; turn one off")
            if (not ENGINES[engine].routed_experts_pipelined
                    and self.parallel.pipeline_model_parallel_size > 1):
                pipelined = ", ".join(n for n, e in ENGINES.items() if e.routed_experts_pipelined)
                raise ValueError(f"--routing-replay with --rollout-engine {engine} needs "
                                 "--pipeline-model-parallel-size 1 (it generates in the "
                                 "trainer's layout, where each stage records only its own "
                                 f"layers); use --rollout-engine {pipelined}")
        self._check_partial_rollouts()
        if self.rollout.rollout_release_memory:
            if self.algorithm.async_level:
                raise ValueError("--rollout-release-memory needs --async-level 0: under async "
                                 "the server generates while the trainer trains")
            if not use_cuda():
                raise ValueError("--rollout-release-memory frees GPU memory (vLLM sleep mode, "
                                 "SGLang release_memory_occupation): it needs GPUs")

    def _check_partial_rollouts(self) -> None:
        """--partial-rollouts and --max-token-staleness against the engine and the loop."""
        r = self.rollout
        if r.max_token_staleness is not None and not r.partial_rollouts:
            raise ValueError("--max-token-staleness limits the versions of a partial rollout's "
                             "tokens: it needs --partial-rollouts")
        if not r.partial_rollouts:
            return
        spec = ENGINES[r.rollout_engine]
        if not spec.partial_rollouts:
            able = ", ".join(n for n, e in ENGINES.items() if e.partial_rollouts)
            raise ValueError(f"--partial-rollouts with --rollout-engine {r.rollout_engine}: "
                             f"{spec.no_partial_rollouts}; use --rollout-engine {able}")
        if self.algorithm.async_level < 1:
            raise ValueError("--partial-rollouts interrupts a generation running in the "
                             "background at a weight update: it needs --async-level >= 1")
        if self.deterministic_mode:
            raise ValueError("--partial-rollouts with --deterministic-mode: where a weight "
                             "update cuts a response depends on timing, so the samples cannot "
                             "be reproduced; turn one off")
        k = r.max_token_staleness
        if k is not None and k >= self.algorithm.async_level:
            raise ValueError(f"--max-token-staleness {k}: a token lags at most --async-level "
                             f"{self.algorithm.async_level} weight updates behind the policy it "
                             "trains, so this limit never drops a sample; set it below "
                             "--async-level, or leave it unset")
        if not rollout_needs(r.rollout_function).token_versions:
            raise ValueError(f"--partial-rollouts with --rollout-function {r.rollout_function}: "
                             "a cut generate call's tokens come from several weight versions, "
                             "which its trajectories must carry (rollout_needs token_versions: "
                             "single-turn and the agent loop do, and a function wrapping them)")
        if self.algorithm.routing_replay and spec.servers:
            raise ValueError(f"--partial-rollouts with --routing-replay on --rollout-engine "
                             f"{r.rollout_engine}: a server streams a cut response's tokens, not "
                             "its routed experts; use --rollout-engine process, or drop one")
        if not self.use_rollout_logprobs() and not self.loss.rollout_correction.enabled:
            raise ValueError("--partial-rollouts: a sample's tokens come from several weight "
                             "versions, and the behaviour log-probs must be each token's own "
                             "engine log-prob (--old-logprobs auto or rollout), or a "
                             "--rollout-correction must weigh them against the recompute "
                             "(docs/results.md \"Mixed versions\")")

    def check_layout(self, dp_size: int) -> None:
        """Raise ConfigError where the batch does not split over `dp_size` data-parallel ranks
        (known once the process groups exist): each PPO minibatch takes an equal share of the
        prompts on every rank, and under pipeline parallelism without packing all microbatches
        need one shape."""
        algo = self.algorithm
        if algo.num_prompts_per_step % (dp_size * algo.ppo_minibatches):
            raise ConfigError(f"--num-prompts-per-step {algo.num_prompts_per_step} must be "
                              f"divisible by data-parallel size {dp_size} x --ppo-minibatches "
                              f"{algo.ppo_minibatches}")
        per_minibatch = algo.num_prompts_per_step // (dp_size * algo.ppo_minibatches) * algo.group_size
        if (per_minibatch % algo.micro_batch_size and self.parallel.pipeline_model_parallel_size > 1
                and not algo.sequence_packing):
            raise ConfigError(f"--micro-batch-size {algo.micro_batch_size} must divide the "
                              f"{per_minibatch} sequences of a minibatch per data-parallel rank under "
                              "pipeline parallelism (all microbatches need one shape)")



# Keys a config file may hold that no setting reads (a run's config.json written when they were
# settings): accepted with a warning and ignored.
_IGNORED_KEYS = frozenset({"log_interval"})


def build_parser() -> argparse.ArgumentParser:
    """`megatron-rl train`'s parser: --config and a flag for every TrainConfig setting (flags.py),
    in one argument group per settings group."""
    p = argparse.ArgumentParser(prog="megatron-rl train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML file with the flags' names as keys (flags override it)")
    add_flags(p, TrainConfig, top="run")
    return p


def parse_config(argv=None) -> TrainConfig:
    """TrainConfig from defaults, an optional YAML file and flags; validated. A setting that is
    refused raises ConfigError naming the flag or key (argparse itself exits with status 2 for
    a flag it cannot parse)."""
    try:
        return _parse_config(argv)
    except ConfigError:
        raise
    except ValueError as e:  # every check of a setting raises ValueError naming it
        raise ConfigError(str(e)) from e


def _parse_config(argv) -> TrainConfig:
    ns = vars(build_parser().parse_args(argv))
    fields = flag_fields(TrainConfig)
    path = ns.pop("config", None)
    flat: dict[str, Any] = file_settings(path, TrainConfig, _IGNORED_KEYS) if path else {}
    flat.update(ns)
    cfg = build(TrainConfig, {fields[k][0]: v for k, v in flat.items()})
    cfg.checkpoint.save = os.path.abspath(cfg.checkpoint.save)
    if cfg.optimizer.lr_decay_iters is None and cfg.optimizer.lr_decay_style != "constant":
        # the schedule counts optimizer steps: ppo_minibatches x ppo_epochs per RL iteration
        a = cfg.algorithm
        cfg.optimizer.lr_decay_iters = cfg.train_iters * a.ppo_minibatches * a.ppo_epochs
    cfg.validate()
    return cfg
