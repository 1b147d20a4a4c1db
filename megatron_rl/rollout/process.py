"""`--rollout-engine process`: the embedded decoder in a process of its own, with its own copy of
the weights, so that generation overlaps training (`--async-level 1`) without a server.

Global rank 0 spawns one child process. The child builds the policy at TP1 / PP1 from the HF
checkpoint and generates with `LocalEngine` (the same KV-cached decoder and sampling as the
embedded default) on its own CPU cores (`--rollout-process-cores`) or on a GPU: the one it is
given (`--rollout-process-gpu`), else rank 0's own. Rank 0 is its one client, as for a vLLM or
SGLang server (the batch is generated once, then scattered to the data-parallel ranks, and
under --async-level >= 1 in a background thread while the trainer trains).

Requests go over a pipe and are served one at a time, so weights change only between requests:

    ("generate", prompts, n, SamplingParams)  -> ("ok", (completions, weight version, seconds))
    ("bucket", path, meta)                    -> ("ok", None)      --weight-sync tensor
    ("commit", version)                       -> ("ok", version)   load what the buckets held
    ("load_dir", path, version)               -> ("ok", version)   --weight-sync disk
    ("stop",)

Weight sync (`update_weights`, collective over the training ranks, through
weight_sync.WeightSync): the policy is gathered to rank 0 under HF names. `tensor` (the default)
copies it into a shared-memory buffer (shm_weights.SharedBuckets) and names it to the child
bucket by bucket (--weight-sync-bucket-mb); the child stages views of each bucket and loads the
whole state when the last one has arrived. `disk` writes a versioned HF directory that the child
reloads.

Partial rollouts (`partial_rollouts`, --partial-rollouts; rollout/interrupt.py): a weight update
does not wait for the generation in flight. `update_weights` sets an abort flag (a
multiprocessing Event) as it hands the weights over; the child reads it after every decoding
step and answers the generate request at once, each response that had not ended with its tokens
and log-probs so far (finish reason "abort"), and then serves the update. `generate` waits for
the new weights and continues the unfinished responses (interrupt.continue_interrupted: those
cut after the same number of tokens in one request), each token labelled with the version the
child reported with its answer; a continuation may be cut again by the next update.

Samples are a function of (seed, prompts, weights) alone: the child samples the whole batch
with the request's seed, so the batch does not depend on the trainer's layout (TP, PP, DP).
Under --partial-rollouts where a weight update cuts a response depends on timing, so the
samples do too (--deterministic-mode refuses the flag).
A child that dies is reported with its exit code; it is not restarted (resume the run from its
last checkpoint).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
import time
import traceback
from typing import ClassVar, Iterator, Sequence

import torch

from megatron_rl.parallel import deterministic_env, dist_rank, run_on_rank
from megatron_rl.processes import set_parent_death_signal, skip_exit_collection
from megatron_rl.rollout.base import (Completion, EngineConfig, SamplingParams, ServerError,
                                      resume_seed)
from megatron_rl.rollout.child_env import inference_env
from megatron_rl.rollout.interrupt import UpdateGate, continue_interrupted, label
from megatron_rl.rollout.shm_weights import read_bucket
from megatron_rl.rollout.weight_sync import WeightSync, read_version, sync_engine


@dataclasses.dataclass(kw_only=True)
class ProcessConfig(EngineConfig):
    """The child process (EngineConfig's fields, and):

    hf_checkpoint: the model config, and the weights the child starts from.
    pad_token_id: the id padded batches use.
    cores: CPU cores the child is pinned to (its torch threads: their count); () leaves them.
    gpu: the CUDA device index the child generates on (None: the trainer's current device);
        ignored without CUDA.
    deterministic: --deterministic-mode in the child too.
    """

    SYNCS: ClassVar[tuple[str, ...]] = ("tensor", "disk")

    hf_checkpoint: str
    dtype: str = "float32"
    sync: str = "tensor"                # tensor (shared memory) | disk
    pad_token_id: int = 0
    cores: tuple[int, ...] = ()
    gpu: int | None = None
    deterministic: bool = False


class ProcessEngine:
    """RolloutEngine over a child process (see module docstring). `policy`: the trainer's
    Policy, whose weights `update_weights` sends. Global rank 0 is its one client."""

    client_rank = 0
    holds_own_weights = True
    concurrent_generate = False  # the child serves one request at a time

    def __init__(self, config: ProcessConfig, policy=None):
        self.config = config
        self.policy = policy
        self.weight_version = read_version(config.hf_checkpoint) or 0
        self.rank = dist_rank()
        self.num_generate_calls = 0
        self._lock = threading.Lock()
        self._conn = self._proc = None
        self._abort = None  # --partial-rollouts: the child's abort flag (rank 0)
        # --partial-rollouts: closed while a weight update is under way (rollout/interrupt.py)
        self.gate = UpdateGate(lambda: self.weight_version) if config.partial_rollouts else None
        self._count_lock = threading.Lock()  # the counters below: generate runs on several threads
        self.num_interrupted = 0  # interruptions of a response by a weight update, over the run
        self.generate_seconds = 0.0  # the child's time generating, over the run
        self.sync = WeightSync(config.sync, config.work_dir, dtype=config.dtype,
                               bucket_bytes=config.bucket_bytes, shared_memory=True)
        self.last_sync_seconds = self.sync.last_seconds
        # rank 0 starts the child; every rank learns whether it came up (no rank may go on to
        # the next collective while rank 0 raises), waiting for it outside the collectives
        error = run_on_rank(0, self._start_or_error, "starting the rollout process")
        if error is not None:
            raise ServerError(f"the rollout process did not start: {error}")

    def _start_or_error(self) -> str | None:
        """Rank 0: start the child; None, or why it did not start (then it is shut down)."""
        try:
            self._start()
        except Exception as e:  # noqa: BLE001 - raised on every rank by __init__
            self.shutdown()
            return f"{type(e).__name__}: {e}"
        return None

    # -- the child -------------------------------------------------------------------------------
    def _start(self) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")  # a fresh interpreter: no inherited process groups
        self._conn, child = ctx.Pipe()
        self._abort = ctx.Event() if self.config.partial_rollouts else None
        config = self.config
        if config.gpu is None and torch.cuda.is_available():  # beside this rank, on its GPU
            config = dataclasses.replace(config, gpu=torch.cuda.current_device())
        self._proc = ctx.Process(target=_serve, args=(child, config, self._abort), daemon=True,
                                 name="megatron-rl-rollout")
        self._proc.start()
        child.close()
        pid = self._call(None, self.config.startup_timeout, "start")
        self.pid = pid

    def _call(self, msg, timeout: float, what: str, after_update: bool = False):
        """Send `msg` (None: only wait) and return the child's answer; a child that died or
        failed raises ServerError naming the request. `after_update` (a generate request under
        --partial-rollouts): a weight update begun while it waited for the pipe is loaded
        first, so that no generation starts only to be interrupted."""
        while after_update and self.gate is not None:
            self.gate.enter()
            self._lock.acquire()
            if not self.gate.updating_now:
                break
            self._lock.release()  # an update began meanwhile: its weights first
        else:
            self._lock.acquire()
        try:
            return self._call_locked(msg, timeout, what)
        finally:
            self._lock.release()

    def _call_locked(self, msg, timeout: float, what: str):
        """_call's exchange, the pipe's lock held."""
        if self._proc is None or (msg is not None and not self._proc.is_alive()):
            raise ServerError(f"rollout process is not running ({self._describe()}); "
                              f"request {what!r} not sent")
        try:
            if msg is not None:
                self._conn.send(msg)
            deadline = time.monotonic() + timeout
            while not self._conn.poll(0.5):
                if not self._proc.is_alive():
                    raise EOFError
                if time.monotonic() > deadline:
                    # its late answer would be read as the next request's: stop it
                    self._proc.terminate()
                    self._proc.join(10)
                    raise ServerError(f"rollout process gave no answer to {what!r} within "
                                      f"{timeout:.0f} s; stopped ({self._describe()})")
            status, value = self._conn.recv()
        except (EOFError, OSError):  # the pipe closed: the child is gone
            self._proc.join(5)
            raise ServerError(f"rollout process died during {what!r} "
                              f"({self._describe()})") from None
        if status != "ok":
            error, tb = value
            raise ServerError(f"rollout process ({self._describe()}) failed on {what!r}: {error}"
                              f"\n--- the rollout process's traceback ---\n{tb}")
        return value

    def _describe(self) -> str:
        p = self._proc
        if p is None:
            return "never started"
        return f"pid {p.pid}, " + ("alive" if p.is_alive() else f"exit code {p.exitcode}")

    # -- the engine contract ---------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], n: int,
                 params: SamplingParams) -> list[list[Completion]]:
        if self.rank != 0:
            raise RuntimeError("the process engine's client is global rank 0")
        if not prompts:
            return []
        prompts = [[int(t) for t in p] for p in prompts]
        out, version, seconds = self._call(("generate", prompts, n, params),
                                           self.config.request_timeout,
                                           f"generate {len(prompts)} prompts x {n}",
                                           after_update=True)
        with self._count_lock:
            self.generate_seconds += seconds
            self.num_generate_calls += 1
        if len(out) != len(prompts) or any(len(g) != n for g in out):
            raise ServerError(f"rollout process returned {[len(g) for g in out]} completions "
                              f"for {len(prompts)} prompts x n={n}")
        if self._abort is not None:
            label(out, version)
            made = continue_interrupted(prompts, [c for g in out for c in g], n,
                                        params.max_new_tokens,
                                        lambda ask, budget, row: self._resume(ask, budget, row,
                                                                              params))
            with self._count_lock:
                self.num_interrupted += made
        return out

    def _resume(self, ask: list[list[int]], budget: int, row: int,
                params: SamplingParams) -> list[list[Completion]]:
        """--partial-rollouts: one sample of each of `ask` (prompts and the tokens a weight update
        cut) under the weights loaded after the cut, seeded resume_seed (rollout/interrupt.py)."""
        assert self.gate is not None
        ticket = self.gate.enter()  # the update that cut them has loaded its weights
        cont = dataclasses.replace(params, max_new_tokens=budget,
                                   seed=resume_seed(params.seed, ticket.version, row))
        got, version, seconds = self._call(("generate", ask, 1, cont),
                                           self.config.request_timeout,
                                           f"continue {len(ask)} interrupted responses",
                                           after_update=True)
        with self._count_lock:
            self.generate_seconds += seconds
        label(got, version)
        return got

    def update_weights(self, version: int) -> None:
        """Collective over all training ranks: gather the policy to rank 0, hand it over. With
        --partial-rollouts the generation in flight is interrupted first (module docstring)."""
        with self.weight_update(version):
            sync_engine(self.sync, self.policy, self, version)

    @contextlib.contextmanager
    def weight_update(self, version: int) -> Iterator[None]:
        """The block loads weights `version` into the child (update_weights; a test may call a
        loader itself), after which the engine serves `version`. With --partial-rollouts a
        generate call in flight goes on while the weights are gathered or exported, is
        interrupted as the loader hands them over (_interrupt), and continues under the new
        weights once the block has ended; a generate request made meanwhile waits for them."""
        if self._abort is None or self.gate is None:
            yield
            self.weight_version = version
            return
        with self.gate.updating():  # generate requests from here on wait for the new weights
            try:
                yield
                self.weight_version = version
            finally:
                self._abort.clear()

    def _interrupt(self) -> None:
        """--partial-rollouts: the child answers the generate request in flight at its next
        step (set as the weights are handed over, not while they are gathered or exported, so
        that generation goes on meanwhile; weight_update clears it)."""
        if self._abort is not None:
            self._abort.set()

    def load_weights_from_path(self, path: str, version: int) -> None:
        """The child reloads the HF directory `path` (--weight-sync disk)."""
        self._interrupt()
        loaded = self._call(("load_dir", path, version), self.config.request_timeout,
                            f"load weights version {version} from {path}")
        self._check_version(loaded, version)
        self.sync.exporter.prune(path)

    def load_weights_from_shared(self, path: str, metas: list[list[dict]], version: int) -> None:
        """The child stages each bucket of the shared buffer `path`, then loads them all."""
        self._interrupt()
        for meta in metas:
            self._call(("bucket", path, meta), self.config.request_timeout,
                       f"weights version {version}, bucket of {len(meta)} tensors")
        loaded = self._call(("commit", version), self.config.request_timeout,
                            f"load weights version {version}")
        self._check_version(loaded, version)

    def _check_version(self, loaded: int, version: int) -> None:
        if loaded != version:
            raise ServerError(f"rollout process reports weight version {loaded} after "
                              f"loading version {version}")

    def stats(self) -> dict[str, float]:
        """Metrics for the trainer's log (rank 0): generate requests so far (one per batch), the
        child's seconds generating so far (its idle time: the wall time less these), the last
        weight sync's size, and with --partial-rollouts the responses interrupted so far (one
        interrupted by two updates counts twice)."""
        out = {"rollout/generate_calls": float(self.num_generate_calls),
               "rollout/generate_seconds": self.generate_seconds,
               "rollout/weight_sync_mb": self.sync.last_bytes / 2 ** 20}
        if self._abort is not None:
            out["rollout/interrupted_responses"] = float(self.num_interrupted)
        return out

    def release_memory(self) -> None:
        pass  # the child keeps its weights (on CPU cores of its own, or beside the trainer)

    def resume_memory(self) -> None:
        pass

    def health(self) -> bool:
        return self.rank != 0 or (self._proc is not None and self._proc.is_alive())

    def shutdown(self) -> None:
        if self._proc is not None:
            if self._proc.is_alive():
                # a request in flight holds the lock: then stop the child without asking
                if self._lock.acquire(timeout=5):
                    try:
                        self._conn.send(("stop",))
                    except OSError:
                        pass
                    finally:
                        self._lock.release()
                    self._proc.join(30)
                if self._proc.is_alive():
                    self._proc.kill()  # the child ignores SIGTERM
                    self._proc.join(10)
            self._proc = None
        self.sync.close()


def _serve(conn, config: ProcessConfig, abort=None) -> None:
    """The child's main: build the TP1 policy, answer requests until ("stop",). `abort`: the
    flag a weight update sets to interrupt a generation (--partial-rollouts)."""
    # it dies with the trainer (SIGKILL included), and leaves Ctrl-C and a scheduler's SIGTERM
    # (sent to every process of a job) to it: the trainer finishes the step in flight, which
    # may be generating here, before it stops this child
    set_parent_death_signal(signal.SIGKILL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # a spawned process starts with the trainer's environment: keep what a child inference
    # process is given (its own world of one; before torch initialises CUDA or a process group)
    env = inference_env()
    for k in set(os.environ) - env.keys():
        del os.environ[k]
    if config.gpu is not None:  # init_distributed takes the process's GPU from LOCAL_RANK
        os.environ["LOCAL_RANK"] = str(config.gpu)
    version = 0  # the weights' version, told with each generate answer
    try:
        version = read_version(config.hf_checkpoint) or 0
        if config.cores:
            os.sched_setaffinity(0, set(config.cores))
            torch.set_num_threads(len(config.cores))
        deterministic_env(config.deterministic)  # before megatron.core (and TransformerEngine)
        from megatron_rl.models import ModelArgs, hf_mapping
        from megatron_rl.models.policy import Policy
        from megatron_rl.parallel import ParallelConfig, init_distributed
        from megatron_rl.rollout.local import LocalEngine
        from megatron_rl.rollout.weight_sync import to_torch_dtype

        init_distributed(ParallelConfig(), seed=config.seed, deterministic=config.deterministic)
        args = ModelArgs.from_pretrained(config.hf_checkpoint)
        policy = Policy(args, trainable=False, params_dtype=to_torch_dtype(config.dtype))
        policy.load_hf(config.hf_checkpoint)
        engine = LocalEngine(policy, pad_token_id=config.pad_token_id)
    except Exception as e:
        conn.send(("error", (f"{type(e).__name__}: {e}", traceback.format_exc())))
        return
    conn.send(("ok", os.getpid()))
    staged: dict[str, torch.Tensor] = {}
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the trainer is gone
            skip_exit_collection()
            return
        op = msg[0]
        if op == "stop":
            skip_exit_collection()  # the trainer waits for this process to end
            return
        try:
            if op == "generate":
                interrupt = abort.is_set if abort is not None else None
                t0 = time.perf_counter()
                out = engine.generate(*msg[1:], interrupt=interrupt)
                result = (out, version, time.perf_counter() - t0)
            elif op == "bucket":
                staged.update(read_bucket(msg[1], msg[2]))  # views, loaded at "commit"
                result = None
            elif op == "commit":
                full = hf_mapping.hf_to_megatron(staged, args, source="shared-memory weights")
                policy.load_full_state_dict(full, source="shared-memory weights")
                staged = {}
                result = version = msg[1]
            elif op == "load_dir":
                policy.load_hf(msg[1])
                result = version = msg[2]
            else:
                raise ValueError(f"unknown request {op!r}")
            conn.send(("ok", result))
        except Exception as e:
            staged = {}
            conn.send(("error", (f"{type(e).__name__}: {e}", traceback.format_exc())))
