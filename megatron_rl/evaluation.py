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
import shutil
import sys
import tempfile
from collections import Counter, defaultdict
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_rl.errors import ConfigError, run_command
from megatron_rl.metrics import count_metrics
from megatron_rl.parallel import all_reduce, data_parallel_group, dist_rank
from megatron_rl.rollout.base import SamplingParams, on_client, prompt_seed
from megatron_rl.rollout.functions import RolloutContext, run_rollout, trajectory_counts
from megatron_rl.rollout.trajectory_log import saves_rollouts, write_rollouts

if TYPE_CHECKING:
    from megatron_rl.config import TrainConfig
    from megatron_rl.data.prompts import Codec
    from megatron_rl.runtime import Run


def evaluate_engine(ctx: RolloutContext, records, rollout: str = "single-turn",
                    batch_prompts: int = 16, counts: Counter | None = None,
                    kept: list | None = None) -> dict:
    """Per-task {"mean_at_k", "pass_at_k", "num_prompts"} plus "all", k = ctx.group_size (a
    function declaring RolloutNeeds.variable_groups: each group's own size); a reward >= 1 is
    correct. The rollout function `rollout` (a --rollout-function value,
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
        correct = [torch.tensor([t.reward for t in g]) >= 1.0 for g in groups]
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
    ctx = lambda seed: RolloutContext(  # noqa: E731
        engine, run.sampling_params(seed=seed), cfg.eval.eval_samples, run.codec, run.scorer,
        step - 1, evaluation=True, agent=cfg.agent,  # from 0: RolloutContext.step
        args=cfg.rollout.rollout_function_args)
    counts: Counter = Counter()
    # (records, groups) chunks, written with --save-rollouts
    kept = [] if saves_rollouts(cfg.logging.save_rollouts, step, "eval") else None

    def save(shared: bool = False, writer: int = 0) -> None:
        if kept is not None:
            write_rollouts(run.rollout_log(), step, "eval", [r for recs, _ in kept for r in recs],
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


# The TrainConfig settings `megatron-rl eval` takes, declared once (config.py and the modules it
# names): the model, its layout, how prompts are built and checked, every rollout setting (the
# engine's included) and the agent's. Not --rollout-release-memory: it frees a server's memory
# for a training phase, which evaluation has none of.
EVAL_GROUPS = ("rollout", "agent")
EVAL_SETTINGS = ("hf_checkpoint", "bf16", "tensor_model_parallel_size",
                 "pipeline_model_parallel_size", "distributed_timeout_minutes",
                 "rank_wait_timeout_minutes", "chat_template", "prompt_template",
                 "task_instruction", "filter_overlong_prompts")
NOT_IN_EVAL = ("rollout_release_memory",)


def eval_settings() -> set[str]:
    """The flat names (flags.flag_fields) of the TrainConfig settings `megatron-rl eval`
    declares, with train's help, choices, defaults and checks."""
    from megatron_rl.config import TrainConfig
    from megatron_rl.flags import flag_fields

    return {name for name, (path, _) in flag_fields(TrainConfig).items()
            if name not in NOT_IN_EVAL and (path[0] in EVAL_GROUPS or name in EVAL_SETTINGS)}


def build_parser() -> argparse.ArgumentParser:
    """`megatron-rl eval`'s flags: its own (the data, k, seeds, the checkpoint, the output) and
    the training settings that apply (eval_settings), as `megatron-rl train` declares them."""
    from megatron_rl.config import TrainConfig
    from megatron_rl.flags import add_flags

    p = argparse.ArgumentParser(prog="megatron-rl eval", description=main.__doc__)
    own = p.add_argument_group("eval")
    own.add_argument("--eval-data", nargs="+", required=True, help=(
        "evaluation prompt files (JSONL, as tools/prepare_data.py writes them), read in file "
        "order; each row's task selects its reward function and its row of the table. Required"))
    own.add_argument("--load", help=(
        "Megatron checkpoint whose weights are evaluated instead of the --hf-checkpoint ones: a "
        "checkpoint root (its `latest` iteration) or one iteration directory, loaded in this "
        "run's TP/PP layout; the architecture and tokenizer still come from --hf-checkpoint "
        "(default: unset, the HF weights)"))
    own.add_argument("--samples", type=int, default=32, help=(
        "responses sampled per prompt and seed: the k of mean@k and pass@k (a response is "
        "correct when its reward is >= 1) (default: %(default)s)"))
    own.add_argument("--seeds", type=int, nargs="+", default=[0], help=(
        "sampling seeds, each a full pass of --samples responses per prompt; the table shows "
        "the mean over the seeds, --out also each seed's results (default: %(default)s)"))
    own.add_argument("--max-prompts", type=int, default=0, help=(
        "evaluate the first this many prompts of --eval-data, in file order (0: all) "
        "(default: %(default)s)"))
    own.add_argument("--out", help=(
        "JSON file for the results: mean@k, pass@k and prompts per task for each seed and "
        "averaged over the seeds, with k and the seeds; its directory is created (default: "
        "unset, the table is only printed)"))
    own.add_argument("--save-rollouts", dest="rollouts_dir", metavar="DIR", help=(
        "write every sampled trajectory to DIR/eval_seed_<seed>.jsonl, one file per --seeds, "
        "one row each (prompt, response segments, reward; as training's --save-rollouts "
        "writes them; `megatron-rl rollouts FILE` prints them) (default: unset, none written)"))
    own.add_argument("--work-dir", help=(
        "directory for the rollout engine's files, in <dir>/<--rollout-engine>: the logs of "
        "the servers started here, the weight exports of --weight-sync disk (default: unset, "
        "a temporary directory, removed after a successful run)"))
    add_flags(p, TrainConfig, only=eval_settings())
    return p


def parse_args(argv=None) -> tuple[argparse.Namespace, TrainConfig]:
    """(the namespace of `megatron-rl eval`'s flags, the TrainConfig of the settings it shares
    with training, defaults for the rest), checked as `megatron-rl train` checks them (every
    number finite and in its bounds, choices, each group's rules) before anything is loaded:
    a refused flag raises ConfigError naming it."""
    from megatron_rl.config import TrainConfig
    from megatron_rl.flags import from_flags

    a = build_parser().parse_args(argv)
    cfg = from_flags(TrainConfig, a, training=False)  # --eval-data: cfg.data.eval_data
    for flag, value, least in (("--samples", a.samples, 1), ("--max-prompts", a.max_prompts, 0)):
        if value < least:
            raise ConfigError(f"{flag} {value}: must be >= {least}")
    return a, cfg


def main(argv=None) -> None:
    """`megatron-rl eval`: mean@k and pass@k per task of a HF directory or Megatron checkpoint,
    generated by any rollout engine (--rollout-engine, built as training builds it) through
    the rollout function (--rollout-function); the settings it shares with `megatron-rl train`
    have train's flags and checks."""
    a, cfg = parse_args(argv)
    from megatron_rl.parallel import destroy_distributed, init_distributed
    from megatron_rl.processes import skip_exit_collection

    init_distributed(cfg.parallel, seed=cfg.seed)
    try:
        all_seeds, counts = evaluate_checkpoint(a, cfg)
        if not dist.is_initialized() or dist.get_rank() == 0:
            report(a, all_seeds, counts)
    finally:
        destroy_distributed()
    skip_exit_collection()


def evaluate_checkpoint(a: argparse.Namespace, cfg: TrainConfig) -> tuple[list[dict], Counter]:
    """(evaluate_engine's results for each of --seeds, the trajectories' counts) of
    `megatron-rl eval`'s flags `a` and settings `cfg` (parse_args). Checks the data against the
    context before building the model; builds the engine as training does (rollout.factory)
    and stops it (servers, the process engine's child) however the evaluation ends.
    Collective."""
    from megatron_rl.data.prompts import Codec, load_tokenizer
    from megatron_rl.models import ModelArgs
    from megatron_rl.models.policy import Policy
    from megatron_rl.parallel import run_on_rank
    from megatron_rl.rollout.factory import build_engine
    from megatron_rl.runtime import check_context, prompt_builder, prompt_data

    hf = cfg.model.hf_checkpoint
    args = ModelArgs.from_pretrained(hf)
    codec = Codec.from_tokenizer(load_tokenizer(hf), cfg.data.chat_template, checkpoint=hf)
    # before the model: the agent's episode and every evaluated prompt against the context
    data = prompt_data(cfg, cfg.data.eval_data, prompt_builder(cfg, codec), shuffle=False)
    [data] = check_context(cfg, codec, args.max_position_embeddings,
                           [(data, "--eval-data", a.max_prompts)])
    n = len(data) if not a.max_prompts else min(a.max_prompts, len(data))
    records = [data.record(0, i) for i in range(n)]
    policy = Policy(args, trainable=False, parallel=cfg.parallel,
                    params_dtype=torch.bfloat16 if cfg.model.bf16 else torch.float32)
    step = 0  # ctx.step (RolloutContext.step): the periodic evaluation's of these weights
    if a.load:
        from megatron_rl.checkpoint import load_checkpoint, resolve_checkpoint

        # checked against its manifest first: a damaged checkpoint is refused naming the file
        extra = load_checkpoint(resolve_checkpoint(a.load), policy, with_optimizer=False)
        step = max(int(extra.get("step", 0)) - 1, 0)
    else:
        policy.load_hf(hf)
    # the engine's files (server logs, weight exports) under <work dir>/<engine>
    cfg.checkpoint.save = os.path.abspath(a.work_dir) if a.work_dir else run_on_rank(
        0, lambda: tempfile.mkdtemp(prefix="megatron-rl-eval-"), "creating a work directory")
    engine = build_engine(cfg, policy, codec.pad_id,
                          longest_prompt=lambda: data.max_prompt_tokens(first=a.max_prompts))

    def every_seed() -> tuple[list[dict], Counter]:
        from megatron_rl.rewards import RewardScorer

        results: list[dict] = []
        counts: Counter = Counter()
        with RewardScorer(num_workers=2) as scorer:
            for seed in a.seeds:
                params = SamplingParams(temperature=cfg.rollout.temperature,
                                        top_p=cfg.rollout.top_p,
                                        max_new_tokens=cfg.rollout.max_new_tokens,
                                        stop_token_ids=codec.stop_ids, seed=seed)
                ctx = RolloutContext(engine, params, a.samples, codec, scorer, step,
                                     evaluation=True, agent=cfg.agent,
                                     args=cfg.rollout.rollout_function_args)
                # one writer: the local engine's ranks all hold every trajectory
                writes = a.rollouts_dir and dist_rank() == (engine.client_rank or 0)
                kept: list | None = [] if writes else None
                results.append(evaluate_engine(ctx, records, cfg.rollout.rollout_function,
                                               counts=counts, kept=kept))
                if kept is not None:
                    save_rollouts(a.rollouts_dir, seed, step, codec, kept)
        return results, counts

    try:
        if a.load or not engine.holds_own_weights:
            engine.update_weights(step)  # an engine of its own serves the loaded weights
        # an engine with a client rank evaluates there for all ranks; the local engine on
        # every rank, together (its model-parallel groups)
        out = (every_seed() if engine.client_rank is None else
               on_client(engine, every_seed, "evaluating"))
    finally:
        engine.shutdown()  # servers and the process engine's child stopped, also on an error
    if not a.work_dir and (not dist.is_initialized() or dist.get_rank() == 0):
        shutil.rmtree(cfg.checkpoint.save, ignore_errors=True)
    return out


def save_rollouts(directory: str, seed: int, step: int, codec: Codec, kept: list) -> None:
    """Write the trajectories of seed `seed`'s pass, `kept` by evaluate_engine, to
    <directory>/eval_seed_<seed>.jsonl (rollout/trajectory_log.py's rows, kind "eval", step
    `step`; `megatron-rl rollouts FILE` prints them)."""
    from megatron_rl.rollout.trajectory_log import kept_special_tokens, trajectory_rows, write_rows

    rows = trajectory_rows([g for _, groups in kept for g in groups],
                           [r for records, _ in kept for r in records],
                           kept_special_tokens(codec), step=step, kind="eval")
    write_rows(os.path.join(directory, f"eval_seed_{seed}.jsonl"), rows)


def report(a: argparse.Namespace, all_seeds: list[dict], counts: Counter) -> None:
    """Print the table of the mean over the seeds and the trajectories' counts per sample;
    write them to --out with each seed's results."""
    merged = {t: {"mean_at_k": sum(r[t]["mean_at_k"] for r in all_seeds) / len(all_seeds),
                  "pass_at_k": sum(r[t]["pass_at_k"] for r in all_seeds) / len(all_seeds),
                  "num_prompts": all_seeds[0][t]["num_prompts"]} for t in all_seeds[0]}
    print(markdown_table(merged, a.samples))
    rollout_counts = _count_means(counts)  # the agent's turns, tool calls, ... per sample
    for name, value in rollout_counts.items():
        print(f"{name}: {value:.4g}")
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump({"per_seed": all_seeds, "mean": merged, "k": a.samples,
                       "seeds": a.seeds, "rollout": rollout_counts}, f, indent=2)


if __name__ == "__main__":
    sys.exit(run_command("megatron-rl eval", main, sys.argv[1:]))
