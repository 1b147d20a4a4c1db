"""Process groups for torchrun launches: tensor, pipeline and data parallelism.

NCCL on GPUs, gloo on CPU. The world is laid out by megatron-core's parallel_state
(TP innermost, then DP, then PP). On CPU the megatron-core compatibility shims are applied first.
Work that one rank does while the others wait for its result (a rollout client's generation,
a server's startup) goes through `run_on_rank`: the others wait outside the collectives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import time
from datetime import timedelta
from typing import Callable, TypeVar

import numpy as np
import torch
import torch.distributed as dist

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """The trainer's model-parallel layout, with megatron's flag names; data parallelism takes
    the remaining ranks (world size / (TP x PP)). A vLLM/SGLang server's own layout is not set
    here; the local engine generates with the trainer's model, in this layout."""

    tensor_model_parallel_size: int = dataclasses.field(default=1, metadata={
        "min": 1, "help": "tensor-parallel ranks per model replica (megatron's TP): attention heads, "
        "MLP and vocabulary are split over them; must divide the attention and key-value head "
        "counts and the vocabulary size"})
    pipeline_model_parallel_size: int = dataclasses.field(default=1, metadata={
        "min": 1, "help": "pipeline stages per model replica (megatron's PP); must divide the "
        "layer count. Without --sequence-packing, --micro-batch-size must divide each rank's "
        "minibatch"})
    sequence_parallel: bool = dataclasses.field(default=False, metadata={
        "help": "megatron's sequence parallelism: the activations outside the tensor-parallel "
        "layers are split over the sequence across the TP ranks; needs "
        "--tensor-model-parallel-size > 1"})
    expert_model_parallel_size: int = dataclasses.field(default=1, metadata={
        "min": 1, "help": "expert-parallel ranks (megatron's EP): each mixture-of-experts "
        "layer's experts are split over N ranks of the data-parallel dimension, which route "
        "tokens to each other's experts; must divide the expert count and the data-parallel "
        "size; needs a mixture-of-experts model"})
    use_distributed_optimizer: bool = dataclasses.field(default=False, metadata={
        "help": "megatron's distributed optimizer: fp32 main parameters and Adam state sharded "
        "over the data-parallel ranks (ZeRO-1); same updates, less memory per rank"})
    distributed_timeout_minutes: float = dataclasses.field(default=30.0, metadata={
        "help": "megatron's flag: how long a collective of the process groups (the default one "
        "and megatron-core's) waits for the other ranks before the job fails (NCCL's watchdog "
        "stops it); fractions allowed. Work one rank does alone (the rollout client's "
        "generation, scoring and evaluation, a server's startup, a weight load) is waited for "
        "outside the collectives (--rank-wait-timeout-minutes), so this bounds only how far "
        "ranks drift apart in work they share (a checkpoint's slowest shard write, pipeline "
        "stages, first-step compilation): 30, megatron-core's own default for its groups, "
        "leaves room for a slow shared file system where Megatron-LM's 10 can be short"})
    rank_wait_timeout_minutes: float = dataclasses.field(default=360.0, metadata={
        "help": "how long the other ranks wait for work one rank does alone (the rollout "
        "client's generation, scoring and evaluation, a server's startup, a weight load into "
        "the engine, a checkpoint's last writes) before they stop with an error naming that "
        "rank; fractions allowed. They wait outside the process groups' collectives, so "
        "--distributed-timeout-minutes does not apply. A failure on that rank reaches them at "
        "once, a dead process ends the job through torchrun: this bounds only a rank that "
        "hangs. 6 hours: tens of minutes of generation and evaluation at 7B, many times over"})

    def validate(self) -> None:
        """Raise ValueError naming the flag for an inconsistent layout."""
        for flag, value in (("--distributed-timeout-minutes", self.distributed_timeout_minutes),
                            ("--rank-wait-timeout-minutes", self.rank_wait_timeout_minutes)):
            if not value > 0:
                raise ValueError(f"{flag} {value}: must be > 0")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError("--sequence-parallel needs --tensor-model-parallel-size > 1 (it "
                             "splits the sequence over the tensor-parallel ranks)")

    def data_parallel_size(self, world_size: int) -> int:
        mp = self.tensor_model_parallel_size * self.pipeline_model_parallel_size
        if world_size % mp:
            raise ValueError(
                f"world size {world_size} is not divisible by tensor x pipeline parallel size "
                f"{self.tensor_model_parallel_size} x {self.pipeline_model_parallel_size}")
        dp = world_size // mp
        ep = self.expert_model_parallel_size
        if ep > 1 and dp % ep:
            # megatron-core lays the expert ranks over TP x EP x expert-DP x PP with the
            # expert-tensor size = TP: EP ranks come out of the data-parallel ranks
            raise ValueError(f"--expert-model-parallel-size {ep} must divide the data-parallel "
                             f"size {dp} (world size {world_size} / (tensor x pipeline parallel "
                             f"size {mp}))")
        return dp


# -- the device decision: made here and nowhere else -------------------------------------------

def use_cuda() -> bool:
    """Whether this process runs on a GPU (CUDA present). Every other module asks this
    function (or `device()`), never torch.cuda directly."""
    return torch.cuda.is_available()


def device() -> torch.device:
    """This rank's device: its local GPU under torchrun (set by init_distributed), else the CPU.

    Tensors that meet the model (batches, logits, losses, metrics before logging) and tensors
    handed to collectives live here; only token ids, rewards and logged floats live on the host.
    """
    if use_cuda():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def to_device(data, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host data (a list, a number, a host tensor) as a tensor on `device`, without making the
    host wait for the device. `torch.tensor(data, device=cuda)` and a blocking `.to(cuda)`
    synchronise the stream after the copy; a non_blocking copy from pageable memory is staged
    by the driver before the call returns, so the source may be freed at once."""
    return torch.as_tensor(data, dtype=dtype).to(device, non_blocking=True)


def process_group_backend() -> str:
    """The default process group's backend: NCCL for device tensors with gloo beside it for
    host tensors on a CUDA build (so a stray host tensor in a collective still works), gloo on
    CPU. megatron-core's groups inherit it."""
    return "cpu:gloo,cuda:nccl" if use_cuda() else "gloo"


def dist_rank() -> int:
    """This process's global rank (0 outside torch.distributed)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def dist_barrier() -> None:
    """A barrier over the default group (nothing outside torch.distributed or alone)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


class RankFailed(RuntimeError):
    """On the ranks that waited in `run_on_rank`: the work failed on the rank doing it (its
    exception is named here and raised there), or no word came from that rank in time."""


# --rank-wait-timeout-minutes (set by init_distributed), and the gloo group the waits happen in:
# (the default group it was made in, the group), made at the first wait of each world
_rank_wait_timeout = timedelta(minutes=ParallelConfig.rank_wait_timeout_minutes)
_wait_group: tuple | None = None


def _rank_wait_group():
    global _wait_group
    world = dist.group.WORLD
    if _wait_group is None or _wait_group[0] is not world:
        _wait_group = (world, dist.new_group(backend="gloo", timeout=_rank_wait_timeout))
    return _wait_group[1]


def model_parallel_source(fn: Callable[[], T]) -> T:
    """`fn()` run on the first rank of this rank's model-parallel group (TP x PP) alone, its
    picklable result on every rank of the group. For work each rank of a group would
    otherwise do on its own with results that may differ (a tool's answer under a time limit)
    where the group's ranks must go on identically (the in-process engine's generate calls are
    collective over the group, with the same prompts on every rank). `fn` must not call
    collectives; it should take seconds, not minutes (the others wait in the broadcast, under
    --distributed-timeout-minutes). Without model parallelism: fn()."""
    if not (dist.is_available() and dist.is_initialized()):
        return fn()
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return fn()
    group = ps.get_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return fn()
    src = dist.get_global_rank(group, 0)
    box: list = [fn() if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def run_on_rank(src: int, fn: Callable[[], T], what: str) -> T:
    """Collective: `fn()` run on global rank `src` alone, its picklable result on every rank.
    `what` names the work in the other ranks' errors ("generating step 3's batch").

    The other ranks wait for `fn` outside the process groups' collectives, so that work of any
    length (a step's generation and scoring through a vLLM/SGLang server, an evaluation, a
    server's startup: minutes to hours at scale) never runs into --distributed-timeout-minutes,
    after which NCCL's watchdog would kill the job. Two steps:

    1. `src` runs `fn`, then broadcasts its outcome (None, or its exception's type and message)
       over a gloo group of the whole world whose timeout is --rank-wait-timeout-minutes; the
       others wait in that broadcast. A failure on `src` thus reaches every rank at once as
       RankFailed naming `src` and its exception (`src` raises its own), instead of leaving the
       others in a collective until it times out; a rank that dies ends the job through
       torchrun (or breaks gloo's connections); one that hangs is given up on after the limit.
    2. Everyone is there now: the result goes out over the default group (NCCL on GPUs:
       a batch of tens of MB is one device broadcast, not a copy per rank over gloo's TCP).

    A dedicated gloo group rather than polling a key in the default store: no polling interval
    added to each wait, no keys to name per call and clean up in a store that outlives the
    processes (torchrun's agent store), no private torch API, and a dead peer is noticed at once
    by its closed connection (gloo: "Connection closed by peer"). It costs one more full mesh
    of host connections, made at the first wait (a collective: every rank reaches its first
    wait at the same point, as it reaches every collective). `fn` must not call collectives
    itself (the other ranks are not there to join them).
    """
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return fn()
    group, rank = _rank_wait_group(), dist.get_rank()
    status: list = [None]
    if rank == src:
        try:
            result = fn()
        except BaseException as e:
            status[0] = f"{type(e).__name__}: {e}"
            with contextlib.suppress(Exception):  # src raises its own exception regardless
                dist.broadcast_object_list(status, src=src, group=group)
            raise
        dist.broadcast_object_list(status, src=src, group=group)
    else:
        t0 = time.monotonic()
        try:
            dist.broadcast_object_list(status, src=src, group=group)
        except RuntimeError as e:  # gloo's timeout, or src's connections gone
            raise RankFailed(
                f"rank {rank}: no word from rank {src} ({what}) after "
                f"{time.monotonic() - t0:.0f} s (--rank-wait-timeout-minutes "
                f"{_rank_wait_timeout.total_seconds() / 60:g}): {e}") from e
        if status[0] is not None:
            raise RankFailed(f"rank {src} failed while {what}: {status[0]}")
        result = None
    box: list = [result]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_reduce(values, group=None, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce `values` (a tensor, or a list of numbers -> float64) over `group` on this
    rank's device; returns the reduced tensor on that device. A no-op outside torch.distributed.
    """
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.float64)
    t = t.to(device())
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def data_parallel_group():
    """megatron-core's data-parallel group (None outside torch.distributed)."""
    if not dist.is_initialized():
        return None
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group()


def data_parallel_sum(x) -> float:
    """Sum of a number (or a scalar tensor) over the data-parallel ranks, in float64."""
    return float(all_reduce(torch.as_tensor(x, dtype=torch.float64).reshape(1),
                            data_parallel_group()))


def set_seed(seed: int) -> None:
    """Seed python, numpy and torch (and megatron's CUDA RNG tracker on GPU)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if use_cuda():
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)


# --deterministic-mode's environment: cuBLAS with a fixed workspace, NCCL's ring algorithm and
# TransformerEngine's deterministic kernels. cuBLAS and NCCL read theirs when they start;
# TransformerEngine reads its variable when it is imported, and megatron-core imports it (where
# installed) when megatron.core is imported: so these are set before the first such import.
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring",
                     "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}


def deterministic_env(deterministic: bool) -> None:
    """With `deterministic` (--deterministic-mode): DETERMINISTIC_ENV into os.environ (the
    environment's own settings win) and torch's deterministic kernels (those without one warn
    and run anyway). Call before anything imports megatron.core (init_distributed does, and
    the entry points that import megatron-core before it call this first)."""
    if deterministic:
        for key, value in DETERMINISTIC_ENV.items():
            os.environ.setdefault(key, value)
        torch.use_deterministic_algorithms(True, warn_only=True)


def init_distributed(cfg: ParallelConfig, seed: int = 1234, deterministic: bool = False) -> int:
    """Initialise torch.distributed from torchrun's env vars and megatron's model-parallel groups.

    Works without torchrun too (a single process, world size 1). Returns the data-parallel size.
    Every group's collectives time out after cfg.distributed_timeout_minutes; `run_on_rank`'s
    waits after cfg.rank_wait_timeout_minutes.
    `deterministic` (--deterministic-mode): `deterministic_env`, before megatron.core is
    imported here, CUDA and NCCL start.
    """
    global _rank_wait_timeout
    deterministic_env(deterministic)
    from megatron.core import parallel_state

    _rank_wait_timeout = timedelta(minutes=cfg.rank_wait_timeout_minutes)
    timeout = timedelta(minutes=cfg.distributed_timeout_minutes)

    if not use_cuda():
        from megatron_rl.compat import apply_cpu_compat

        apply_cpu_compat()
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    dp = cfg.data_parallel_size(world)
    if not dist.is_initialized():
        if use_cuda():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if "WORLD_SIZE" in os.environ:  # launched by torchrun: MASTER_ADDR/PORT from the env
            dist.init_process_group(backend=process_group_backend(), init_method="env://",
                                    rank=rank, world_size=world, timeout=timeout)
        else:  # a plain single process: its own store on a port the kernel picks while binding
            # it (a port probed free and bound later can be taken in between by a process
            # beside this one), and the environment left untouched
            store = dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
                "127.0.0.1", 0, world_size=1, is_master=True, timeout=timeout)
            dist.init_process_group(backend=process_group_backend(), store=store, rank=0,
                                    world_size=1, timeout=timeout)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=cfg.tensor_model_parallel_size,
            pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
            expert_model_parallel_size=cfg.expert_model_parallel_size,
            distributed_timeout_minutes=cfg.distributed_timeout_minutes,
        )
    set_seed(seed)
    return dp


def destroy_distributed() -> None:
    """Tear down megatron's groups and the process group. A barrier comes first: a collective
    on a host tensor leaves its work object to gloo's thread, and if that thread releases it
    (dropping the tensor's Python object) while the interpreter exits, the process aborts
    ("terminate called without an active exception"); after the barrier it has been released."""
    global _wait_group
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    _wait_group = None
    if dist.is_initialized():
        if dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()
