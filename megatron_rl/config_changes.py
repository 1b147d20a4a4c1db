"""A run's configuration across its starts: what a resume may change, and the record of each start.

Every run checkpoint holds the configuration its run was saved with (checkpoint.TRAIN_CONFIG, the
flat form of flags.to_flat_dict). A resume (a checkpoint under --save, or a run checkpoint given
with --load) compares its own configuration with that one before any model is built
(`check_resume`), setting by setting:

- settings that only steer how the run operates, not what its steps compute (RESUME_FREE: where
  it stops, when it saves, where generation runs, timeouts, kernels), may change freely; the
  parallel layout and microbatches leave a PPO minibatch's sequences and its loss normaliser
  as they were (packing.rank_groups, loss.py), so the steps agree up to float rounding;
- settings a resume may change without a flag that keep how the run samples and its loss but
  change which samples it draws or keeps against the uninterrupted run (RESAMPLES, decided per
  resume in _rules_of_this_resume: the tensor/pipeline-parallel sizes, which set the
  data-parallel size whose replicas seed the in-process engine; the microbatches under
  --dynamic-sampling-keep-kl): a warning names each with what differs;
- settings that cannot take effect on a resume (RESUME_FIXED, and _rules_of_this_resume for the
  ones that depend on the checkpoint: the model, --seed, the optimizer's format) are refused
  even with --allow-config-change, each with the reason;
- any other difference is refused with a ConfigError (a ValueError) listing every one as
  `--flag-name: <checkpoint value> -> <new value>`, unless --allow-config-change accepts them:
  they then take effect from the resumed step, the optimizer's hyperparameters and learning-rate
  schedule included (checkpoint.load_checkpoint takes those from the resuming run's OptimConfig).

`<save>/config.json` is the run's current configuration (usable with --config), and each start
appends one record to `<save>/config_history.jsonl` (`record_start`): the time, the step it starts
at, the checkpoint it resumes, and its differences from the previous start's configuration (the
whole configuration at the first start).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import warnings
from typing import Any

from megatron_rl.agent.settings import AgentConfig
from megatron_rl.config import TrainConfig
from megatron_rl.errors import ConfigError
from megatron_rl.flags import flag_fields, flag_name, to_flat_dict

CONFIG = "config.json"
HISTORY = "config_history.jsonl"

# -- what a resume may change: the one place that decides it -------------------------------------

FREE, FIXED, NEEDS_FLAG, RESAMPLES = "free", "fixed", "needs_flag", "resamples"

# Settings that only steer how a run operates: a resume may change them freely.
# {flat name: why its steps compute the same whatever its value}.
_PLACEMENT = "where generation runs: the same weights and per-request seeds"
_CONTEXT = ("; with --filter-overlong-prompts a change of the context limit changes the data "
            "and needs the flag (_rules_of_this_resume)")
_LAYOUT = ("how the same model is split over the ranks: a checkpoint reshards to the new layout "
           "(not the distributed optimizer's: see _rules_of_this_resume) and a PPO minibatch "
           "holds the same groups at any layout (packing.rank_groups); the in-process engine's "
           "samples follow the data-parallel size (RESAMPLES)")
_MICROBATCHES = ("how a batch is cut into microbatches: the loss is normalised over the whole "
                 "minibatch or batch whatever the cut (loss.py), and packing deals a "
                 "minibatch's groups over the ranks, not over the minibatches "
                 "(packing.rank_groups)")
_RECOMPUTE = "memory traded for compute: the same gradients"
_KERNELS = "which kernels compute the same functions"
_EVAL = "evaluation measures the policy (its own sampling seeds) and feeds nothing back"
RESUME_FREE: dict[str, str] = {
    "train_iters": "where the run stops: the steps before it are the same (a schedule derived "
                   "from it, --lr-decay-iters, is compared as itself)",
    "save": "the run directory: a run checkpoint given with --load resumes into another",
    "save_interval": "which steps are saved, not what they compute",
    "exit_signal_handler": "how a signal stops the run",
    "exit_duration_in_mins": "when the run stops early",
    "allow_config_change": "this start's permission, not a setting of the run",
    "distributed_timeout_minutes": "a timeout",
    "rank_wait_timeout_minutes": "a timeout",
    "max_nonfinite_steps": "when to give up on skipped updates; every update is the same",
    "wandb_project": "where the metrics are also logged",
    "wandb_exp_name": "where the metrics are also logged",
    "wandb_save_dir": "where the metrics are also logged",
    "wandb_entity": "where the metrics are also logged",
    "save_rollouts": "which steps' trajectories are written for reading, not what they are",
    "eval_data": _EVAL,
    "eval_interval": _EVAL,
    "eval_samples": _EVAL,
    "eval_max_prompts": _EVAL,
    "rollout_url": _PLACEMENT + _CONTEXT,
    "rollout_num_servers": "where generation runs: each prompt's seed depends on its index in the "
                           "call, not on the server or chunk",
    "rollout_host": _PLACEMENT,
    "rollout_gpus": _PLACEMENT,
    "rollout_process_cores": _PLACEMENT,
    "rollout_process_gpu": _PLACEMENT,
    "rollout_gpu_memory_utilization": "a server's memory (too little is refused at its start)",
    "rollout_max_context_len": ("a server's capacity (too little is refused at its start)"
                                + _CONTEXT),
    "rollout_release_memory": "where a server's memory is while the trainer trains",
    "weight_sync": "how the same weights reach the engine",
    "weight_sync_bucket_mb": "how the same weights reach the engine",
    "tensor_model_parallel_size": _LAYOUT,
    "pipeline_model_parallel_size": _LAYOUT,
    "expert_model_parallel_size": _LAYOUT,
    "sequence_parallel": _LAYOUT,
    "micro_batch_size": _MICROBATCHES,
    "sequence_packing": _MICROBATCHES,
    "max_tokens_per_microbatch": _MICROBATCHES,
    "recompute_granularity": _RECOMPUTE,
    "recompute_method": _RECOMPUTE,
    "recompute_num_layers": _RECOMPUTE,
    "bias_swiglu_fusion": _KERNELS,
    "rope_fusion": _KERNELS,
    "gradient_accumulation_fusion": _KERNELS,
    "attention_backend": _KERNELS,
    "fused_lm_head": _KERNELS,
    "deterministic_mode": "which kernels compute the same functions (bitwise reproducible or not)",
}

# Settings that cannot take effect on a resume: refused even with --allow-config-change.
# {flat name: why}.
RESUME_FIXED: dict[str, str] = {
    "seed": "the saved data position indexes the prompt order this seed shuffled, and the "
            "sampling seeds follow it",
    "bf16": "the optimizer's state is saved in the run's precision (fp32 main parameters beside "
            "bf16 weights only under --bf16) and does not load into the other",
    "use_distributed_optimizer": "the optimizer's state is saved in that optimizer's format "
                                 "(sharded over the data-parallel ranks or not) and does not "
                                 "load into the other",
}

_ACCEPT = "allow_config_change"  # the setting that accepts the differences


def _rules_of_this_resume(old: dict, new: dict, ckpt: str, from_load: bool) -> dict[str, tuple]:
    """The settings whose freedom depends on this resume: {flat name: (kind, why)}.

    --load, --finetune: where a run checkpoint given with --load resumes from (free then); a
    resume from --save's own checkpoint reads --load only as a weights-only reference, compared.
    --hf-checkpoint: the checkpoint's weights are of its architecture; another directory of the
    same architecture may be accepted (it gives the tokenizer, and the reference where that is
    the initial weights). The distributed optimizer's state reloads only in the TP x PP x EP
    layout it was saved in (checkpoint._sharded_state_dict: dp_reshardable). A reference saved
    with the checkpoint (--ref-reset-interval) is the run's reference: --ref-checkpoint would not
    take effect. Under --filter-overlong-prompts the context limit (--rollout-max-context-len,
    where --rollout-url leaves servers to start) decides which rows the run trains on: a change
    of it needs the flag. The tensor/pipeline-parallel sizes (RESAMPLES where _layout_resamples
    says what they redraw) set the data-parallel size at a given number of ranks. An agent
    setting that nothing reads before and after (_unread_agent_settings) is free: a start
    that drops one the configuration now refuses resumes."""
    from megatron_rl.checkpoint import step_reference

    rules: dict[str, tuple] = {}
    redraws = _layout_resamples(old, new)
    if redraws:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
            rules[name] = (RESAMPLES, "it sets the data-parallel size at a given number of ranks "
                                      "(world size / (TP x PP)): " + redraws)
    if _keeps_filtered_groups(old) and _microbatch_unit(old) != _microbatch_unit(new):
        for name in ("micro_batch_size", "sequence_packing"):
            rules[name] = (RESAMPLES, "under pipeline parallelism without --sequence-packing a "
                                      "--dynamic-sampling-keep-kl batch holds a multiple of the "
                                      "groups that fill whole microbatches "
                                      "(rollout_queue._batch_unit), so it may keep other groups "
                                      "without reward spread")
    if old.get("filter_overlong_prompts") and new.get("filter_overlong_prompts"):
        before, after = _context_limit(old, ckpt), _context_limit(new, ckpt)
        if before[0] != after[0]:
            why = (f"under --filter-overlong-prompts the context limit decides which rows the run "
                   f"trains on: {before[1]} -> {after[1]}")
            for name in ("rollout_max_context_len", "rollout_url"):
                if old.get(name) != new.get(name):
                    rules[name] = (NEEDS_FLAG, why)
    for name in _unread_agent_settings(old) & _unread_agent_settings(new):
        rules[name] = (FREE, "nothing reads it: the rollout function does not read the agent "
                             "settings, or the environment and tools do not read this one")
    if from_load:
        for name in ("load", "finetune"):
            rules[name] = (FREE, "where the resumed run checkpoint is read from")
    if old.get("hf_checkpoint") != new.get("hf_checkpoint"):
        same = _same_architecture(ckpt, new["hf_checkpoint"])
        if same is None:
            rules["hf_checkpoint"] = (FIXED, "the checkpoint's weights are of its architecture, "
                                      "which cannot be compared with this one: its "
                                      "hf_config.json or the new config.json is unreadable")
        elif same is not True:
            rules["hf_checkpoint"] = (FIXED, f"the checkpoint's weights are of its architecture: "
                                      f"{same}")
    if old.get("use_distributed_optimizer"):
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "expert_model_parallel_size"):
            rules[name] = (FIXED, "the distributed optimizer's state reloads only in the "
                                  "tensor/pipeline/expert-parallel layout it was saved in")
    if step_reference(ckpt) is not None:
        rules["ref_checkpoint"] = (FIXED, "the checkpoint holds the run's reference (saved with "
                                          "--ref-reset-interval), which the resume takes")
    return rules


def _unread_agent_settings(flat: dict) -> set[str]:
    """The agent settings (AgentConfig's flat names) that nothing reads in the flat
    configuration `flat`: all of them where its --rollout-function does not declare
    agent_settings (rollout/needs.py), else those its --agent-environment and --agent-tools
    leave unread; none where the rollout function does not import."""
    from megatron_rl.rollout.needs import rollout_needs

    names = [f.name for f in dataclasses.fields(AgentConfig)]
    try:
        reads = rollout_needs(flat.get("rollout_function", "single-turn")).agent_settings
        if not reads:
            return set(names)
        return set(AgentConfig(**{n: flat[n] for n in names if n in flat}).unread_fields())
    except (TypeError, ValueError):
        return set()


def _keeps_filtered_groups(flat: dict) -> bool:
    """AlgorithmConfig.keeps_filtered_groups of the flat configuration `flat`."""
    return bool(flat.get("dynamic_sampling") and flat.get("dynamic_sampling_keep_kl")
                and flat.get("kl_placement", "none") != "none")


def _microbatch_unit(flat: dict) -> int:
    """The factor rollout_queue._batch_unit takes from the microbatches of the flat configuration
    `flat`: groups per whole microbatch under pipeline parallelism without packing, else 1."""
    mbs = flat.get("micro_batch_size", 1)
    if flat.get("pipeline_model_parallel_size", 1) > 1 and not flat.get("sequence_packing"):
        return mbs // math.gcd(mbs, flat.get("group_size", 1))
    return 1


def _layout_resamples(old: dict, new: dict) -> str:
    """What another data-parallel size draws differently in the run of the flat configurations
    `old` -> `new` ("" when nothing: the same samples and minibatches, up to float rounding)."""
    from megatron_rl.rollout.factory import ENGINES

    effects = []
    if not ENGINES[new["rollout_engine"]].holds_own_weights:
        effects.append("the in-process engine samples each data-parallel replica's share of the "
                       "prompts with a seed of its own (the step's + its rank), so another "
                       "data-parallel size draws other samples from the same distribution")
    if _keeps_filtered_groups(old):
        effects.append("a --dynamic-sampling-keep-kl batch holds a multiple of data-parallel "
                       "size x --ppo-minibatches groups, so another size may keep other groups "
                       "without reward spread")
    return "; ".join(effects)


def _context_limit(flat: dict, ckpt: str) -> tuple[int, str]:
    """rollout.factory.context_limit for the flat configuration `flat`, with the positions of
    the model the checkpoint `ckpt` holds (its hf_config.json; unreadable: any number)."""
    import sys
    import types

    from megatron_rl.models.config import ModelArgs
    from megatron_rl.rollout.factory import context_limit

    try:
        positions = ModelArgs.from_pretrained(
            os.path.join(ckpt, "hf_config.json")).max_position_embeddings
    except (OSError, ValueError, KeyError):
        positions = sys.maxsize
    r = types.SimpleNamespace(**{k: flat[k] for k in (
        "rollout_engine", "rollout_url", "rollout_max_context_len")})
    tokens, source = context_limit(r, positions)
    return tokens, ("the model's max_position_embeddings" if tokens == sys.maxsize else source)


def _same_architecture(ckpt: str, hf_dir: str) -> bool | str | None:
    """True when the HF directory `hf_dir` describes the architecture of the checkpoint `ckpt`
    (its hf_config.json; the HF weights' storage dtype aside); else what differs, or None when
    either cannot be read."""
    from megatron_rl.models.config import ModelArgs

    try:
        saved = ModelArgs.from_pretrained(os.path.join(ckpt, "hf_config.json"))
        given = ModelArgs.from_pretrained(hf_dir)
    except (OSError, ValueError, KeyError):
        return None
    a, b = (dataclasses.asdict(dataclasses.replace(m, hf_config={}, torch_dtype=""))
            for m in (saved, given))
    diff = [f"{k} {a[k]} -> {b[k]}" for k in a if a[k] != b[k]]
    return ", ".join(diff) if diff else True


def classify(name: str, rules: dict[str, tuple] | None = None) -> tuple[str, str]:
    """(FREE, FIXED, NEEDS_FLAG or RESAMPLES, why) of a change of setting `name` on a resume;
    `rules`: _rules_of_this_resume's, which come first."""
    if rules and name in rules:
        return rules[name]
    if name in RESUME_FREE:
        return FREE, RESUME_FREE[name]
    if name in RESUME_FIXED:
        return FIXED, RESUME_FIXED[name]
    return NEEDS_FLAG, ""


# -- the configuration as saved, and its differences ----------------------------------------------

def flat_config(cfg: TrainConfig) -> dict[str, Any]:
    """`cfg` as saved (config.json, a checkpoint's TRAIN_CONFIG): to_flat_dict's flat names and
    values as JSON gives them back. --allow-config-change is this start's permission only: kept
    off, so that a start given the file with --config asks for its own."""
    flat = json.loads(json.dumps(to_flat_dict(cfg)))
    flat[_ACCEPT] = False
    return flat


def config_differences(old: dict, new: dict) -> dict[str, tuple[Any, Any]]:
    """{flat name: (old value, new value)} for every setting whose value differs, in flag order.
    A setting `old` lacks (declared after it was written) counts as its default then; keys of
    `old` that no setting reads are left out."""
    defaults = flat_config(TrainConfig())
    out = {}
    for name in flag_fields(TrainConfig):
        a, b = old.get(name, defaults.get(name)), new.get(name, defaults.get(name))
        if a != b:
            out[name] = (a, b)
    return out


def _show(value: Any) -> str:
    """A setting's value as its flag would take it."""
    if value is None or value == []:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return " ".join(map(str, value))
    if isinstance(value, dict):
        return json.dumps(value) if value else "unset"
    if value == "":
        return '""'
    return str(value)


def describe(name: str, old: Any, new: Any) -> str:
    """`--flag-name: <old> -> <new>`."""
    return f"{flag_name(name)}: {_show(old)} -> {_show(new)}"


def saved_config(ckpt: str) -> dict | None:
    """The flat configuration the run checkpoint `ckpt` was saved with: its TRAIN_CONFIG, else
    (checkpoints saved before they held one) the config.json of the run directory it lies in;
    None when neither exists."""
    from megatron_rl.checkpoint import TRAIN_CONFIG

    for path in (os.path.join(ckpt, TRAIN_CONFIG),
                 os.path.join(os.path.dirname(os.path.abspath(ckpt)), CONFIG)):
        if os.path.exists(path):
            try:
                with open(path) as f:
                    return json.load(f)
            except (OSError, ValueError) as e:
                raise ValueError(f"{path} (the configuration {ckpt} was saved with) cannot be "
                                 f"read ({type(e).__name__}: {e}); move it aside to resume "
                                 "without comparing the settings") from e
    return None


def check_resume(cfg: TrainConfig, ckpt: str | None) -> dict | None:
    """Compare `cfg` with the configuration the run checkpoint `ckpt` (the one resumed; None: not
    a resume) was saved with. Raises ConfigError listing every difference that is not free
    (`--flag: <checkpoint> -> <new>`), unless --allow-config-change accepts those that can take
    effect (a warning lists them then); the ones that cannot are refused regardless, with why.
    Returns the checkpoint's configuration (its defaults filled in), or None when there is none
    to compare with (not a resume, or a checkpoint without one: a warning says so)."""
    if ckpt is None:
        return None
    old = saved_config(ckpt)
    if old is None:
        warnings.warn(f"{ckpt} holds no record of its run's configuration: resuming without "
                      "comparing the settings with it", stacklevel=2)
        return None
    old, new = {**flat_config(TrainConfig()), **old}, flat_config(cfg)
    from_load = (os.path.dirname(os.path.abspath(ckpt))
                 != os.path.abspath(cfg.checkpoint.save))
    diffs = config_differences(old, new)
    rules = _rules_of_this_resume(old, new, ckpt, from_load)
    fixed, needs, redraws = [], [], []
    for name, (a, b) in diffs.items():
        kind, why = classify(name, rules)
        if kind == FIXED:
            fixed.append(f"  {describe(name, a, b)} ({why})")
        elif kind == NEEDS_FLAG:
            needs.append(f"  {describe(name, a, b)}{_note(name, diffs, new)}"
                         + (f" ({why})" if why else ""))
        elif kind == RESAMPLES:
            redraws.append(f"  {describe(name, a, b)} ({why})")
    source = "--load" if from_load else "--save"
    allowed = cfg.checkpoint.allow_config_change
    if fixed or (needs and not allowed):
        lines = [f"{source}: the run checkpoint {ckpt} was saved with other settings "
                 "(checkpoint -> this start):"]
        if needs:
            lines += needs
        if fixed:
            lines += ["These cannot change on a resume, even with --allow-config-change:", *fixed]
        accept = ("pass --allow-config-change to resume with the new values{} (they take effect "
                  "from the resumed step, the optimizer's learning rate, schedule, weight decay, "
                  "betas and eps included)")
        if fixed:
            hint = "Restore the checkpoint's values of the settings that cannot change" + (
                "; " + accept.format(" of the others") if needs else "")
        else:
            hint = "P" + accept.format("")[1:] + ", or restore the checkpoint's values"
        lines.append(hint + "; or give another --save to start a new run")
        raise ConfigError("\n".join(lines))
    if needs:
        warnings.warn(f"resuming {ckpt} with changed settings (--allow-config-change), in "
                      "effect from the resumed step:\n" + "\n".join(needs), stacklevel=2)
    if redraws:
        warnings.warn(f"resuming {ckpt} with settings that keep how the run samples and its "
                      "loss but change which samples it draws or keeps against the "
                      "uninterrupted run:\n" + "\n".join(redraws), stacklevel=2)
    return old


def _note(name: str, diffs: dict, new: dict) -> str:
    """What a difference in `name` follows from, where the user may not have asked for it."""
    if (name == "lr_decay_iters" and "train_iters" in diffs
            and new.get("lr_decay_style") != "constant"):
        return (" (unset, --lr-decay-iters follows --train-iters x --ppo-minibatches x "
                "--ppo-epochs: give --lr-decay-iters to keep the schedule)")
    return ""


# -- the record of each start ---------------------------------------------------------------------

def record_start(save: str, cfg: TrainConfig, start_step: int, resumed_from: str | None) -> dict:
    """Write `cfg` as the run's current configuration `<save>/config.json` (usable with
    --config), and append this start's record to `<save>/config_history.jsonl`: {"time" (UTC,
    ISO 8601), "start_step", "resumed_from" (the checkpoint, or None), and "changes" ({flat
    name: [previous value, new value]} against the previous start's config.json) or, at the
    first start in `save`, "config" (the whole configuration)}. Returns the record."""
    flat = flat_config(cfg)
    config_path, history_path = os.path.join(save, CONFIG), os.path.join(save, HISTORY)
    previous = None
    if os.path.exists(history_path) and os.path.exists(config_path):
        try:
            with open(config_path) as f:
                previous = json.load(f)
        except (OSError, ValueError):
            previous = None  # unreadable: the record holds the whole configuration instead
    record: dict[str, Any] = {
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "start_step": start_step, "resumed_from": resumed_from}
    if isinstance(previous, dict):
        record["changes"] = {k: list(v) for k, v in config_differences(previous, flat).items()}
    else:
        record["config"] = flat
    with open(history_path, "a+b") as f:
        f.seek(0, os.SEEK_END)
        if f.tell():  # a line torn by a kill stays a line of its own
            f.seek(-1, os.SEEK_END)
            torn = f.read(1) != b"\n"
            f.seek(0, os.SEEK_END)
            if torn:
                f.write(b"\n")
        f.write((json.dumps(record) + "\n").encode())
        f.flush()
        os.fsync(f.fileno())
    tmp = config_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(flat, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, config_path)
    return record
