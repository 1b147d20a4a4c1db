"""Evaluation: mean@k and pass@k per task with any rollout engine, through a rollout function
(rollout/functions.py: --rollout-function, in training and in `megatron-rl eval`).

mean@k = average reward-correctness over k samples per prompt (the paper: mean@32, temperature
1.0, top_p 1.0); pass@k = fraction of prompts with at least one correct sample among k. Used by
the trainer (periodic eval) and by `megatron-rl eval`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections import Counter, defaultdict
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_rl.errors import ConfigError
from megatron_rl.metrics import count_metrics
from megatron_rl.parallel import all_reduce, data_parallel_group, dist_rank
from megatron_rl.rollout.base import SamplingParams, on_client, prompt_seed
from megatron_rl.rollout.functions import (RolloutContext, resolve_rollout_function, run_rollout,
                                          trajectory_counts)
from megatron_rl.rollout.trajectory_log import saves_rollouts, write_rollouts

if TYPE_CHECKING:
    from megatron_rl.runtime import Run


def evaluate_engine(ctx: RolloutContext, records, rollout: str = "single-turn",
                    batch_prompts: int = 16, counts: Counter | None = None,
                    kept: list | None = None) -> dict:
    """Per-task {"mean_at_k", "pass_at_k", "num_prompts"} plus "all", k = ctx.group_size; a
    reward >= 1 is correct. The rollout function `rollout` (a --rollout-function value,
    rollout/functions.py) samples and scores `batch_prompts` records at a time, with
    each prompt seeded as in one call (base.prompt_seed: the chunk seeded as its first prompt),
    as an evaluation (no routed experts).
    `counts`, where given, accumulates the trajectories' metadata["counts"] (the agent loop's
    turns, tool calls, ...) and their number under "trajectories". `kept`, where given,
    receives the records and their groups of trajectories (--save-rollouts).

    Collective when the engine is (local engine under TP/PP): every rank passes the same records.
    """
    per_task = defaultdict(lambda: [0.0, 0.0, 0])  # sum of mean correctness, passes, prompts
    params = ctx.params
    for start in range(0, len(records), batch_prompts):
        chunk = records[start:start + batch_prompts]
        p = SamplingParams(**{**params.__dict__, "seed": prompt_seed(params.seed or 0, start),
                              "return_routed_experts": False})
        groups = run_rollout(rollout, dataclasses.replace(ctx, params=p, evaluation=True), chunk)
        correct = torch.tensor([[t.reward for t in g] for g in groups]) >= 1.0
        if kept is not None:
            kept.append((chunk, groups))
        if counts is not None:
            counts.update(trajectory_counts(groups))
            counts["trajectories"] += sum(len(g) for g in groups)
        for r, row in zip(chunk, correct):
            for key in (r.task, "all"):
                acc = per_task[key]
                acc[0] += float(row.float().mean())
                acc[1] += float(row.any())
                acc[2] += 1
    return {t: {"mean_at_k": s / n, "pass_at_k": p_ / n, "num_prompts": n}
            for t, (s, p_, n) in per_task.items()}


def _eval_records(run: Run, limit: int, share: bool = True):
    """(this data-parallel rank's share of the eval records, or all of them, and every task of
    the whole set)."""
    data = run.eval_data
    assert data is not None
    n = len(data) if not limit else min(limit, len(data))
    records = [data.record(0, i) for i in range(n)]
    mine = records[run.dp_rank::run.dp_size] if share else records
    return mine, sorted({r.task for r in records} | {"all"})


def evaluate(run: Run, step: int) -> dict:
    """The trainer's periodic evaluation: flat metrics "eval/<task>/mean_at_k" ... (DP-reduced).
    An engine with one client rank evaluates the whole set there; the in-process engine
    evaluates each data-parallel rank's share (under expert parallelism: the whole set on every
    rank). With --save-rollouts its trajectories go to <save>/rollouts/eval_step_<step>.jsonl."""
    if run.eval_data is None:
        return {}
    cfg, engine, rollout = run.cfg, run.engine, run.cfg.rollout.rollout_function
    ctx = lambda seed: RolloutContext(engine, run.sampling_params(seed=seed),  # noqa: E731
                                      cfg.eval.eval_samples, run.codec, run.scorer, cfg,
                                      step - 1, evaluation=True)  # from 0: RolloutContext.step
    counts: Counter = Counter()
    # (records, groups) chunks, written with --save-rollouts
    kept = [] if saves_rollouts(cfg.logging.save_rollouts, step, "eval") else None

    def save(shared: bool = False, writer: int = 0) -> None:
        if kept is not None:
            write_rollouts(run, step, "eval", [r for recs, _ in kept for r in recs],
                           [g for _, groups in kept for g in groups], shared=shared,
                           writer=writer)

    if engine.client_rank is not None:
        def on_the_client():
            records, _ = _eval_records(run, cfg.eval.eval_max_prompts, share=False)
            res = evaluate_engine(ctx(cfg.seed + 104729), records, rollout, counts=counts,
                                  kept=kept)
            save(writer=dist_rank())
            return res, counts

        res, counts = on_client(engine, on_the_client, f"evaluating at step {step}")
        return {**reduce_eval_results(res, sorted(res), group=None), **_count_means(counts)}
    # expert-parallel ranks exchange tokens inside every forward, so they must generate the
    # same number of batches: each evaluates the whole set (with one seed) instead of a share
    share = run.policy.ep_size == 1
    records, tasks = _eval_records(run, cfg.eval.eval_max_prompts, share=share)
    seed = cfg.seed + 104729 + (run.dp_rank if share else 0)
    res = evaluate_engine(ctx(seed), records, rollout, counts=counts, kept=kept)
    save(shared=share)
    group = data_parallel_group() if share else None
    if share:
        counts = Counter(count_metrics(counts, "", group))  # summed over the DP ranks
    return {**reduce_eval_results(res, tasks, group), **_count_means(counts)}


def _count_means(counts: Counter) -> dict[str, float]:
    """eval/rollout/<name>: the trajectories' counts (evaluate_engine) per trajectory."""
    n = counts.pop("trajectories", 0)
    return {f"eval/rollout/{k}": v / n for k, v in sorted(counts.items())} if n else {}


def reduce_eval_results(res: dict, tasks: list[str], group=None) -> dict[str, float]:
    """Per-task mean@k / pass@k of this rank's prompts -> data-parallel means, flat names
    ("eval/mean_at_k", "eval/<task>/pass_at_k", ...). One all-reduce of a device tensor.

    Collective: every data-parallel rank passes the same `tasks` (all tasks of the whole eval
    set, "all" included), also for tasks it has no prompts of."""
    zero = {"mean_at_k": 0.0, "pass_at_k": 0.0, "num_prompts": 0}
    rows = [res.get(t, zero) for t in tasks]
    sums = [[r["mean_at_k"] * r["num_prompts"], r["pass_at_k"] * r["num_prompts"],
             r["num_prompts"]] for r in rows]
    vals = all_reduce(sums, group).tolist() if tasks else []
    out = {}
    for task, (mean_sum, pass_sum, n) in zip(tasks, vals):
        if n == 0:
            continue
        name = "eval" if task == "all" else f"eval/{task}"
        out[f"{name}/mean_at_k"] = mean_sum / n
        out[f"{name}/pass_at_k"] = pass_sum / n
    return out


def markdown_table(results: dict, k: int) -> str:
    lines = [f"| task | prompts | mean@{k} | pass@{k} |", "|---|---|---|---|"]
    for task in sorted(results, key=lambda t: (t == "all", t)):
        r = results[task]
        lines.append(f"| {task} | {r['num_prompts']} | {r['mean_at_k']:.4f} | "
                     f"{r['pass_at_k']:.4f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    """`megatron-rl eval`: accuracy table of a HF directory or Megatron checkpoint."""
    from megatron_rl.agent.settings import AgentConfig, tool_registry
    from megatron_rl.config import TrainConfig, add_flags, from_flags
    from megatron_rl.data.prompts import PromptBuilder, PromptDataset, load_tokenizer
    from megatron_rl.models import ModelArgs
    from megatron_rl.models.policy import Policy
    from megatron_rl.parallel import ParallelConfig, destroy_distributed, init_distributed
    from megatron_rl.processes import skip_exit_collection
    from megatron_rl.rewards import RewardScorer
    from megatron_rl.rollout.base import check_sampling
    from megatron_rl.rollout.local import LocalEngine
    from megatron_rl.runtime import Codec

    p = argparse.ArgumentParser(prog="megatron-rl eval", description=main.__doc__)
    p.add_argument("--hf-checkpoint", required=True, help=(
        "Hugging Face checkpoint directory: the model architecture (config.json), the tokenizer, "
        "and the weights unless --load gives them. Required"))
    p.add_argument("--load", help=(
        "Megatron checkpoint whose weights are evaluated instead of the --hf-checkpoint ones: a "
        "checkpoint root (its `latest` iteration) or one iteration directory, loaded in this "
        "run's TP/PP layout; the architecture and tokenizer still come from --hf-checkpoint "
        "(default: unset, the HF weights)"))
    p.add_argument("--eval-data", nargs="+", required=True, help=(
        "evaluation prompt files (JSONL, as tools/prepare_data.py writes them), read in file "
        "order; each row's task selects its reward function and its row of the table. Required"))
    p.add_argument("--samples", type=int, default=32, help=(
        "responses sampled per prompt and seed: the k of mean@k and pass@k (a response is "
        "correct when its reward is >= 1) (default: %(default)s)"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help=(
        "sampling seeds, each a full pass of --samples responses per prompt; the table shows "
        "the mean over the seeds, --out also each seed's results (default: %(default)s)"))
    p.add_argument("--temperature", type=float, default=1.0, help=(
        "sampling temperature, >= 0 (1: the policy's own distribution, 0: greedy) (default: "
        "%(default)s)"))
    p.add_argument("--top-p", type=float, default=1.0, help=(
        "nucleus sampling: sample from the smallest set of tokens holding this probability, in "
        "(0, 1] (1: the whole distribution) (default: %(default)s)"))
    p.add_argument("--max-new-tokens", type=int, default=256, help=(
        "length limit of each response, in tokens; a response also ends at the tokenizer's EOS "
        "token, and a cut-off one is scored as it stands (default: %(default)s)"))
    p.add_argument("--max-prompts", type=int, default=0, help=(
        "evaluate the first this many prompts of --eval-data, in file order (0: all) "
        "(default: %(default)s)"))
    p.add_argument("--chat-template", action="store_true", help=(
        "render each prompt with the tokenizer's chat template (a user message and the "
        "generation prompt; the tokenizer then adds no special tokens of its own); off, or a "
        "tokenizer without a template: --prompt-template (default: off)"))
    p.add_argument("--prompt-template", default="{prompt}", help=(
        "format string of a prompt without chat template; {prompt} (required) is the user "
        "message: the problem and, unless --no-task-instruction, its answer-format instruction "
        "(default: %(default)s)"))
    p.add_argument("--no-task-instruction", dest="task_instruction", action="store_false", help=(
        "give each prompt as the bare problem text, without its task's answer-format "
        "instruction (e.g. math: the final answer in \\boxed{}) and, for mmlu, without the "
        "listed choices (default: off, the instruction is added)"))
    p.add_argument("--rollout-function", default="single-turn", help=(
        "what turns the prompts into scored trajectories: a built-in (single-turn: one "
        "response per sample; agent: the multi-turn tool-calling loop, with the --agent-* "
        "flags below) or the import path `module:function` of a rollout function "
        "(megatron_rl/rollout/functions.py; its context's config holds defaults but for the "
        "agent's settings) (default: %(default)s)"))
    p.add_argument("--tensor-model-parallel-size", type=int, default=1, help=(
        "tensor-parallel size of the evaluated model; more than one process: run under "
        "torchrun, with a world size divisible by TP x PP (default: %(default)s)"))
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1, help=(
        "pipeline-parallel size (stages) of the evaluated model; more than one process: run "
        "under torchrun, with a world size divisible by TP x PP (default: %(default)s)"))
    p.add_argument("--out", help=(
        "JSON file for the results: mean@k, pass@k and prompts per task for each seed and "
        "averaged over the seeds, with k and the seeds; its directory is created (default: "
        "unset, the table is only printed)"))
    add_flags(p, AgentConfig)
    a = p.parse_args(argv)
    run_config = TrainConfig(agent=from_flags(AgentConfig, a))
    try:  # before the model is built; each check names its flag
        check_sampling(a.temperature, a.top_p)
        resolve_rollout_function(a.rollout_function)
        for flag, value in (("--samples", a.samples), ("--max-new-tokens", a.max_new_tokens)):
            if value < 1:
                raise ValueError(f"{flag} {value}: must be >= 1")
    except ValueError as e:
        raise ConfigError(str(e)) from e
    init_distributed(ParallelConfig(a.tensor_model_parallel_size, a.pipeline_model_parallel_size))
    args = ModelArgs.from_pretrained(a.hf_checkpoint)
    policy = Policy(args, trainable=False)
    if a.load:
        from megatron_rl.checkpoint import load_checkpoint, resolve_checkpoint

        # checked against its manifest first: a damaged checkpoint is refused naming the file
        load_checkpoint(resolve_checkpoint(a.load), policy, with_optimizer=False)
    else:
        policy.load_hf(a.hf_checkpoint)
    tok = load_tokenizer(a.hf_checkpoint)
    tools = (tool_registry(run_config.agent).schemas() if a.rollout_function == "agent"
             and run_config.agent.agent_environment == "tools" else None)
    builder = PromptBuilder(tokenizer=tok if a.chat_template else None, template=a.prompt_template,
                            use_chat_template=a.chat_template, task_instruction=a.task_instruction,
                            tools=tools)
    data = PromptDataset.from_jsonl(a.eval_data, builder, shuffle=False)
    n = len(data) if not a.max_prompts else min(a.max_prompts, len(data))
    records = [data.record(0, i) for i in range(n)]
    engine = LocalEngine(policy, pad_token_id=tok.pad_token_id or 0)
    codec = Codec.from_tokenizer(tok, a.chat_template, checkpoint=a.hf_checkpoint)
    all_seeds, counts = [], Counter()
    with RewardScorer(num_workers=2) as scorer:
        for seed in a.seeds:
            params = SamplingParams(temperature=a.temperature, top_p=a.top_p,
                                    max_new_tokens=a.max_new_tokens,
                                    stop_token_ids=codec.stop_ids,
                                    seed=seed)
            all_seeds.append(evaluate_engine(
                RolloutContext(engine, params, a.samples, codec, scorer, run_config,
                               evaluation=True), records, a.rollout_function, counts=counts))
    merged = {t: {"mean_at_k": sum(r[t]["mean_at_k"] for r in all_seeds) / len(all_seeds),
                  "pass_at_k": sum(r[t]["pass_at_k"] for r in all_seeds) / len(all_seeds),
                  "num_prompts": all_seeds[0][t]["num_prompts"]} for t in all_seeds[0]}
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(markdown_table(merged, a.samples))
        rollout_counts = _count_means(counts)  # the agent's turns, tool calls, ... per sample
        for name, value in rollout_counts.items():
            print(f"{name}: {value:.4g}")
        if a.out:
            os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
            with open(a.out, "w") as f:
                json.dump({"per_seed": all_seeds, "mean": merged, "k": a.samples,
                           "seeds": a.seeds, "rollout": rollout_counts}, f, indent=2)
    destroy_distributed()
    skip_exit_collection()
