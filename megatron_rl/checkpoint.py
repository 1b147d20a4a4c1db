"""Save and resume: megatron `dist_checkpointing` (reshardable across TP/PP layouts), atomic.

Layout of a checkpoint root:
    <root>/iter_0000010/          one complete checkpoint (model, optimizer, per-rank extra state)
    <root>/latest                 text file naming the newest complete checkpoint
A checkpoint is written into `<root>/.tmp-iter_XXXXXXX`, renamed into place only when every rank
has finished, and only then does `latest` move (written to a temp file and renamed). A run killed
at any moment therefore leaves `latest` pointing at a complete checkpoint.

Extra state (step, RNG states, data position, trainer counters) is a plain picklable dict saved per
global rank; on resume with a different world size rank r reads rank r's file if present, else
rank 0's.
"""

from __future__ import annotations

import os
import random
import shutil
from typing import cast

import numpy as np
import torch

from megatron_rl.parallel import dist_barrier, dist_rank, run_on_rank, use_cuda

LATEST = "latest"


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
                    with_optimizer: bool = True, hf_config: dict | None = None) -> str:
    """Collective: write checkpoint `step` under `root` atomically. Returns its directory.

    `hf_config` (the model's HF config.json dict) is stored beside the weights so that a checkpoint
    can be rebuilt and exported without the original HF directory.
    """
    import json

    from megatron.core import dist_checkpointing

    final = os.path.join(root, iter_dir_name(step))
    tmp = os.path.join(root, ".tmp-" + iter_dir_name(step))

    def prepare() -> None:  # removing a stale directory can take minutes on a shared FS
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)

    def publish() -> None:
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
    dist_checkpointing.save(_sharded_state_dict(policy, with_optimizer), tmp)
    torch.save({"step": step, **(extra or {})}, os.path.join(tmp, f"extra_rank{dist_rank()}.pt"))
    if hf_config is not None and dist_rank() == 0:
        with open(os.path.join(tmp, "hf_config.json"), "w") as f:
            json.dump(hf_config, f, indent=2)
    dist_barrier()
    run_on_rank(0, publish, f"publishing checkpoint {final}")
    return final


def latest_checkpoint(root: str) -> str | None:
    """The newest complete checkpoint directory under `root`, or None."""
    path = os.path.join(root, LATEST)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        name = f.read().strip()
    ckpt = os.path.join(root, name)
    if not os.path.isdir(ckpt):
        raise FileNotFoundError(f"{path} names {name!r}, which does not exist under {root}")
    return ckpt


def load_checkpoint(ckpt_dir: str, policy, with_optimizer: bool = True) -> dict:
    """Collective: load model (and optimizer) into `policy` in its current layout, resharding as
    needed. Returns this rank's extra-state dict (with "step")."""
    from megatron.core import dist_checkpointing

    if not os.path.isdir(ckpt_dir):
        raise FileNotFoundError(f"checkpoint directory {ckpt_dir} does not exist")
    sd = _sharded_state_dict(policy, with_optimizer, is_loading=True)
    # a state dict: load returns a tuple only under a RETURN_* strict mode, not asked for here
    loaded = cast(dict, dist_checkpointing.load(sd, ckpt_dir))
    result = policy.module.load_state_dict(loaded["model"], strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing:
        raise ValueError(f"{ckpt_dir}: checkpoint lacks tensors {missing}")
    if with_optimizer and policy.optimizer is not None and "optimizer" in loaded:
        # no_grad: the distributed optimizer's fp32 main parameters are views of the model's
        # (leaf) parameters, copied into in place (distrib_optimizer.py:940)
        with torch.no_grad():
            policy.optimizer.load_state_dict(loaded["optimizer"])
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
    return torch.load(path, weights_only=False) if os.path.exists(path) else {"step": 0}


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

    The newest checkpoint under --save resumes the run. Else --load: a run's checkpoint
    resumes (optimizer, RNG, data position, step), a weights-only one (tools/convert_checkpoint.py,
    or any with --finetune) gives the initial weights at step 0. A run resumed under --save that
    started from weights-only --load keeps that checkpoint as its reference.
    """
    from megatron_rl.convert import resolve_checkpoint

    given = (resolve_checkpoint(ck.load)
             if ck.load and os.path.abspath(ck.load) != ck.save else None)
    weights_only = given is not None and (ck.finetune or not is_run_checkpoint(given))
    own = latest_checkpoint(ck.save)
    if own is not None:
        return own, given if weights_only else None
    if given is not None and not weights_only:
        return given, None
    return None, given


def load_run_weights(policy, reference, resume: str | None, weights: str | None, hf: str,
                     ref_hf: str | None, reference_resets: bool) -> dict | None:
    """Policy and reference weights of a run, each source read once: the reference copies the
    policy's initial weights instead of reading them again. The reference is `ref_hf`
    (--ref-checkpoint), else the weights-only checkpoint, else `hf` (the run's initial weights);
    after a resume with `reference_resets` (--ref-reset-interval), the reference saved beside
    the run. Returns the resumed checkpoint's extra state (step, RNG, data position), or None."""
    extra = None
    if resume is not None:
        extra = load_checkpoint(resume, policy)
    elif weights is not None:
        load_checkpoint(weights, policy, with_optimizer=False)
    else:
        policy.load_hf(hf)
    if ref_hf:
        reference.load_hf(ref_hf)
    elif resume is None:
        copy_weights(policy, reference)
    elif weights is not None:
        load_checkpoint(weights, reference, with_optimizer=False)
    else:
        reference.load_hf(hf)
    if resume is not None and reference_resets:
        ref_ckpt = latest_checkpoint(os.path.join(os.path.dirname(resume), "reference"))
        if ref_ckpt is not None:
            load_checkpoint(ref_ckpt, reference, with_optimizer=False)
    return extra


def save_run(root: str, step: int, policy, data_state: dict, engine_version: int,
             reference=None) -> None:
    """Collective: checkpoint `step` of a run under `root`: the policy with its optimizer, and
    per rank the RNG states, the data position and the rollout engine's weight version. The
    reference goes to <root>/reference when given (it differs from the initial weights only
    after a reset, --ref-reset-interval)."""
    extra = {"rng": rng_state(), "data": data_state, "engine_version": engine_version}
    save_checkpoint(root, step, policy, extra, hf_config=policy.args.to_hf_config())
    if reference is not None:
        save_checkpoint(os.path.join(root, "reference"), step, reference, with_optimizer=False)
