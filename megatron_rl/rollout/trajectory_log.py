"""Print the trajectories a run saved with --save-rollouts, one readably or a line each.

`megatron-rl rollouts FILE` shows a trajectory's prompt and each segment of its response (the
policy's tokens, the environment's) with its reward and end; this module also writes them.

What the run writes (`write_rollouts`): with --save-rollouts N, the trajectories of every Nth
step's batch and of every periodic evaluation, one JSON object a line, in

    <save>/rollouts/step_000010.jsonl        the batch trained at step 10
    <save>/rollouts/eval_step_000010.jsonl   the evaluation at step 10

A row (`trajectory_row`) holds one trajectory (rollout/functions.py's Trajectory) and its prompt
record: step, kind ("train" or "eval"), the record's uid, task, answer and, where the data file
gave them, source and row; `group` (the prompt's index in the step's batch, or in the
evaluation set) and `index` (the sample's index in its group); `prompt_ids` and `prompt` (their
text); `segments`, the response cut into maximal runs of one source:

    {"source": "policy", "text": ..., "ids": [...], "logprobs": [...]}   (response_mask 1)
    {"source": "environment", "text": ..., "ids": [...]}                  (response_mask 0)

(their ids concatenate to response_ids, their sources are its mask, the policy segments'
logprobs are the engine's rollout_logprobs; each text is its ids decoded with special tokens
kept, so a character whose bytes span two segments shows as a replacement character in both);
`policy_tokens` and `environment_tokens`; reward, reward_error, finish_reason; and from the
trajectory's metadata `end` (the agent loop's end reason), `env_info` (the environment's
info), `counts`, `turn_rewards` and `turn_ends` where the trajectory has per-turn rewards,
and `token_versions` (the weight version of each token) under --partial-rollouts. An episode
its environment broke has mask 0 everywhere, so its policy's turns are environment segments.

Who writes: the rank that holds the whole batch. With an engine that has a client rank (the
process engine, servers) that rank; with the in-process engine each data-parallel replica rolls
out its share, and the shares are gathered to global rank 0 (one all_gather_object over the
data-parallel group, every Nth step only), which writes one file in the batch's order. A step
redone after a resume writes its file again (replaced through a rename, never torn). Writing is
a record of the run, not part of it: a failure (a full disk, a directory made unwritable) warns
naming the file and the error, and the run goes on.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import sys
import warnings
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    from megatron_rl.batch import Trajectory
    from megatron_rl.data.prompts import Codec, PromptRecord

ROLLOUTS_DIR = "rollouts"
KINDS = ("train", "eval")
_NAME = {"train": "step_{:06d}.jsonl", "eval": "eval_step_{:06d}.jsonl"}
_STEP = re.compile(r"^(eval_)?step_(\d+)\.jsonl$")


def rollouts_path(save: str, step: int, kind: str) -> str:
    """The file of `step`'s trajectories of `kind` ("train": the batch trained at `step`;
    "eval": the evaluation at `step`) under the run directory `save`."""
    return os.path.join(save, ROLLOUTS_DIR, _NAME[kind].format(step))


def saves_rollouts(every: int, step: int, kind: str) -> bool:
    """Whether --save-rollouts `every` writes `step`'s trajectories of `kind`: every Nth step's
    batch (steps counted from 1, as logged), every evaluation; none at 0."""
    return every > 0 and (kind == "eval" or step % every == 0)


def kept_special_tokens(codec: Codec) -> Callable[[list[int]], str]:
    """Ids -> text with the run's tokenizer, special tokens kept (the chat template's headers,
    the end of a turn): the text the model read and wrote."""
    return lambda ids: codec.tokenizer.decode(ids, skip_special_tokens=False)


def segments(response_ids: Sequence[int], response_mask: Sequence[int],
             rollout_logprobs: Sequence[float], decode: Callable[[list[int]], str]
             ) -> list[dict[str, Any]]:
    """The response as maximal runs of equal mask, in order: {"source": "policy" (mask 1) or
    "environment" (mask 0), "text", "ids"}, with "logprobs" (the engine's) on policy ones."""
    out: list[dict[str, Any]] = []
    start = 0
    for end in range(1, len(response_ids) + 1):
        if end < len(response_ids) and response_mask[end] == response_mask[start]:
            continue
        ids = list(response_ids[start:end])
        seg: dict[str, Any] = {"source": "policy" if response_mask[start] else "environment",
                               "text": decode(ids), "ids": ids}
        if response_mask[start]:
            seg["logprobs"] = [float(x) for x in rollout_logprobs[start:end]]
        out.append(seg)
        start = end
    return out


def response_of(row: dict) -> tuple[list[int], list[int], list[float]]:
    """A row's response as the trajectory held it: (response_ids, response_mask,
    rollout_logprobs), 0 as the log-prob of an environment token."""
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    for seg in row["segments"]:
        policy = seg["source"] == "policy"
        ids += seg["ids"]
        mask += [int(policy)] * len(seg["ids"])
        logprobs += seg["logprobs"] if policy else [0.0] * len(seg["ids"])
    return ids, mask, logprobs


def trajectory_row(t: Trajectory, record: PromptRecord, decode: Callable[[list[int]], str], *,
                   step: int, kind: str, group: int, index: int) -> dict[str, Any]:
    """One JSONL row of trajectory `t` of prompt `record` (the module docstring lists the
    fields)."""
    row: dict[str, Any] = {"step": step, "kind": kind, "uid": record.uid, "task": record.task,
                           "answer": record.answer}
    row.update({k: record.metadata[k] for k in ("source", "row") if k in record.metadata})
    policy = sum(t.response_mask)
    row.update(group=group, index=index, prompt_ids=list(t.prompt_ids),
               prompt=decode(list(t.prompt_ids)),
               segments=segments(t.response_ids, t.response_mask, t.rollout_logprobs, decode),
               policy_tokens=policy, environment_tokens=len(t.response_ids) - policy,
               reward=t.reward, reward_error=t.reward_error, finish_reason=t.finish_reason)
    meta = t.metadata or {}
    row.update(end=meta.get("end"), env_info=meta.get("env_info") or {},
               counts=meta.get("counts") or {})
    turn_rewards = getattr(t, "turn_rewards", None)
    if turn_rewards is not None:
        row["turn_rewards"] = [float(r) for r in turn_rewards]
        row["turn_ends"] = [int(e) for e in t.turn_ends or ()]
    if t.token_versions is not None:
        row["token_versions"] = [int(v) for v in t.token_versions]
    return row


def trajectory_rows(groups: Sequence[Sequence[Trajectory]], records: Sequence[PromptRecord],
                    decode: Callable[[list[int]], str], *, step: int, kind: str,
                    group_ids: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """The rows of `groups` (one per record of `records`, in order), group by group; the
    groups' indices `group_ids` (default 0, 1, ...)."""
    if len(groups) != len(records):
        raise ValueError(f"{len(groups)} groups for {len(records)} prompt records")
    ids = range(len(groups)) if group_ids is None else group_ids
    return [trajectory_row(t, rec, decode, step=step, kind=kind, group=g, index=j)
            for g, group, rec in zip(ids, groups, records) for j, t in enumerate(group)]


def write_rows(path: str, rows: Sequence[dict]) -> bool:
    """Write `rows` to `path` as JSONL (its directory made; through a temporary file of this
    process and a rename, so a reader never sees half a file, and processes writing the same
    file leave one whole). A failure warns, naming the file and the error, and returns False:
    the trajectories are a record of the run, not part of it."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
        os.replace(tmp, path)
        return True
    except Exception as e:  # noqa: BLE001 -- never stops training
        try:
            os.remove(tmp)
        except OSError:
            pass
        warnings.warn(f"{path}: writing {len(rows)} trajectories failed ({type(e).__name__}: "
                      f"{e}); training goes on (--save-rollouts)", stacklevel=2)
        return False


@dataclasses.dataclass(frozen=True)
class RolloutLog:
    """Where a run writes its trajectories, and which steps: `every` (--save-rollouts; 0:
    none) under the run directory `save` (--save), with the run's `codec` (the special
    tokens a row keeps) and this rank's data-parallel position (`dp_rank` of `dp_size`)."""
    every: int
    save: str
    codec: Codec
    dp_rank: int = 0
    dp_size: int = 1


def write_rollouts(log: RolloutLog, step: int, kind: str, records: Sequence[PromptRecord],
                   groups: Sequence[Sequence[Trajectory]], *, shared: bool = False,
                   writer: int = 0) -> None:
    """Write `step`'s trajectories of `kind` under log.save when log.every says so
    (saves_rollouts). `groups` are the rollout function's for `records`: the whole batch,
    written by global rank `writer` (the others return at once); or, `shared`, this
    data-parallel rank's share (records dp_rank, dp_rank + dp_size, ...), gathered to global
    rank 0 in the batch's order -- collective over the data-parallel group then, so every
    rank calls it with the same `step` and `kind`."""
    if not saves_rollouts(log.every, step, kind):
        return
    from megatron_rl.parallel import dist_rank

    shared = shared and log.dp_size > 1
    if not shared and dist_rank() != writer:
        return
    group_ids = ([log.dp_rank + log.dp_size * j for j in range(len(groups))] if shared
                 else None)
    rows = trajectory_rows(groups, records, kept_special_tokens(log.codec), step=step, kind=kind,
                           group_ids=group_ids)
    if shared:
        rows = sorted((r for part in _gather_dp(rows) for r in part),
                      key=lambda r: (r["group"], r["index"]))
        if dist_rank() != 0:
            return
    write_rows(rollouts_path(log.save, step, kind), rows)


def _gather_dp(obj) -> list:
    """Every data-parallel rank's picklable `obj`, in rank order."""
    import torch.distributed as dist

    from megatron_rl.parallel import data_parallel_group

    group = data_parallel_group()
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


# -- reading them back: `megatron-rl rollouts` --------------------------------------------------

def read_rows(path: str) -> list[dict]:
    """The rows of a rollouts JSONL file. Raises UserError naming the file and line of a row
    that is not JSON."""
    from megatron_rl.errors import UserError

    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except ValueError as e:
                        raise UserError(f"{path}:{lineno}: not a JSON row ({e})") from e
    except OSError as e:
        raise UserError(f"{path}: cannot be read ({type(e).__name__}: {e})") from e
    return rows


def find_file(path: str, step: int | None, kind: str) -> str:
    """The rollouts file `path` names: a JSONL file itself; or in a run directory (--save) or
    its rollouts/ directory, the file of `step` and `kind` (step None: the last one saved).
    Raises UserError naming what was looked for."""
    from megatron_rl.errors import UserError

    if os.path.isfile(path):
        return path
    if not os.path.isdir(path):
        raise UserError(f"{path}: no such file or directory (a rollouts JSONL file, or a run's "
                        "--save directory)")
    directory = os.path.join(path, ROLLOUTS_DIR)
    if not os.path.isdir(directory):  # the rollouts/ directory itself
        directory = path
    found = {}
    for name in map(os.path.basename, glob.glob(os.path.join(directory, "*.jsonl"))):
        m = _STEP.match(name)
        if m and (m.group(1) is not None) == (kind == "eval"):
            found[int(m.group(2))] = os.path.join(directory, name)
    if not found:
        raise UserError(f"{directory}: no {kind} trajectories (files {_NAME[kind].format(0)}"
                        "...; a run writes them with --save-rollouts N)")
    if step is None:
        return found[max(found)]
    if step not in found:
        raise UserError(f"{directory}: no {kind} trajectories of step {step}; saved steps: "
                        f"{', '.join(map(str, sorted(found)))}")
    return found[step]


def _mean_logprob(seg: dict) -> float:
    lp = seg.get("logprobs") or []
    return sum(lp) / len(lp) if lp else 0.0


def summary_line(i: int, row: dict) -> str:
    """One line of `--list`: the row's number, group/sample, uid, reward, ends and tokens."""
    end = row.get("end") or "-"
    place = f"{row['group']}/{row['index']}"
    return (f"{i:>4}  {place:>8} {row['uid']:<24} "
            f"{row['reward']:>7.3g}  {row['finish_reason']:<7} {end:<12} "
            f"{row['policy_tokens']:>6} {row['environment_tokens']:>6}  "
            f"{len(row['segments']):>4}")


SUMMARY_HEADER = (f"{'#':>4}  {'group':>8} {'uid':<24} {'reward':>7}  {'finish':<7} "
                  f"{'end':<12} {'policy':>6} {'env':>6}  {'segs':>4}")


def format_row(row: dict) -> str:
    """A trajectory for reading: its header (step, record, reward, ends, token counts), the
    prompt, then each segment labelled with its source, token count and, for the policy's, the
    mean of the engine's log-probs."""
    lines = [f"step {row['step']} ({row['kind']})  group {row['group']} sample {row['index']}  "
             f"uid {row['uid']}  task {row['task']}"
             + (f"  source {row['source']} row {row['row']}" if "source" in row else ""),
             f"answer: {row['answer']}",
             f"reward {row['reward']:g}"
             + (f" ({row['reward_error']})" if row.get("reward_error") else "")
             + (f"  turn rewards {row['turn_rewards']}" if "turn_rewards" in row else "")
             + f"  finish {row['finish_reason']}  end {row.get('end') or '-'}"
             f"  policy tokens {row['policy_tokens']}  environment tokens "
             f"{row['environment_tokens']}"]
    if row["policy_tokens"] == 0 and row.get("end") in ("env_error", "env_timeout"):
        lines.append("not trained: its environment failed, so every token has mask 0 (the "
                     "policy's turns show as environment segments)")
    if row.get("counts"):
        lines.append("counts: " + ", ".join(f"{k}={v:g}" if isinstance(v, (int, float)) else
                                            f"{k}={v}" for k, v in row["counts"].items()))
    if row.get("env_info"):
        lines.append("env_info: " + json.dumps(row["env_info"], ensure_ascii=False, default=str))
    lines += ["", f"=== prompt ({len(row['prompt_ids'])} tokens) ===", row["prompt"]]
    for k, seg in enumerate(row["segments"], 1):
        label = f"=== {k}. {seg['source']} ({len(seg['ids'])} tokens"
        if seg["source"] == "policy":
            label += f", mean log-prob {_mean_logprob(seg):.3f}"
        lines += [label + ") ===", seg["text"]]
    return "\n".join(lines)


def main(argv=None) -> None:
    """`megatron-rl rollouts`: print the trajectories --save-rollouts wrote, one readably or a
    line each."""
    from megatron_rl.errors import UserError

    p = argparse.ArgumentParser(prog="megatron-rl rollouts", description=main.__doc__)
    p.add_argument("path", help=(
        "a rollouts JSONL file (<save>/rollouts/step_000010.jsonl), or a run's --save directory "
        "(or its rollouts/ directory), where --step and --eval choose the file"))
    p.add_argument("--step", type=int, help=(
        "with a directory: the step whose file to read (default: unset, the last step saved)"))
    p.add_argument("--eval", action="store_true", help=(
        "with a directory: read the evaluation's trajectories (eval_step_*.jsonl) instead of "
        "the training batch's (default: off)"))
    which = p.add_mutually_exclusive_group()
    which.add_argument("--index", type=int, default=0, help=(
        "print the trajectory on this row of the file, from 0 (default: %(default)s)"))
    which.add_argument("--uid", help=(
        "print the trajectories of the prompt record with this uid (with --sample: one of "
        "them) (default: unset)"))
    which.add_argument("--list", action="store_true", help=(
        "print one line per trajectory: row, group/sample, uid, reward, finish and end reasons, "
        "policy and environment tokens, segments (default: off)"))
    p.add_argument("--sample", type=int, help=(
        "with --uid: the sample of that prompt's group to print (default: unset, all of them)"))
    a = p.parse_args(argv)
    path = find_file(a.path, a.step, "eval" if a.eval else "train")
    rows = read_rows(path)
    if a.list:
        print(f"{path}: {len(rows)} trajectories")
        print(SUMMARY_HEADER)
        for i, row in enumerate(rows):
            print(summary_line(i, row))
        return
    if a.uid is not None:
        chosen = [r for r in rows if r.get("uid") == a.uid
                  and (a.sample is None or r.get("index") == a.sample)]
        if not chosen:
            raise UserError(f"{path}: no trajectory of uid {a.uid!r}"
                            + (f" sample {a.sample}" if a.sample is not None else ""))
    else:
        if not -len(rows) <= a.index < len(rows):
            raise UserError(f"--index {a.index}: {path} holds {len(rows)} trajectories "
                            f"(rows 0-{len(rows) - 1})")
        chosen = [rows[a.index]]
    sys.stdout.write("\n\n".join(format_row(r) for r in chosen) + "\n")
