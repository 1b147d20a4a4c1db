"""Save and resume: megatron `dist_checkpointing` (reshardable across TP/PP layouts), atomic.

Layout of a checkpoint root:
    <root>/iter_0000010/          one complete checkpoint (model, optimizer, per-rank extra state)
    <root>/iter_0000010/reference/  the reference policy of that step, when the run saves it
                                  (--ref-reset-interval)
    <root>/latest                 text file naming the newest complete checkpoint
Every piece of a step (policy and optimizer, extra state, the run's configuration, the reference)
is written into one directory `<root>/.tmp-iter_XXXXXXX`, renamed into place only when every rank
has finished, and only then does `latest` move (written to a temp file and renamed). A run killed
at any moment therefore leaves `latest` pointing at a complete checkpoint, whose pieces all belong
to its step. (Runs saved before the reference moved into the step keep it in
`<root>/reference/iter_XXXXXXX`; that is read for the same step only.)

Extra state (step, RNG states, data position, trainer counters) is a plain picklable dict saved per
global rank; on resume with a different world size rank r reads rank r's file if present, else
rank 0's.

Damage after the save (a truncated or overwritten file, a deleted one): before the rename rank 0
writes `manifest.json` into the checkpoint, each file's size and CRC-32 (zlib: it reads at about
3 GB/s on one core, so a save costs one more read of the checkpoint on rank 0, about 30 s per
100 GB; the 1 MB checkpoint of the unit tests takes 7-11 ms to list, mostly the fsync, and under
1 ms to check). CRC-32 catches accidental corruption (every burst
of up to 32 bits, any other change but for 1 in 2^32), not deliberate tampering. At the start of
a run rank 0 removes the partial `.tmp-iter_*` directories of saves that never finished, and
checks the checkpoint `latest` names against its manifest: a damaged one is renamed aside to
`iter_XXXXXXX.damaged` (kept, not deleted) with a warning naming the file, and the run resumes
from the newest earlier checkpoint that is complete. Checkpoints without a manifest (written
before manifests existed) load unchecked, with their required files checked for presence.
A `latest` that is missing, empty or names anything but an `iter_XXXXXXX` directory of the root
is not trusted: the iterations present are, the newest complete one resumed with a warning.
Every other read (load_checkpoint: an export, an evaluation) checks the manifest as well and
refuses a damaged checkpoint naming the file, having nothing to fall back to.
"""

from __future__ import annotations

import errno
import json
import os
import queue
import random
import re
import shutil
import warnings
import zlib
from typing import cast

import numpy as np
import torch
from torch.distributed.checkpoint.api import CheckpointException

from megatron_rl.errors import UserError
from megatron_rl.parallel import dist_barrier, dist_rank, run_on_rank, use_cuda

LATEST = "latest"
MANIFEST = "manifest.json"
REFERENCE = "reference"  # the subdirectory of a step holding its reference policy
TRAIN_CONFIG = "train_config.json"  # the run's configuration (flags.to_flat_dict) at that step
# the files every dist_checkpointing (torch_dist) checkpoint holds, whatever its layout
_REQUIRED = (".metadata", "metadata.json")
_ITER = re.compile(r"iter_(\d{7})")


def iter_dir_name(step: int) -> str:
    return f"iter_{step:07d}"


def rng_state() -> dict:
    """Python, numpy and torch RNG states of this rank."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if use_cuda():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if use_cuda() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def _allocate_adam_state(opt) -> None:
    """Give a fresh DistributedOptimizer its (lazily created) Adam state before a load.

    Without apex or TransformerEngine (CPU, and GPU machines without them), megatron-core
    0.16.1's DistributedOptimizer.state_dict() (distrib_optimizer.py:640-642) asserts that the
    torch Adam state holds one step count, which a never-stepped optimizer does not. One Adam
    step with zero gradients, lr 0 and weight decay 0 allocates that state and changes no
    parameter; the load then overwrites it."""
    if len(opt.optimizer.state):
        return
    groups = opt.optimizer.param_groups
    saved = [(g["lr"], g["weight_decay"]) for g in groups]
    for g in groups:
        g["lr"], g["weight_decay"] = 0.0, 0.0
    try:
        opt._init_optimizer_states_with_dummy_values()
    finally:
        for g, (lr, wd) in zip(groups, saved):
            g["lr"], g["weight_decay"] = lr, wd


def _restore_adam_steps(opt, state: dict) -> None:
    """Give each parameter of a DistributedOptimizer its own Adam step count, the checkpoint's.

    With torch's Adam (no apex / TransformerEngine), megatron-core 0.16.1 restores the step
    count from the param groups into one tensor shared by every parameter
    (distrib_optimizer.py:817-824; Adam then advances it once per parameter), and the
    dp_reshardable load copies each parameter's pre-load count over it (the per-parameter
    "step" is a LocalNonpersistentObject, :1664-1667, copied at :940)."""
    groups = (state.get("optimizer") or {}).get("param_groups") or []
    steps = {g["step"] for g in groups if g.get("step") is not None}
    if len(steps) != 1:
        return
    step = float(steps.pop())
    for s in opt.optimizer.state.values():
        if isinstance(s.get("step"), torch.Tensor):
            s["step"] = torch.tensor(step, dtype=s["step"].dtype, device=s["step"].device)


def _distributed_optimizers(policy) -> list:
    opt = policy.optimizer
    return [o for o in getattr(opt, "chained_optimizers", [opt])
            if type(o).__name__ == "DistributedOptimizer"]


def _sharded_state_dict(policy, with_optimizer: bool, is_loading: bool = False) -> dict:
    model_sd = policy.module.sharded_state_dict()
    sd = {"model": model_sd}
    if with_optimizer and policy.optimizer is not None:
        # is_loading makes megatron initialise the (lazily created) Adam state first, so that
        # there is something to load into; without it the moments and step count are dropped
        kwargs = {}
        distributed = _distributed_optimizers(policy)
        if distributed:
            # megatron-LM's default format: each DP rank writes its own shard of the flat
            # buffers (no gather). It reloads at any DP size but the same TP x PP layout (the
            # model weights alone, with_optimizer=False, still load at any layout). The
            # "fully_reshardable" format fails to load with torch's Adam in megatron-core
            # 0.16.1 (distrib_optimizer.py:2101 drops the per-parameter "step" that :940 reads).
            kwargs["metadata"] = {"distrib_optim_sharding_type": "dp_reshardable"}
            if is_loading:
                for opt in distributed:
                    _allocate_adam_state(opt)
        sd["optimizer"] = policy.optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                              **kwargs)
        scheduler = getattr(policy, "scheduler", None)
        if scheduler is not None:  # the LR schedule's step count etc. (common state, as megatron)
            sd["opt_param_scheduler"] = scheduler.state_dict()
    return sd


def save_checkpoint(root: str, step: int, policy, extra: dict | None = None,
                    with_optimizer: bool = True, hf_config: dict | None = None,
                    reference=None, config: dict | None = None) -> str:
    """Collective: write checkpoint `step` under `root` atomically. Returns its directory.

    Its pieces: `policy` (with its optimizer when `with_optimizer`), this rank's `extra` state,
    `hf_config` (the model's HF config.json dict, so that a checkpoint can be rebuilt and exported
    without the original HF directory), `config` (the run's flat configuration, TRAIN_CONFIG) and
    the weights of `reference` (in REFERENCE/). All go into one temporary directory, published by
    one rename and the `latest` update: a save that fails or is killed part-way publishes none
    of them.
    """
    from megatron.core import dist_checkpointing

    _write_results_in_process()
    final = os.path.join(root, iter_dir_name(step))
    tmp = os.path.join(root, ".tmp-" + iter_dir_name(step))

    def prepare() -> None:  # removing a stale directory can take minutes on a shared FS
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)

    def publish() -> None:
        try:
            write_manifest(tmp)
        except OSError as e:
            _raise_if_disk_full(e, tmp)
            raise
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        latest_tmp = os.path.join(root, LATEST + ".tmp")
        with open(latest_tmp, "w") as f:
            f.write(iter_dir_name(step) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(latest_tmp, os.path.join(root, LATEST))

    # rank 0's own steps: the others wait for them outside the collectives (run_on_rank)
    run_on_rank(0, prepare, f"preparing checkpoint directory {tmp}")
    try:
        dist_checkpointing.save(_sharded_state_dict(policy, with_optimizer), tmp)
        torch.save({"step": step, **(extra or {})},
                   os.path.join(tmp, f"extra_rank{dist_rank()}.pt"))
        if dist_rank() == 0:
            for name, content in (("hf_config.json", hf_config), (TRAIN_CONFIG, config)):
                if content is not None:
                    with open(os.path.join(tmp, name), "w") as f:
                        json.dump(content, f, indent=2)
        if reference is not None:
            # each dist_checkpointing.save goes into an empty directory, made only now: one
            # holding anything (reference/ made before the policy's save) makes megatron warn
            # "Overwriting old incomplete / corrupted checkpoint" (megatron-core 0.16.1,
            # dist_checkpointing/serialization.py:383-387)
            ref_dir = os.path.join(tmp, REFERENCE)
            run_on_rank(0, lambda: os.makedirs(ref_dir), f"preparing {ref_dir}")
            dist_checkpointing.save(_sharded_state_dict(reference, with_optimizer=False),
                                    ref_dir)
    except (Exception, CheckpointException) as e:  # the latter is a BaseException
        _raise_if_disk_full(e, tmp)
        raise
    dist_barrier()
    run_on_rank(0, publish, f"publishing checkpoint {final}")
    return final


def _write_results_in_process() -> None:
    """Give megatron's checkpoint writer a thread queue for its write results.

    FileSystemWriterAsync hands each save's write results (file names, offsets) from its write
    function to its finalisation through a queue it creates at the first save: a
    multiprocessing Manager's, a spawned server process that imports the saving process's
    __main__ and torch to unpickle them (~3 s of CPU on the first save's path and ~300 MB, per
    rank and process) and is never stopped. The saves here are synchronous
    (dist_checkpointing.save without async_sharded_save): the results are put and taken in this
    process, so a queue.Queue carries them and no helper process exists."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not isinstance(filesystem_async._results_queue, queue.Queue):
        filesystem_async._results_queue = queue.Queue()


def _raise_if_disk_full(error: BaseException, path: str) -> None:
    """Re-raise a failed write under `path` as OSError(ENOSPC) naming the path, when the disk
    is full. torch.save reports a full disk as RuntimeError("... unexpected pos N vs M") and
    dist_checkpointing wraps its writers' errors, so besides an ENOSPC anywhere in the chain of
    causes the free space left is looked at (under 1 MiB: full)."""
    seen, e = set(), error
    full = False
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left" in str(e):
            full = True
        e = e.__cause__ or e.__context__
    try:
        st = os.statvfs(path if os.path.exists(path) else os.path.dirname(path))
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = None
    if not full and (free is None or free >= 1 << 20):
        return
    raise OSError(errno.ENOSPC, f"disk full while saving checkpoint {path} "
                  f"({'unknown' if free is None else free} bytes left); the partial checkpoint is "
                  f"removed at the next start, free space before resuming") from error


def _crc32(path: str) -> tuple[int, str]:
    """(size in bytes, CRC-32 as 8 hex digits) of the file at `path`."""
    size, crc = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            size, crc = size + len(chunk), zlib.crc32(chunk, crc)
    return size, f"{crc:08x}"


def write_manifest(ckpt_dir: str) -> None:
    """`ckpt_dir`/manifest.json: {"hash": "crc32", "files": {relative path: [size, crc32]}} for
    every file under `ckpt_dir`, written through a temporary file and fsynced."""
    files = {}
    for dirpath, _, names in os.walk(ckpt_dir):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), ckpt_dir)
            if rel not in (MANIFEST, MANIFEST + ".tmp"):
                files[rel] = list(_crc32(os.path.join(ckpt_dir, rel)))
    tmp = os.path.join(ckpt_dir, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"hash": "crc32", "files": dict(sorted(files.items()))}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(ckpt_dir, MANIFEST))


def checkpoint_damage(ckpt_dir: str) -> str | None:
    """What is wrong with the checkpoint `ckpt_dir`, naming the file, or None when it is complete:
    every file of its manifest present with its size and CRC-32. Without a manifest only the
    files every checkpoint holds are looked for."""
    if not os.path.isdir(ckpt_dir):
        return f"{ckpt_dir} does not exist"
    path = os.path.join(ckpt_dir, MANIFEST)
    if not os.path.exists(path):
        missing = [n for n in _REQUIRED if not os.path.exists(os.path.join(ckpt_dir, n))]
        return f"{os.path.join(ckpt_dir, missing[0])} is missing" if missing else None
    try:
        with open(path) as f:
            files = json.load(f)["files"]
    except (ValueError, KeyError, TypeError, OSError) as e:
        return f"{path} cannot be read ({type(e).__name__}: {e})"
    for rel, (size, crc) in files.items():
        file = os.path.join(ckpt_dir, rel)
        if not os.path.exists(file):
            return f"{file} is missing"
        actual = os.path.getsize(file)
        if actual != size:
            return f"{file} has {actual} bytes, {size} were written"
        if _crc32(file)[1] != crc:
            return f"{file} does not match the checksum written with it (corrupted since the save)"
    return None


def remove_partial_saves(root: str) -> None:
    """Remove the temporaries (`.tmp-iter_*`, `latest.tmp`) of saves under `root` (and the
    reference/ of the older layout) that never finished: a run killed mid-save, or a full disk. Only at a start, when
    no save of this run is under way."""
    for d in (root, os.path.join(root, REFERENCE)):
        if not os.path.isdir(d):
            continue
        for name in sorted(os.listdir(d)):
            path = os.path.join(d, name)
            if name.startswith(".tmp-iter_") or name == LATEST + ".tmp":
                warnings.warn(f"removing {path}: a checkpoint save that did not finish",
                              stacklevel=2)
                if os.path.isdir(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    os.remove(path)


def _read_latest(root: str) -> tuple[str | None, str | None]:
    """(the checkpoint directory name `<root>/latest` names, what is wrong with the file): one of
    them is None, or both when there is no `latest`. Only an `iter_XXXXXXX` directory of `root`
    itself is a name; anything else (an empty file, `../x`, a path elsewhere) is a problem."""
    path = os.path.join(root, LATEST)
    try:
        with open(path) as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None, None
    except (OSError, UnicodeDecodeError) as e:
        return None, f"cannot be read ({type(e).__name__}: {e})"
    if not text:
        return None, "is empty"
    named = os.path.abspath(os.path.join(root, text))
    if os.path.dirname(named) == os.path.abspath(root) and _ITER.fullmatch(os.path.basename(named)):
        return os.path.basename(named), None
    return None, f"names {text!r}, which is not a checkpoint directory (iter_XXXXXXX) of {root}"


def _steps_present(root: str) -> list[int]:
    """The steps of the `iter_XXXXXXX` directories under `root`, newest first."""
    if not os.path.isdir(root):
        return []
    return sorted((int(m.group(1)) for m in map(_ITER.fullmatch, os.listdir(root)) if m),
                  reverse=True)


def _write_latest(root: str, name: str) -> None:
    tmp = os.path.join(root, LATEST + ".tmp")
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, LATEST))


def complete_checkpoint(root: str) -> str | None:
    """The newest complete checkpoint under `root`, or None when there is none.

    Partial saves are removed first (remove_partial_saves). The checkpoint `latest` names is
    checked (checkpoint_damage); when it is damaged, so are the earlier ones, newest first: the
    first complete one is returned, and each damaged one newer than it is renamed aside to
    `<name>.damaged` with a warning naming the file at fault, and `latest` rewritten. Raises
    ValueError naming every damaged checkpoint when none is complete (nothing renamed then).

    Without a usable `latest` (missing, empty, or naming anything but an iteration directory
    of `root`: a hand edit, a copy, a file system that lost it) the iterations present are
    checked the same way, newest first, and the one found is resumed with a warning naming
    `latest`'s problem, which is rewritten: a run is never restarted from step 0 over its own
    checkpoints, and nothing outside `root` is read or renamed. None only when `root` holds no
    `iter_XXXXXXX` directory (with a warning when `latest` was there but unusable).
    Rank 0's work (checkpoints_to_load gives every rank its answer)."""
    remove_partial_saves(root)
    path = os.path.join(root, LATEST)
    name, problem = _read_latest(root)
    if name is None and problem is None and not _steps_present(root):
        return None  # a new run
    newest = int(name[len("iter_"):]) if name is not None else None
    earlier = [s for s in _steps_present(root) if newest is None or s < newest]
    candidates = ([os.path.join(root, name)] if name is not None else []) + [
        os.path.join(root, iter_dir_name(s)) for s in earlier]
    if not candidates:
        warnings.warn(f"{path} {problem}, and {root} holds no checkpoint (iter_XXXXXXX): the "
                      "run starts at step 0", stacklevel=2)
        return None
    damaged = []
    for ckpt in candidates:
        problem_found = checkpoint_damage(ckpt)
        if problem_found is None:
            break
        damaged.append((ckpt, problem_found))
    else:
        raise UserError(f"no complete checkpoint under {root}: " + "; ".join(
            f"{os.path.basename(c)}: {p}" for c, p in damaged) + ". Move the directory aside "
            "(or pass another --save) to start the run over")
    for bad, why in damaged:
        aside = bad + ".damaged"
        n = 1
        while os.path.exists(aside):
            aside, n = f"{bad}.damaged{n}", n + 1
        kept = ""
        if os.path.isdir(bad):
            os.rename(bad, aside)
            kept = f" Kept as {aside};"
        warnings.warn(f"checkpoint {bad} is damaged: {why}.{kept} resuming from the previous "
                      f"complete checkpoint {ckpt} instead (the steps after it are redone)",
                      stacklevel=2)
    if name is None:
        warnings.warn(f"{path} {problem or 'is missing'}: resuming from the newest complete "
                      f"checkpoint present, {ckpt} (to start the run over instead, move {root} "
                      "aside or pass another --save)", stacklevel=2)
    if damaged or name is None:
        _write_latest(root, os.path.basename(ckpt))
    return ckpt


def resolve_checkpoint(path: str) -> str:
    """A checkpoint root (`latest_checkpoint`: what `latest` names, else the newest iteration
    present) or one iteration directory -> the iteration directory."""
    latest = latest_checkpoint(path)
    return path if latest is None else latest


def latest_checkpoint(root: str) -> str | None:
    """The newest checkpoint directory under `root` (what `latest` names), or None when `root`
    has neither `latest` nor an `iter_XXXXXXX` directory (it may be one checkpoint itself).
    Without a usable `latest` (missing, empty, naming anything but an iteration directory of
    `root`) the newest iteration present is taken, with a warning; nothing outside `root` is."""
    if not os.path.isdir(root):
        return None
    path = os.path.join(root, LATEST)
    name, problem = _read_latest(root)
    if name is not None:
        ckpt = os.path.join(root, name)
        if not os.path.isdir(ckpt):
            raise FileNotFoundError(f"{path} names {name!r}, which does not exist under {root}")
        return ckpt
    steps = _steps_present(root)
    if not steps:
        if problem is None:
            return None
        raise FileNotFoundError(f"{path} {problem}, and {root} holds no checkpoint "
                                "(iter_XXXXXXX)")
    ckpt = os.path.join(root, iter_dir_name(steps[0]))
    warnings.warn(f"{path} {problem or 'is missing'}: taking the newest checkpoint present, "
                  f"{ckpt}", stacklevel=2)
    return ckpt


# What the optimizer's param groups take from the run's configuration (OptimConfig, through
# megatron's OptimizerConfig and the schedule), not from a loaded checkpoint, which restores the
# state only (Adam's moments and step counts, the schedule's step count): a resumed run's --lr,
# --min-lr, --adam-beta1/2, --adam-eps, --weight-decay are its own. "max_lr"/"min_lr" are what
# megatron's OptimizerParamScheduler.get_lr reads before its own values.
_CONFIGURED_GROUP_KEYS = ("lr", "weight_decay", "max_lr", "min_lr", "betas", "eps")


def check_checkpoint(ckpt_dir: str, source: str = "") -> None:
    """Raise ValueError when the checkpoint `ckpt_dir` is damaged (checkpoint_damage), naming
    the file at fault and the newest complete checkpoint before it in the same root, if any.
    `source` (e.g. "--load runs/x: ") opens the message. For readers that load what they are
    given and fall back to nothing: an export or an evaluation of a damaged checkpoint would
    carry its garbage (NaN weights) on silently. Reads the whole checkpoint once: run it on
    one rank."""
    problem = checkpoint_damage(ckpt_dir)
    if problem is None:
        return
    hint = "; move it aside or restore it from a copy"
    m = _ITER.fullmatch(os.path.basename(os.path.normpath(ckpt_dir)))
    if m:
        root = os.path.dirname(os.path.abspath(ckpt_dir))
        for step in _steps_present(root):
            before = os.path.join(root, iter_dir_name(step))
            if step < int(m.group(1)) and checkpoint_damage(before) is None:
                hint = f"; the newest complete checkpoint before it is {before}: load that instead"
                break
    raise UserError(f"{source}checkpoint {ckpt_dir} is damaged, not loaded: {problem}{hint}")


def load_checkpoint(ckpt_dir: str, policy, with_optimizer: bool = True,
                    verify: bool = True) -> dict:
    """Collective: load model (and optimizer) into `policy` in its current layout, resharding as
    needed. Returns this rank's extra-state dict (with "step").

    `verify`: rank 0 first checks the checkpoint against its manifest (check_checkpoint) and a
    damaged one is refused on every rank; False where the caller has just checked it
    (checkpoints_to_load's answers). The optimizer's state comes from the checkpoint, its
    hyperparameters (_CONFIGURED_GROUP_KEYS, the learning-rate schedule's shape) from
    `policy`'s OptimConfig: those of the run resuming.
    """
    from megatron.core import dist_checkpointing

    if not os.path.isdir(ckpt_dir):
        raise FileNotFoundError(f"checkpoint directory {ckpt_dir} does not exist")
    if verify:
        run_on_rank(0, lambda: check_checkpoint(ckpt_dir), f"checking checkpoint {ckpt_dir}")
    sd = _sharded_state_dict(policy, with_optimizer, is_loading=True)
    try:
        # a state dict: load returns a tuple only under a RETURN_* strict mode, not asked here
        loaded = cast(dict, dist_checkpointing.load(sd, ckpt_dir))
    except (Exception, CheckpointException) as e:  # the latter is a BaseException
        raise _unreadable(ckpt_dir, e) from e
    result = policy.module.load_state_dict(loaded["model"], strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing:
        raise ValueError(f"{ckpt_dir}: checkpoint lacks tensors {missing}")
    if with_optimizer and policy.optimizer is not None and "optimizer" in loaded:
        configured = [{k: g[k] for k in _CONFIGURED_GROUP_KEYS if k in g}
                      for g in policy.optimizer.param_groups]
        # no_grad: the distributed optimizer's fp32 main parameters are views of the model's
        # (leaf) parameters, copied into in place (distrib_optimizer.py:940)
        with torch.no_grad():
            policy.optimizer.load_state_dict(loaded["optimizer"])
        groups = policy.optimizer.param_groups
        assert len(groups) == len(configured), (len(groups), len(configured))
        for group, values in zip(groups, configured):
            group.update(values)
        distributed = _distributed_optimizers(policy)
        if len(distributed) == 1:
            _restore_adam_steps(distributed[0], loaded["optimizer"])
        scheduler = getattr(policy, "scheduler", None)
        if scheduler is not None and "opt_param_scheduler" in loaded:
            scheduler.num_steps = 0  # load_state_dict steps forward by the saved count
            scheduler.load_state_dict(loaded["opt_param_scheduler"])
        elif scheduler is not None:  # a checkpoint from before LR schedules: the schedule's
            scheduler.step(increment=0)  # learning rate, not the loaded param groups'
    own = os.path.join(ckpt_dir, f"extra_rank{dist_rank()}.pt")
    path = own if os.path.exists(own) else os.path.join(ckpt_dir, "extra_rank0.pt")
    if not os.path.exists(path):
        return {"step": 0}
    try:
        return torch.load(path, weights_only=False)
    except Exception as e:
        raise _unreadable(path, e) from e


def _unreadable(path: str, error: BaseException) -> RuntimeError:
    """The error for a checkpoint (or one of its files) at `path` that fails to load, with the
    way out. One whose files match its manifest is not damaged: it holds something other than
    what was asked of it (another model, a weights-only checkpoint loaded with its optimizer).
    One without a manifest may be damaged: moved aside, the run resumes from the one before."""
    ckpt = path if os.path.isdir(path) else os.path.dirname(path)
    what = f"checkpoint {path} cannot be read ({type(error).__name__}: {error})."
    if os.path.exists(os.path.join(ckpt, MANIFEST)) and checkpoint_damage(ckpt) is None:
        return RuntimeError(f"{what} Its files match its manifest, so it is not damaged: it does "
                            "not hold what this run loads (another model or layout, or weights "
                            "only where a run's optimizer state is needed)")
    return RuntimeError(f"{what} If it is damaged, move {ckpt} aside: the next start resumes "
                        "from the newest complete checkpoint before it")


def is_run_checkpoint(ckpt_dir: str) -> bool:
    """True for a training run's checkpoint (RNG and data position saved beside the weights),
    False for a weights-only one (tools/convert_checkpoint.py)."""
    path = os.path.join(ckpt_dir, "extra_rank0.pt")
    return os.path.exists(path) and "rng" in torch.load(path, weights_only=False)


# -- a training run's checkpoints: which to load, the policy and reference, saving a step --------

def copy_weights(src, dst) -> None:
    """dst's parameters := src's (two Policies of one model and layout)."""
    with torch.no_grad():
        for p_dst, p_src in zip(dst.module.parameters(), src.module.parameters()):
            p_dst.copy_(p_src)


def checkpoints_to_load(ck) -> tuple[str | None, str | None]:
    """(run checkpoint to resume exactly, weights-only checkpoint to start from); either None,
    for a CheckpointConfig `ck`.

    The newest checkpoint under --save resumes the run. A weights-only one there (a conversion
    written into --save, `megatron-rl convert hf-to-megatron --save <save>`, with or without
    --load naming it) is no run to resume: the run starts from its weights at step 0 with a
    fresh optimizer, and once the run has saved steps of its own beside it, it stays the
    reference those resume with. Else --load: a run's checkpoint resumes (optimizer, RNG, data
    position, step), a weights-only one (tools/convert_checkpoint.py, or any with --finetune)
    gives the initial weights at step 0. A run resumed under --save that started from
    weights-only --load keeps that checkpoint as its reference.

    Decided on rank 0 (the checkpoints checked there: complete_checkpoint), the same answer on
    every rank. A damaged --load checkpoint, or a damaged weights-only one in --save that a
    resumed run takes its reference from, is refused naming the file.
    """
    def decide() -> tuple[str | None, str | None]:
        save = os.path.abspath(ck.save)
        into_save = bool(ck.load) and os.path.abspath(ck.load) == save
        given = resolve_checkpoint(ck.load) if ck.load and not into_save else None
        if given is not None and (problem := checkpoint_damage(given)) is not None:
            raise UserError(f"--load {ck.load}: the checkpoint is damaged: {problem}")
        weights_only = given is not None and (ck.finetune or not is_run_checkpoint(given))
        own = complete_checkpoint(save) if os.path.isdir(save) else None
        if own is not None and not is_run_checkpoint(own):  # no step of the run saved yet
            if given is not None:
                warnings.warn(f"--load {ck.load} is not read: --save {save} holds the "
                              f"weights-only checkpoint {own}, which the run starts from",
                              stacklevel=2)
            return None, own
        if own is not None:
            if into_save and ck.finetune:
                warnings.warn(f"--finetune: --load is --save {save}, whose run checkpoint {own} "
                              "is resumed (optimizer, step, data position); to start over from "
                              "weights only, pass --load that checkpoint and another --save",
                              stacklevel=2)
            return own, given if weights_only else _weights_only_start(save)
        if given is not None and not weights_only:
            return given, None
        return None, given

    return run_on_rank(0, decide, "checking the checkpoints of --save and --load")


def _weights_only_start(root: str) -> str | None:
    """The weights-only checkpoint a run under `root` started from when a conversion wrote it
    there (`root`/iter_0000000 without a run's RNG and data position), or None. Refused
    (ValueError naming the file) when damaged: the resumed run takes its reference from it."""
    ckpt = os.path.join(root, iter_dir_name(0))
    if not os.path.isdir(ckpt):
        return None
    if (problem := checkpoint_damage(ckpt)) is not None:
        raise ValueError(f"{ckpt}, the weights-only checkpoint this run started from and takes "
                         f"its reference from, is damaged: {problem}. Restore it: convert the "
                         f"model again into a new directory and copy its {iter_dir_name(0)} "
                         "here")
    return None if is_run_checkpoint(ckpt) else ckpt


def step_reference(ckpt_dir: str) -> str | None:
    """The reference policy saved with the run checkpoint `ckpt_dir` (REFERENCE/ inside it; for
    checkpoints of the older layout <root>/reference/<iter> of the same step), or None."""
    inside = os.path.join(ckpt_dir, REFERENCE)
    if os.path.isdir(inside):
        return inside
    beside = os.path.join(os.path.dirname(ckpt_dir), REFERENCE, os.path.basename(ckpt_dir))
    return beside if os.path.isdir(beside) else None


def load_run_weights(policy, reference, resume: str | None, weights: str | None, hf: str,
                     ref_hf: str | None, reference_resets: bool) -> dict | None:
    """Policy and reference weights of a run, each source read once: the reference copies the
    policy's initial weights instead of reading them again. The reference is the one saved with
    the resumed checkpoint where it holds one (step_reference); else `ref_hf`
    (--ref-checkpoint), else the weights-only checkpoint, else `hf` (the run's initial weights).
    `reference_resets`: the resumed checkpoint's run saved its reference with every step
    (--ref-reset-interval), so a resumed step without one is refused (ValueError naming it)
    rather than paired with another step's reference. Returns the resumed checkpoint's extra
    state (step, RNG, data position), or None."""
    saved_ref = step_reference(resume) if resume is not None else None
    if resume is not None and saved_ref is None and reference_resets:
        raise ValueError(
            f"checkpoint {resume} holds no reference policy ({os.path.join(resume, REFERENCE)}"
            f"), which its run saves with every step (--ref-reset-interval). Move {resume} "
            "aside to resume from the checkpoint before it")
    # resume and weights were checked against their manifests (checkpoints_to_load), and so
    # was a reference inside resume; one beside it (the older layout) is checked here
    inside = saved_ref is not None and resume is not None and saved_ref.startswith(resume + os.sep)
    extra = None
    if resume is not None:
        extra = load_checkpoint(resume, policy, verify=False)
    elif weights is not None:
        load_checkpoint(weights, policy, with_optimizer=False, verify=False)
    else:
        policy.load_hf(hf)
    if saved_ref is not None:
        load_checkpoint(saved_ref, reference, with_optimizer=False, verify=not inside)
    elif ref_hf:
        reference.load_hf(ref_hf)
    elif resume is None:
        copy_weights(policy, reference)
    elif weights is not None:
        load_checkpoint(weights, reference, with_optimizer=False, verify=False)
    else:
        reference.load_hf(hf)
    return extra


def save_run(root: str, step: int, policy, data_state: dict, engine_version: int,
             reference=None, config: dict | None = None, ahead: bytes | None = None) -> None:
    """Collective: checkpoint `step` of a run under `root`: the policy with its optimizer, per
    rank the RNG states, the data position, the rollout engine's weight version and the
    batches generated ahead (`ahead`, extra["ahead"]: rollout_queue.RolloutQueue.
    saved_state), the run's flat configuration `config` (what a resume compares its own with),
    and the reference when given (it differs from the initial weights after a reset,
    --ref-reset-interval), all published together (save_checkpoint)."""
    extra = {"rng": rng_state(), "data": data_state, "engine_version": engine_version}
    if ahead is not None:
        extra["ahead"] = ahead
    save_checkpoint(root, step, policy, extra, hf_config=policy.args.to_hf_config(),
                    reference=reference, config=config)
