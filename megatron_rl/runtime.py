"""What a training run works with, and building it: `Run` holds the policy, the reference, the
rollout engine, the tokenizer's codec (data.prompts.Codec), the data, the scorer and the logger; `setup_run(cfg)`
builds them (resuming from the newest checkpoint under --save, or --load, when there is one).
The training loop (train.py) receives a Run and calls the collaborators themselves.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_rl import checkpoint, config_changes
from megatron_rl.config import TrainConfig
from megatron_rl.data.prompts import Codec
from megatron_rl.errors import ConfigError
from megatron_rl.flags import to_flat_dict
from megatron_rl.metrics_log import MetricsLogger
from megatron_rl.rollout.base import RolloutEngine, SamplingParams
from megatron_rl.rollout.trajectory_log import RolloutLog

if TYPE_CHECKING:
    from megatron_rl.data.prompts import PromptBuilder, PromptDataset
    from megatron_rl.models.policy import Policy
    from megatron_rl.rewards import RewardScorer


@dataclasses.dataclass
class Run:
    """A training run's collaborators. dp_rank / dp_size: this rank's data-parallel position;
    start_step: the step the run starts (or resumes) at; saves_reference: whether each checkpoint
    holds the reference (it is not the initial weights: --ref-reset-interval, or a reference
    resumed from a checkpoint); ahead: the batches the resumed checkpoint saved ahead
    (rollout_queue.RolloutQueue.saved_state), taken by the run's RolloutQueue."""

    cfg: TrainConfig
    policy: Policy
    reference: Policy
    engine: RolloutEngine
    codec: Codec
    train_data: PromptDataset
    eval_data: PromptDataset | None
    scorer: RewardScorer
    logger: MetricsLogger
    dp_rank: int
    dp_size: int
    start_step: int = 0
    saves_reference: bool = False
    ahead: bytes | None = None

    def sampling_params(self, seed: int) -> SamplingParams:
        """The run's sampling settings (--temperature, --top-p, --max-new-tokens) with `seed`."""
        r = self.cfg.rollout
        return SamplingParams(temperature=r.temperature, top_p=r.top_p,
                              max_new_tokens=r.max_new_tokens, stop_token_ids=self.codec.stop_ids,
                              seed=seed,
                              return_routed_experts=self.cfg.algorithm.routing_replay)

    def rollout_log(self) -> RolloutLog:
        """Where and at which steps this rank writes the run's trajectories (--save-rollouts)."""
        return RolloutLog(self.cfg.logging.save_rollouts, self.cfg.checkpoint.save, self.codec,
                          self.dp_rank, self.dp_size)

    def save(self, step: int, data_state: dict | None = None, ahead: bytes | None = None) -> None:
        """Checkpoint `step` (collective); `data_state`: the data position to resume from
        (default: the current one); `ahead`: the batches generated ahead, saved with it."""
        checkpoint.save_run(self.cfg.checkpoint.save, step, self.policy,
                            data_state or self.train_data.state_dict(),
                            self.engine.weight_version,
                            reference=self.reference if self.saves_reference else None,
                            config=config_changes.flat_config(self.cfg), ahead=ahead)

    def close(self) -> None:
        """Stop the engine, the scorer's workers and the logger."""
        self.engine.shutdown()
        self.scorer.close()
        self.logger.close()


def setup_run(cfg: TrainConfig) -> Run:
    """Initialise torch.distributed and megatron's parallel state, load the data and check its
    prompts against the context (load_data: before anything heavy), build the policy and the
    reference, load their weights (resume, --load, or --hf-checkpoint), build the rollout engine
    and sync it to the loaded weights, and open the logs."""
    from megatron_rl.parallel import deterministic_env

    deterministic_env(cfg.deterministic_mode)  # before megatron.core (and TransformerEngine)
    from megatron.core import parallel_state as ps

    from megatron_rl.data.prompts import load_tokenizer
    from megatron_rl.models import ModelArgs
    from megatron_rl.models.policy import Policy
    from megatron_rl.parallel import init_distributed, run_on_rank
    from megatron_rl.rewards import RewardScorer
    from megatron_rl.rollout.factory import build_engine

    algo, save = cfg.algorithm, cfg.checkpoint.save
    dp = init_distributed(cfg.parallel, seed=cfg.seed, deterministic=cfg.deterministic_mode)
    cfg.check_layout(dp)
    os.makedirs(save, exist_ok=True)
    # a resume with other settings than its checkpoint's is refused here, before the models
    resume, weights = checkpoint.checkpoints_to_load(cfg.checkpoint)
    saved_cfg = run_on_rank(0, lambda: config_changes.check_resume(cfg, resume),
                            "comparing the settings with the resumed checkpoint's")
    saved_resets = (saved_cfg or {}).get("ref_reset_interval", algo.ref_reset_interval)
    dtype = torch.bfloat16 if cfg.model.bf16 else torch.float32
    args = ModelArgs.from_pretrained(cfg.model.hf_checkpoint)
    if cfg.algorithm.routing_replay and not args.num_experts:
        raise ValueError(f"--routing-replay replays mixture-of-experts routing; "
                         f"{cfg.model.hf_checkpoint} ({args.architecture}) has no experts")
    codec = Codec.from_tokenizer(load_tokenizer(cfg.model.hf_checkpoint), cfg.data.chat_template,
                                 checkpoint=cfg.model.hf_checkpoint)
    train_data, eval_data = load_data(cfg, codec, args.max_position_embeddings)
    policy = Policy(args, trainable=True, params_dtype=dtype, optim=cfg.optimizer,
                    parallel=cfg.parallel, options=cfg.model.options)
    reference = Policy(args, trainable=False, params_dtype=dtype, parallel=cfg.parallel,
                       options=cfg.model.options)
    extra = checkpoint.load_run_weights(policy, reference, resume, weights,
                                        hf=cfg.model.hf_checkpoint,
                                        ref_hf=cfg.model.ref_checkpoint,
                                        reference_resets=bool(saved_resets))
    start_step = 0
    if extra is not None:
        start_step = int(extra["step"])
        checkpoint.set_rng_state(extra["rng"])
        train_data.load_state_dict(extra["data"])
    evaluated = eval_data if cfg.eval.eval_interval else None  # its first --eval-max-prompts
    engine = build_engine(cfg, policy, codec.pad_id, longest_prompt=lambda: max(
        train_data.max_prompt_tokens(),
        evaluated.max_prompt_tokens(first=cfg.eval.eval_max_prompts) if evaluated else 0))
    if resume is not None or weights is not None or not engine.holds_own_weights:
        engine.update_weights(start_step)  # an engine must serve the loaded weights
    is_logger = not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1
    logger = MetricsLogger(save, enabled=is_logger, start_step=start_step,
                           wandb_cfg=cfg.logging, config=to_flat_dict(cfg))
    if is_logger:  # <save>/config.json (usable as --config) and config_history.jsonl
        config_changes.record_start(save, cfg, start_step, resume)
    saves_reference = bool(algo.ref_reset_interval) or (
        resume is not None and checkpoint.step_reference(resume) is not None)
    return Run(cfg=cfg, policy=policy, reference=reference, engine=engine, codec=codec,
               train_data=train_data, eval_data=eval_data, scorer=RewardScorer(num_workers=2),
               logger=logger, dp_rank=ps.get_data_parallel_rank(), dp_size=dp,
               start_step=start_step, saves_reference=saves_reference,
               ahead=(extra or {}).get("ahead"))


def load_data(cfg: TrainConfig, codec: Codec, max_position_embeddings: int,
              ) -> tuple[PromptDataset, PromptDataset | None]:
    """The run's training and evaluation data (--train-data, --eval-data: prompt_data), each
    prompt that the run will send checked against the context (check_context) for a model of
    `max_position_embeddings` positions. Collective when distributed."""
    d = cfg.data
    builder = prompt_builder(cfg, codec)
    train = prompt_data(cfg, d.train_data, builder, seed=cfg.seed)
    evals = prompt_data(cfg, d.eval_data, builder, shuffle=False) if d.eval_data else None
    checks = [(train, "--train-data", 0)]
    if evals is not None and cfg.eval.eval_interval:  # evaluation reads --eval-max-prompts rows
        checks.append((evals, "--eval-data", cfg.eval.eval_max_prompts))
    train, *evaluated = check_context(cfg, codec, max_position_embeddings, checks)
    return train, evaluated[0] if evaluated else evals


def prompt_data(cfg: TrainConfig, paths: list[str], builder: PromptBuilder, **kwargs
                ) -> PromptDataset:
    """The rows of the JSONL files `paths` as a data.prompts.PromptDataset (`kwargs`: its
    seed, shuffle), prompts made by `builder` (prompt_builder). A row's task may be one no
    verifier knows where an environment of the user's gives the reward
    (rollout.needs.free_tasks); otherwise an unknown task is refused naming file and line."""
    from megatron_rl.data.prompts import PromptDataset
    from megatron_rl.rollout.needs import free_tasks

    any_task = free_tasks(cfg.rollout.rollout_function, cfg.agent)
    return PromptDataset.from_jsonl(paths, builder, any_task, **kwargs)


def prompt_builder(cfg: TrainConfig, codec: Codec) -> PromptBuilder:
    """The data.prompts.PromptBuilder of `cfg`'s prompt flags (--chat-template,
    --prompt-template, --task-instruction; the tool schemas of --agent-tools where the rollout
    function declares tool_schemas and --agent-environment is tools: rollout.needs.prompt_tools)."""
    from megatron_rl.data.prompts import PromptBuilder
    from megatron_rl.rollout.needs import prompt_tools

    d = cfg.data
    tools = prompt_tools(cfg.rollout.rollout_function, cfg.agent)
    return PromptBuilder(tokenizer=codec.tokenizer if d.chat_template else None,
                         template=d.prompt_template, use_chat_template=d.chat_template,
                         task_instruction=d.task_instruction, tools=tools)


def check_context(cfg: TrainConfig, codec: Codec, max_position_embeddings: int,
                  checks: list[tuple[PromptDataset, str, int]]) -> list[PromptDataset]:
    """Each (data, flag, first) of `checks` checked against the context (data/lengths.py) of
    `cfg` for a model of `max_position_embeddings` positions: an overlong prompt among its
    `first` rows (0: all) refused naming `flag`, file and line, or skipped under
    --filter-overlong-prompts; returns the data sets to use. An --agent-max-tokens episode
    (a rollout function declaring episode_context) longer than the context is refused first.
    Collective when distributed: rank 0 counts the tokens, every rank gets the rows to keep."""
    from megatron_rl.data.lengths import ContextLimit, check_prompt_lengths
    from megatron_rl.parallel import run_on_rank
    from megatron_rl.rollout.factory import context_limit
    from megatron_rl.rollout.needs import episode_tokens

    limit = ContextLimit(*context_limit(cfg.rollout, max_position_embeddings),
                         max_new_tokens=cfg.rollout.max_new_tokens)
    if episode_tokens(cfg.rollout.rollout_function, cfg.agent) > limit.tokens:
        raise ConfigError(f"--agent-max-tokens {cfg.agent.agent_max_tokens}: an episode longer "
                          f"than {limit.source} cannot be generated; lower it to at most "
                          f"{limit.tokens}")
    kept = run_on_rank(0, lambda: [
        check_prompt_lengths(data, codec.encode_batch, limit, what=what, first=first,
                             skip=cfg.data.filter_overlong_prompts)
        for data, what, first in checks], "counting the prompts' tokens")
    return [data.subset(*rows) for (data, _, _), rows in zip(checks, kept)]
