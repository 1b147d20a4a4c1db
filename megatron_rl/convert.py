"""Checkpoint conversion between Hugging Face (safetensors + config.json) and Megatron
(`dist_checkpointing`, reshardable) formats, in any TP/PP layout on either side.

Megatron checkpoints are written with megatron_rl.checkpoint (atomic, `latest` pointer) and carry
the HF config as `hf_config.json`, so they can be exported back without the original directory.
Both directions run in the current process group: a single process for TP=PP=1, or under torchrun
with world size TP*PP. The name/layout mapping is megatron_rl.models.hf_mapping (the same code that
syncs weights to rollout servers).

A conversion never destroys: the output is built in a temporary sibling of --save and renamed into
place, with a marker file (MARKER) listing what it wrote. A --save that is the source (or holds
it) is refused; so is a non-empty --save, a training run's directory included, unless it holds
only an earlier conversion's output and --overwrite is given.

While it runs, rank 0 holds the lock file `.tmp-<save>.convert.lock` beside --save
(writer_lock): a second conversion into the same --save is refused, and one that finds the lock
free removes what killed conversions left beside their --save (the staging directories and
their temporaries, `_leftovers`): into this --save, and into any sibling whose lock file is there
and free. Nothing else is touched.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import sys

from megatron_rl.errors import UserError, run_command

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "generation_config.json",
                   "chat_template.jinja")


# written last into every conversion's output: {"direction", "load", "entries": what it wrote}
MARKER = ".megatron-rl-convert.json"


def _read_marker(save: str) -> dict | None:
    try:
        with open(os.path.join(save, MARKER)) as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and isinstance(marker.get("entries"), list) else None


def check_destination(load: str, save: str, overwrite: bool = False) -> None:
    """Raise ValueError naming --save unless writing the conversion of `load` to `save` removes
    nothing but an earlier conversion's own output: `save` absent or empty, or (with
    `overwrite`) holding only the entries a conversion's marker lists. `save` is never `load` or
    a directory holding it (compared by real path: symlinks and relative paths resolved)."""
    src, dst = os.path.realpath(load), os.path.realpath(save)
    if src == dst or src.startswith(dst + os.sep):
        raise ValueError(f"--save {save}: {'is' if src == dst else 'holds'} the source --load "
                         f"{load}, which the conversion would replace; give --save a new "
                         "directory")
    if not os.path.lexists(save):
        return
    if not os.path.isdir(save):
        raise ValueError(f"--save {save}: exists and is not a directory")
    entries = sorted(os.listdir(save))
    if not entries:
        return
    marker = _read_marker(save)
    shown = ", ".join(entries[:6]) + (", ..." if len(entries) > 6 else "")
    if marker is None:
        run = ("latest" in entries or "metrics.jsonl" in entries
               or any(e.startswith("iter_") for e in entries))
        what = ("a training run's directory" if run
                else "not empty and not written by megatron-rl convert")
        raise ValueError(f"--save {save}: {what} ({shown}); a conversion writes a new directory "
                         "and never replaces one it did not write (not even with --overwrite): "
                         "give --save a new or empty directory")
    if not overwrite:
        raise ValueError(f"--save {save}: holds an earlier conversion ({marker.get('direction')} "
                         f"of {marker.get('load')}); pass --overwrite to replace it, or give "
                         "--save a new directory")
    foreign = sorted(set(entries) - set(marker["entries"]))
    if foreign:
        raise ValueError(f"--save {save}: --overwrite replaces only what megatron-rl convert "
                         f"wrote there, but it also holds {foreign}: move them away first")


def _staging_dir(save: str) -> str:
    """The temporary sibling of `save` a conversion is built in (one fixed name, so that every
    rank agrees on it and a killed conversion's leftover is removed by the next), beside the
    real path: a --save symlink stays one, and the rename stays on one file system."""
    save = os.path.realpath(save)
    return os.path.join(os.path.dirname(save), ".tmp-" + os.path.basename(save) + ".convert")


def _leftovers(parent: str, base: str) -> list[str]:
    """What a conversion into `parent`/`base` creates beside it, if present: its staging
    directory (_staging_dir), the temporary that hf_mapping.save_hf_checkpoint builds the
    staging directory's files in (`.tmp-<staging>-` and tempfile's 8 characters) and the `.old`
    it renames an existing one to, and _publish's `.old-<base>.convert`."""
    staging = ".tmp-" + base + ".convert"
    exact = {staging, staging + ".old", ".old-" + base + ".convert"}
    tmp = re.compile(re.escape(".tmp-" + staging + "-") + "[a-z0-9_]{8}")
    return [os.path.join(parent, n) for n in os.listdir(parent) if n in exact or tmp.fullmatch(n)]


_LOCK = re.compile(r"\.tmp-(.+)\.convert\.lock")


def _take_destination(save: str):
    """Rank 0, before anything is written: the lock of conversions into `save` (a WriterLock,
    taken), with what killed conversions left removed (module docstring). Raises ValueError
    naming `save` and the lock file while a live conversion into `save` holds it. Where the
    file system refuses locks nothing is removed (the staging directory excepted, replaced as
    ever) and the lock is not held."""
    from megatron_rl.writer_lock import WriterLock, remove_stale

    parent, base = os.path.split(os.path.realpath(save))
    os.makedirs(parent, exist_ok=True)
    lock = WriterLock(os.path.join(parent, f".tmp-{base}.convert.lock"))
    state = lock.take()
    if state == "held":
        raise ValueError(f"--save {save}: another conversion into it is running (it holds "
                         f"{lock.path}); wait for it to end, or give --save another directory")
    if state != "taken":
        return lock
    remove_stale(_leftovers(parent, base), f"a conversion into {save}")
    for name in sorted(os.listdir(parent)):
        m = _LOCK.fullmatch(name)
        if m is None or m.group(1) == base:
            continue
        other = WriterLock(os.path.join(parent, name))
        if other.take() == "taken":
            with other:
                remove_stale(_leftovers(parent, m.group(1)),
                             f"a conversion into {os.path.join(parent, m.group(1))}")
    return lock


def _publish(staging: str, save: str, direction: str, load: str) -> None:
    """Rank 0: write the marker into `staging` and rename it to `save`, replacing an earlier
    conversion there (check_destination allowed it) only once the new one is complete."""
    entries = sorted(os.listdir(staging)) + [MARKER]
    with open(os.path.join(staging, MARKER), "w") as f:
        json.dump({"direction": direction, "load": os.path.abspath(load), "entries": entries},
                  f, indent=2)
    save = os.path.realpath(save)
    old = os.path.join(os.path.dirname(save), ".old-" + os.path.basename(save) + ".convert")
    shutil.rmtree(old, ignore_errors=True)
    if os.path.lexists(save):
        os.rename(save, old)
    os.rename(staging, save)
    shutil.rmtree(old, ignore_errors=True)


def _init(tp: int, pp: int):
    from megatron_rl.parallel import ParallelConfig, init_distributed

    init_distributed(ParallelConfig(tp, pp))


def hf_to_megatron(hf_dir: str, save_root: str, tp: int = 1, pp: int = 1,
                   overwrite: bool = False) -> str:
    """Convert a HF checkpoint directory into a new Megatron checkpoint root (check_destination:
    `overwrite` replaces only an earlier conversion). Collective. Returns the iteration
    directory."""
    check_destination(hf_dir, save_root, overwrite)  # before any heavy import
    from megatron_rl.checkpoint import iter_dir_name, save_checkpoint
    from megatron_rl.models import ModelArgs
    from megatron_rl.models.policy import Policy
    from megatron_rl.parallel import dist_rank, run_on_rank

    _init(tp, pp)
    locks = []  # rank 0's
    run_on_rank(0, lambda: locks.append(_take_destination(save_root)),
                f"taking the lock of conversions into {save_root}")
    try:
        args = ModelArgs.from_pretrained(hf_dir)
        policy = Policy(args, trainable=False)
        policy.load_hf(hf_dir)
        staging = _staging_dir(save_root)
        if dist_rank() == 0:  # the others first touch it inside save_checkpoint, after rank 0
            shutil.rmtree(staging, ignore_errors=True)
        out = save_checkpoint(staging, 0, policy, with_optimizer=False,
                              hf_config=args.to_hf_config())
        _copy_tokenizer(hf_dir, out)
        run_on_rank(0, lambda: _publish(staging, save_root, "hf-to-megatron", hf_dir),
                    f"publishing the Megatron checkpoint {save_root}")
    finally:
        for lock in locks:
            lock.release()
    return os.path.join(save_root, iter_dir_name(0))


def load_megatron_args(ckpt_dir: str):
    from megatron_rl.models import ModelArgs

    path = os.path.join(ckpt_dir, "hf_config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{ckpt_dir}: no hf_config.json; was it written by megatron-rl?")
    return ModelArgs.from_pretrained(path)


def megatron_to_hf(load: str, hf_dir: str, tp: int = 1, pp: int = 1, dtype: str | None = None,
                   overwrite: bool = False) -> None:
    """Export a Megatron checkpoint (root or iteration dir) to a new HF directory
    (check_destination: `overwrite` replaces only an earlier conversion). Collective."""
    check_destination(load, hf_dir, overwrite)  # before any heavy import
    from megatron_rl.parallel import run_on_rank

    _init(tp, pp)
    locks = []  # rank 0's
    run_on_rank(0, lambda: locks.append(_take_destination(hf_dir)),
                f"taking the lock of conversions into {hf_dir}")
    try:
        _export(load, hf_dir, dtype)
    finally:
        for lock in locks:
            lock.release()


def _export(load: str, hf_dir: str, dtype: str | None) -> None:
    """megatron_to_hf's work, under the lock of conversions into `hf_dir`."""
    import torch

    from megatron_rl.checkpoint import check_checkpoint, load_checkpoint, resolve_checkpoint
    from megatron_rl.models import hf_mapping
    from megatron_rl.models.policy import Policy
    from megatron_rl.parallel import run_on_rank

    ckpt = resolve_checkpoint(load)
    # a damaged checkpoint (its manifest's sizes and CRC-32s) is refused before the model is
    # built: loaded, it would export garbage (NaN weights) without an error
    run_on_rank(0, lambda: check_checkpoint(ckpt, f"--load {load}: "),
                f"checking the checkpoint {ckpt}")
    args = load_megatron_args(ckpt)
    policy = Policy(args, trainable=False)
    load_checkpoint(ckpt, policy, with_optimizer=False, verify=False)
    full = policy.full_state_dict(dst=0)

    def write() -> None:
        hf = hf_mapping.megatron_to_hf(full, args, source=ckpt)
        extra = [f for f in (os.path.join(ckpt, n) for n in TOKENIZER_FILES) if os.path.exists(f)]
        staging = _staging_dir(hf_dir)
        shutil.rmtree(staging, ignore_errors=True)
        hf_mapping.save_hf_checkpoint(hf, args, staging, extra_files=tuple(extra),
                                      dtype=getattr(torch, dtype) if dtype else None)
        _publish(staging, hf_dir, "megatron-to-hf", load)

    run_on_rank(0, write, f"writing the HF checkpoint {hf_dir}")  # the others wait outside


def _copy_tokenizer(src: str, dst: str) -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return
    for name in TOKENIZER_FILES:
        for f in glob.glob(os.path.join(src, name)):
            shutil.copy(f, dst)


def main(argv=None) -> None:
    """Convert. UserError (the process: status 2, the message alone) when --load is missing,
    --save is refused (check_destination) or the world size is not TP x PP."""
    p = argparse.ArgumentParser(
        prog="megatron-rl convert",
        description="Convert checkpoints between HF and Megatron formats. Run under torchrun "
                    "with world size TP*PP for a sharded layout.")
    p.add_argument("direction", choices=["hf-to-megatron", "megatron-to-hf"], help=(
        "hf-to-megatron: a Hugging Face directory (--load) into a Megatron checkpoint root "
        "(--save); megatron-to-hf: a Megatron checkpoint written by megatron-rl (--load) into a "
        "Hugging Face directory (--save)"))
    p.add_argument("--load", required=True, help=(
        "source: hf-to-megatron: the Hugging Face directory (config.json, safetensors, "
        "tokenizer files); megatron-to-hf: a Megatron checkpoint root (its `latest` iteration) "
        "or one iteration directory, with the hf_config.json megatron-rl stores. Required"))
    p.add_argument("--save", required=True, help=(
        "destination, a new or empty directory (never --load, nor a directory holding it): "
        "hf-to-megatron: the checkpoint root, which gets iteration directory iter_0000000 "
        "(weights, hf_config.json, tokenizer files) and the `latest` pointer; megatron-to-hf: "
        "the Hugging Face directory (config.json, safetensors, the checkpoint's tokenizer "
        f"files). Built beside it and renamed into place, with {MARKER} listing what it wrote. "
        "Required"))
    p.add_argument("--overwrite", action="store_true", help=(
        "replace an earlier conversion's output at --save (what its marker lists and nothing "
        "else: a directory holding anything more, or a training run's, is still refused)"))
    p.add_argument("--tensor-model-parallel-size", type=int, default=1, help=(
        "tensor-parallel size the model is held in while converting; the Megatron checkpoint "
        "is reshardable, so it loads in any layout later. Launch with torchrun and exactly "
        "TP x PP processes (default: %(default)s)"))
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1, help=(
        "pipeline-parallel size (stages) the model is held in while converting; the Megatron "
        "checkpoint is reshardable, so it loads in any layout later. Launch with torchrun and "
        "exactly TP x PP processes (default: %(default)s)"))
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None, help=(
        "megatron-to-hf only: dtype of the exported safetensors tensors, also written to "
        "config.json as torch_dtype (default: unset, float32: the precision the converter "
        "holds the weights in)"))
    a = p.parse_args(argv)
    tp, pp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world != tp * pp:
        raise UserError(f"world size {world} != TP*PP = {tp * pp}: launch with "
                        f"`torchrun --nproc-per-node {tp * pp} ...`")
    try:  # the conversions check it again; here its refusal is the user's to fix
        check_destination(a.load, a.save, a.overwrite)
    except ValueError as e:
        raise UserError(str(e)) from None
    if not os.path.exists(a.load):
        raise UserError(f"--load {a.load}: no such file or directory")
    if a.direction == "hf-to-megatron":
        out = hf_to_megatron(a.load, a.save, tp, pp, a.overwrite)
        msg = f"wrote Megatron checkpoint {out}"
    else:
        megatron_to_hf(a.load, a.save, tp, pp, a.dtype, a.overwrite)
        msg = f"wrote HF checkpoint {a.save}"
    import torch.distributed as dist

    from megatron_rl.parallel import destroy_distributed
    from megatron_rl.processes import skip_exit_collection

    if dist.get_rank() == 0:
        print(msg)
    destroy_distributed()
    skip_exit_collection()


if __name__ == "__main__":
    sys.exit(run_command("megatron-rl convert", main, sys.argv[1:]))
