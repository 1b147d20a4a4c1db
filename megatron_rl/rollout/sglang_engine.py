"""SGLang rollout engine: an SGLang server (`python -m sglang.launch_server`) driven over HTTP.

Generation: `POST /generate` with `input_ids`, `return_logprob` and one item per sample (the
batch is expanded to prompts x n here, sample j of prompt i seeded `prompt_seed(seed, i) + j`
(base.prompt_seed), so the output order and seeding are explicit). The server runs with
`--skip-tokenizer-init`; tokens and log-probs come from `meta_info.output_token_logprobs`.
It stops at `stop_token_ids` / `max_new_tokens`; sglang checks stop ids only with EOS enabled,
so with stop ids the model's EOS also stops (list it among the stop ids, as the trainer does).

Weight sync, three ways (`SGLangConfig.sync`, through weight_sync.WeightSync):
- "disk": the policy is exported as an HF directory through the shared mapping and loaded with `/update_weights_from_disk` (any placement);
- "tensor" (colocated: server and trainer on one machine): the HF tensors are shared through
  torch's file_system shared-memory strategy and loaded with `/update_weights_from_tensor`,
  inside a `/begin_weight_update` ... `/end_weight_update` session;
- "distributed" (NCCL, GPU only): rank 0 joins a process group with the server's TP workers
  (`/init_weights_update_group`, once; rank 0 hosts its rendezvous store, see
  `trainer_update_group`) and broadcasts each tensor while `/update_weights_from_distributed`
  receives it. The NCCL transfer is not testable on CPU; the group's construction is (gloo).
Every sync tags the server with `weight_version` and checks it through `/model_info`;
`/flush_cache` drops KV computed with the old weights (the update endpoints also flush).

sglang pins CUDA builds of its dependencies; on CPU it runs from its own venv with an
import-only stand-in for `sgl_kernel` (see docs/rollout.md). A dead server is restarted from the
newest exported weights (disk sync), or from the initial checkpoint followed by a fresh sync.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import io
import itertools
import os
import threading
import time
from datetime import timedelta

import torch

from megatron_rl.parallel import dist_rank
from megatron_rl.rollout.base import (BadAnswer, Completion, SamplingParams, ServerConfig,
                                      ServerError, prompt_seed)
from megatron_rl.rollout.managed_server import ManagedServer
from megatron_rl.rollout.interrupt import STREAM_INTERVAL, Ticket
from megatron_rl.rollout.net import free_port, http_json
from megatron_rl.rollout.server_engine import (REPO_ROOT, ServerBackedEngine, read_hf_config,
                                               server_python)
from megatron_rl.rollout.shm_weights import bucket_names
from megatron_rl.rollout.weight_sync import read_version, sync_engine

PYTHON_ENV_VAR = "MEGATRON_RL_SGLANG_PYTHON"


def sglang_python() -> str | None:
    """The SGLang venv's interpreter: $MEGATRON_RL_SGLANG_PYTHON, else <repo>/.venv-sglang, or None."""
    return server_python(PYTHON_ENV_VAR, ".venv-sglang")


# tokens SGLang keeps below --context-length that no input may use (see SGLangEngine._argv)
SGLANG_INPUT_RESERVE = 6


@dataclasses.dataclass(kw_only=True)
class SGLangConfig(ServerConfig):
    """How to run the SGLang server (base.ServerConfig's fields, and these); `url` attaches to
    a running one instead. `sync`: disk, tensor or distributed; `bucket_bytes` sizes the NCCL
    buckets of the distributed sync."""

    device: str | None = None           # None: "cpu" when CUDA is absent, else sglang's default
    context_length: int = 4096          # the longest prompt + new tokens a request may have
    tp_size: int = 1
    mem_fraction_static: float | None = None
    max_total_tokens: int | None = None  # the KV pool's tokens at most (None: as the memory allows)
    memory_saver: bool = False          # --enable-memory-saver: release_memory / resume_memory
    # --enable-return-routed-experts: requests may ask for each token's experts (routing replay)
    routed_experts: bool = False
    # distributed (NCCL) sync: where the server's workers reach trainer rank 0
    nccl_master_address: str = "127.0.0.1"
    nccl_master_port: int | None = None


class SGLangEngine(ServerBackedEngine[SGLangConfig]):
    """RolloutEngine backed by an SGLang server (see module docstring)."""

    NAME = "SGLang"
    # SGLang's memory-saver regions (sglang.srt.constants GPU_MEMORY_TYPE_*), named: without
    # tags a release covers what that version counts as "all" (weights and KV cache only in
    # some), and the resume must take back the same set
    MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
    RELEASE = ("/release_memory_occupation", {"tags": list(MEMORY_TAGS)})
    RESUME = ("/resume_memory_occupation", {"tags": list(MEMORY_TAGS)})
    # --partial-rollouts: abort the requests in flight (each streams its last state) and hold
    # new ones until /continue_generation
    PAUSE = ("/pause_generation", {"mode": "abort"})
    UNPAUSE = ("/continue_generation", {})

    def __init__(self, model_path: str, config: SGLangConfig, policy=None, start: bool = True):
        self.config = config
        self.policy = policy
        self.model_path = os.path.abspath(model_path)
        self.hf_config = read_hf_config(model_path)
        self.vocab_size = self.hf_config.get("vocab_size")
        _check_servable(self.hf_config, model_path)
        self.request_timeout = config.request_timeout
        self.weight_version = read_version(model_path) or 0
        self._use_weight_sync()
        self._use_gate()
        self.rank = dist_rank()
        self.python = config.python or sglang_python()
        self._nccl_group = None
        self._sparse: tuple[int, list[int]] | None = None  # (layers, MoE layers), when asked
        self._nccl_group_name = ""
        self.server: ManagedServer | None = None
        if self.rank == 0:
            if config.url is not None:
                self.server = ManagedServer.attach(config.url, name="sglang")
            else:
                if self.python is None:
                    raise ServerError(
                        f"no SGLang environment: set ${PYTHON_ENV_VAR} or create "
                        f"{REPO_ROOT}/.venv-sglang (see docs/rollout.md)")
                self.server = ManagedServer(
                    "sglang", self._argv, self.model_path,
                    log_dir=os.path.join(config.work_dir, "logs"), env=self._env(),
                    startup_timeout=config.startup_timeout, max_restarts=config.max_restarts,
                    host=config.host, on_start=self._on_start, stop_timeout=5.0)  # it lingers on SIGTERM
        self.url: str | None = None
        if start:
            self.start()

    # -- process ---------------------------------------------------------------------------------
    def _device(self, cuda: bool | None = None) -> str | None:
        """config.device, else "cpu" without CUDA (`cuda`; None: whether this process has it)
        and None (sglang's default) with it."""
        if self.config.device is not None:
            return self.config.device
        from megatron_rl.parallel import use_cuda

        return None if (use_cuda() if cuda is None else cuda) else "cpu"

    def _argv(self, model_path: str, host: str, port: int,
              cuda: bool | None = None) -> list[str]:
        """The server's command line; `cuda`: whether it runs on GPUs (None: whether this
        process has CUDA, where the server runs)."""
        c = self.config
        # SGLang refuses an input of more than --context-length - 6 tokens (sglang 0.5.23,
        # srt/managers/tp_worker.py:568-572: max_req_input_len = context_len - 1 - 5, and
        # srt/managers/utils.py:272 refuses len(input) >= it): the server's context is ours plus
        # that reserve, within the model's positions
        context = c.context_length + SGLANG_INPUT_RESERVE
        positions = self.hf_config.get("max_position_embeddings")
        if positions:
            context = max(c.context_length, min(context, positions))
        argv = [self.python, "-m", "sglang.launch_server", "--model-path", model_path,
                "--host", host, "--port", str(port), "--skip-tokenizer-init",
                "--dtype", c.dtype, "--context-length", str(context),
                "--random-seed", str(c.seed), "--tp-size", str(c.tp_size)]
        if self._device(cuda) == "cpu":
            argv += ["--device", "cpu", "--attention-backend", "torch_native",
                     "--disable-cuda-graph"]
        if c.mem_fraction_static is not None:
            argv += ["--mem-fraction-static", str(c.mem_fraction_static)]
        if c.max_total_tokens is not None:
            argv += ["--max-total-tokens", str(c.max_total_tokens)]
        if c.memory_saver:
            argv.append("--enable-memory-saver")
        if c.routed_experts:
            argv.append("--enable-return-routed-experts")
        return argv + list(c.extra_args)

    def _env(self, cuda: bool | None = None) -> dict[str, str]:
        """The launch environment's additions (`cuda` as in _argv)."""
        return ({"SGLANG_USE_CPU_ENGINE": "1"} if self._device(cuda) == "cpu"
                else self._device_env())

    def _on_start(self, server: ManagedServer) -> None:
        if server.num_restarts and self._nccl_group is not None:
            self._drop_update_group()  # its server side died with the old process
        version = read_version(server.model_path)
        if version is not None:
            http_json("POST", server.url + "/update_weight_version",
                      {"new_version": str(version), "abort_all_requests": False}, 60.0)
        elif self.weight_version and self.policy is not None and server.num_restarts:
            # Restarted from the initial checkpoint (tensor / NCCL sync): the trainer must
            # re-send its weights; flag it so the next update_weights does.
            self.needs_resync = True

    # -- generation ------------------------------------------------------------------------------
    def _request(self, prompts: list[list[int]], n: int, params: SamplingParams,
                 ticket: Ticket | None = None) -> list[list[Completion]]:
        """One /generate request of every sample (streamed under a `ticket`: `_stream`)."""
        input_ids, sampling = [], []
        for i, p in enumerate(prompts):
            seed = prompt_seed(params.seed, i)
            for j in range(n):
                input_ids.append(p)
                sp = {"max_new_tokens": params.max_new_tokens, "temperature": params.temperature,
                      "top_p": params.top_p, "top_k": params.top_k,
                      "stop_token_ids": list(params.stop_token_ids),
                      # sglang checks stop_token_ids only when EOS is not ignored
                      "ignore_eos": not params.stop_token_ids,
                      "skip_special_tokens": False, "no_stop_trim": True}
                if seed is not None:  # sample j of prompt i: base.prompt_seed's rule
                    sp["sampling_seed"] = seed + j
                sampling.append(sp)
        payload = {"input_ids": input_ids, "sampling_params": sampling, "return_logprob": True,
                   "logprob_start_len": -1}
        sparse = None
        if params.return_routed_experts:
            payload["return_routed_experts"] = True
            sparse = self._sparse_layers()
        if ticket is not None:
            assert sparse is None, "routed experts are not streamed (TrainConfig.validate)"
            for sp in sampling:
                sp["stream_interval"] = STREAM_INTERVAL
            return self._stream(payload, prompts, n, ticket)
        resp = self._post("/generate", payload, self.request_timeout)
        if isinstance(resp, dict):
            resp = [resp]
        try:
            if len(resp) != len(input_ids):
                raise BadAnswer(f"{len(resp)} outputs for {len(input_ids)} samples")
            return [[_completion(resp[i * n + j], len(p), sparse) for j in range(n)]
                    for i, p in enumerate(prompts)]
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise BadAnswer(f"malformed answer ({type(e).__name__}: {e}): "
                            f"{str(resp)[:300]!r}") from None

    def _stream(self, payload: dict, prompts: list[list[int]], n: int,
                ticket: Ticket) -> list[list[Completion]]:
        """`payload` as a streamed request, read while `ticket` is live (_read_live): each event
        holds one sample's (its `index`) tokens and log-probs so far; a sample whose last event
        read has no finish reason (a weight update cut the stream, or the pause stopped it) ends
        "abort" with those tokens."""

        def read(url: str) -> list[list[Completion]]:
            last: list[dict | None] = [None] * (len(prompts) * n)

            def take(event: dict) -> None:
                last[int(event.get("index", 0))] = event

            cut = self._read_live(url, "/generate", payload, ticket, take)
            out = []
            for i, event in enumerate(last):
                finished = event is not None and event["meta_info"].get("finish_reason")
                if not cut and not finished:
                    raise BadAnswer(f"the stream ended without a finish reason for sample {i}")
                c = _completion(event) if event is not None else Completion([], [], "abort")
                if not finished:
                    c.finish_reason = "abort"
                out.append(c)
            return [out[i * n:(i + 1) * n] for i in range(len(prompts))]

        return self._on_server(read)

    def _sparse_layers(self) -> tuple[int, list[int]]:
        """(the model's layer count, its mixture-of-experts layers): SGLang reports routes for
        every layer."""
        if self._sparse is None:
            from megatron_rl.models.config import ModelArgs

            pattern = ModelArgs.from_hf_config(self.hf_config,
                                               source=self.model_path).moe_layer_pattern
            sparse = [i for i, is_moe in enumerate(pattern) if is_moe]
            if not sparse:
                raise ValueError(f"routed experts asked of {self.model_path}, which has no "
                                 "mixture-of-experts layers")
            self._sparse = (len(pattern), sparse)
        return self._sparse

    # -- weights ---------------------------------------------------------------------------------
    def update_weights(self, version: int) -> None:
        """Collective over all training ranks: send the policy's weights to the server."""
        sync_engine(self.sync, self.policy, self, version)
        self.weight_version = version
        self.needs_resync = False

    def load_weights_from_path(self, path: str, version: int) -> None:
        with self._loading():
            t0 = time.perf_counter()
            path = os.path.abspath(path)
            if self.server.managed:
                self.server.model_path = path  # a restart from here on serves these weights
            resp = self._post("/update_weights_from_disk", {
                "model_path": path, "weight_version": str(version), "flush_cache": True})
            _check_success(resp, "update_weights_from_disk")
            self._confirm_version(version)
            self.last_sync_seconds["load"] = time.perf_counter() - t0
            if self.server.managed:
                self.exporter.prune(path)
            self.weight_version = version  # (the gate opens on it: rollout/interrupt.py)

    def load_weights_from_tensors(self, hf: dict, version: int) -> None:
        """Colocated: hand the tensors over through shared memory (no copy over HTTP)."""
        with self._loading():
            t0 = time.perf_counter()
            named = [(k, v.detach().contiguous()) for k, v in hf.items()]
            with _file_system_sharing():
                blob = _forking_pickle(named)
            payload = {"serialized_named_tensors": [blob] * max(1, self.config.tp_size),
                       "weight_version": str(version), "flush_cache": True}
            _check_success(self._post("/begin_weight_update", {}), "begin_weight_update")
            try:
                _check_success(self._post("/update_weights_from_tensor", payload),
                               "update_weights_from_tensor")
            finally:
                _check_success(self._post("/end_weight_update", {}), "end_weight_update")
            del named  # the server has copied them; the shared-memory segments may go now
            self._confirm_version(version)
            self.last_sync_seconds["load"] = time.perf_counter() - t0
            self.weight_version = version  # (the gate opens on it: rollout/interrupt.py)

    def load_weights_distributed(self, hf: dict, version: int) -> None:
        """NCCL broadcast from trainer rank 0 (rank 0 of the update group) to the server's TP
        workers (ranks 1..tp_size). GPU only."""
        with self._loading():
            from megatron_rl.parallel import device, use_cuda

            if not use_cuda():
                raise ServerError("sync='distributed' broadcasts over NCCL and needs CUDA")
            t0 = time.perf_counter()
            if self._nccl_group is None:
                self._nccl_group = self._init_update_group()
            buckets = bucket_names({n: hf[n] for n in sorted(hf)}, self.config.bucket_bytes)
            for i, bucket in enumerate(buckets):
                tensors = [hf[n].to(device(), non_blocking=True) for n in bucket]
                payload = {"names": bucket, "dtypes": [str(t.dtype).replace("torch.", "")
                                                       for t in tensors],
                           "shapes": [list(t.shape) for t in tensors],
                           "group_name": self._nccl_group_name,
                           "flush_cache": i == len(buckets) - 1,
                           "weight_version": str(version) if i == len(buckets) - 1 else None}
                result = {}
                # The server posts its receives while we broadcast: the HTTP call must run
                # concurrently with the collective.
                thread = threading.Thread(target=lambda: result.update(
                    resp=self._post("/update_weights_from_distributed", payload)))
                thread.start()
                for t in tensors:
                    torch.distributed.broadcast(t, src=0, group=self._nccl_group)
                thread.join()
                _check_success(result.get("resp"), "update_weights_from_distributed")
            self._confirm_version(version)
            self.last_sync_seconds["load"] = time.perf_counter() - t0
            self.weight_version = version  # (the gate opens on it: rollout/interrupt.py)

    def _init_update_group(self):
        port = self.config.nccl_master_port or free_port("0.0.0.0")
        world = 1 + self.config.tp_size
        # a name of its own per group: several servers (a pool) and a restarted server each get
        # a new group in this process, and process-group names must be unique (the pid: an
        # attached server may still hold a group of an earlier trainer)
        name = self._nccl_group_name = f"mrl_weights_{os.getpid()}_{next(_UPDATE_GROUP_IDS)}"
        addr = self.config.nccl_master_address
        result = {}
        thread = threading.Thread(target=lambda: result.update(resp=self._post(
            "/init_weights_update_group",
            {"master_address": addr, "master_port": port, "rank_offset": 1,
             "world_size": world, "group_name": name, "backend": "nccl"})))
        thread.start()
        group = trainer_update_group(addr, port, world, name, "nccl")
        thread.join()
        _check_success(result.get("resp"), "init_weights_update_group")
        return group

    def _confirm_version(self, version: int) -> None:
        got = self.server_weight_version()
        if got != version:
            raise ServerError(f"SGLang reports weight version {got} after loading {version}")

    def server_weight_version(self) -> int | None:
        info = (self.server.get("/model_info") if self.server is not None
                else http_json("GET", self.url + "/model_info"))
        v = info.get("weight_version")
        try:
            return int(v)
        except (TypeError, ValueError):
            return None

    def flush_cache(self) -> None:
        self._post("/flush_cache", None)

    # -- health ----------------------------------------------------------------------------------
    def _drop_update_group(self, tell_server: bool = False) -> None:
        import torch.distributed as dist

        if tell_server and self.url is not None:  # once, briefly: no restart, no long wait
            with contextlib.suppress(Exception):
                http_json("POST", self.url + "/destroy_weights_update_group",
                          {"group_name": self._nccl_group_name}, 10.0)
        with contextlib.suppress(Exception):
            dist.destroy_process_group(self._nccl_group)
        self._nccl_group, self._nccl_group_name = None, ""

    def shutdown(self) -> None:
        if self._nccl_group is not None:
            self._drop_update_group(tell_server=True)
        self._stop_server()


_UPDATE_GROUP_IDS = itertools.count()


def trainer_update_group(address: str, port: int, world_size: int, group_name: str,
                         backend: str, timeout: timedelta | None = None):
    """The trainer's side (rank 0) of a weight-update group with a server's workers (ranks
    1..world_size-1), who join it through SGLang's `init_custom_process_group`: a TCP
    rendezvous at address:port, keys under a PrefixStore named after the group.

    This rank hosts the rendezvous store itself. `rendezvous("tcp://...")` would not: under
    torchrun (TORCHELASTIC_USE_AGENT_STORE=True in every worker) it makes every rank a client
    of a store it expects torchrun's agent to host, and nobody hosts this one. The store's
    server is shared with any other group on the same port in this process (multi-tenant).
    `timeout` bounds the store's waits (default: torch's 30 min, as on the server's side) and
    the group's collectives (default: the backend's).
    """
    import torch.distributed as dist
    from torch._C._distributed_c10d import TCPStore
    from torch.distributed.constants import default_pg_timeout
    from torch.distributed.distributed_c10d import (GroupName, PrefixStore,
                                                    _new_process_group_helper, _world)

    store = TCPStore(address, port, world_size, is_master=True,
                     timeout=timeout or default_pg_timeout, wait_for_workers=False,
                     multi_tenant=True)
    group, _ = _new_process_group_helper(world_size, 0, [], dist.Backend(backend),
                                         PrefixStore(group_name, store),
                                         group_name=GroupName(group_name), timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def _check_servable(hf_config: dict, path: str) -> None:
    """Refuse what SGLang 0.5.23 serves wrongly without an error: its Qwen3MoeForCausalLM makes
    every layer sparse (skipping the dense layers' weights) and never loads a tied lm_head.
    Qwen3-30B-A3B and its siblings (every layer sparse, untied) are served correctly."""
    if hf_config.get("model_type") != "qwen3_moe":
        return
    dense = bool(hf_config.get("mlp_only_layers")) or hf_config.get("decoder_sparse_step", 1) != 1
    if dense or hf_config.get("tie_word_embeddings"):
        what = "dense layers (mlp_only_layers / decoder_sparse_step)" if dense else \
            "tied embeddings"
        raise ValueError(f"{path}: SGLang's Qwen3-MoE serves a checkpoint with {what} wrongly "
                         "(every layer sparse, lm_head from the checkpoint); use the vllm, "
                         "process or local engine")


def _completion(item: dict, prompt_len: int = 0,
                sparse: tuple[int, list[int]] | None = None) -> Completion:
    """One sample of a /generate answer; with `sparse` (the model's layer count and its MoE
    layers), also its routed experts: meta_info["routed_experts"], base64 of int32
    [prompt + output - 1, layers, k] over every layer, cut to the MoE layers."""
    meta = item["meta_info"]
    pairs = meta.get("output_token_logprobs") or []
    token_ids = [int(p[1]) for p in pairs]
    logprobs = [float(p[0]) for p in pairs]
    if "output_ids" in item and [int(t) for t in item["output_ids"]] != token_ids:
        raise BadAnswer("SGLang output_ids and output_token_logprobs disagree")
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type") if isinstance(finish, dict) else str(finish)
    # "stop" / "length" (None: the length limit); anything else ("abort") fails
    # check_completions
    c = Completion(token_ids, logprobs, "length" if kind is None else str(kind))
    if sparse is not None:
        layers, sparse_ids = sparse
        encoded = meta.get("routed_experts")
        if not encoded:
            raise BadAnswer("no routed_experts in the answer: the server needs "
                            "--enable-return-routed-experts (SGLangConfig.routed_experts)")
        flat = torch.frombuffer(bytearray(base64.b64decode(encoded)), dtype=torch.int32)
        n = prompt_len + len(token_ids) - 1
        if n <= 0 or flat.numel() == 0 or flat.numel() % (n * layers):
            raise BadAnswer(f"routed_experts holds {flat.numel()} ids, not {n} tokens x "
                            f"{layers} layers x k")
        routes = flat.reshape(n, layers, flat.numel() // (n * layers))[:, sparse_ids]
        c.routed_experts = routes.to(torch.int16)
    return c


def _check_success(resp, what: str) -> None:
    if isinstance(resp, dict) and resp.get("success") is False:
        raise ServerError(f"SGLang {what} failed: {resp.get('message')}")


@contextlib.contextmanager
def _file_system_sharing():
    """Tensors pickled inside travel as shared-memory file names, which the server process
    (another process tree) can open; the default fd-passing strategy needs a Unix socket."""
    import torch.multiprocessing as mp

    old = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        mp.set_sharing_strategy(old)


def _forking_pickle(obj) -> str:
    """What sglang's MultiprocessingSerializer.serialize(obj, output_str=True) produces."""
    import torch.multiprocessing  # noqa: F401  (registers the tensor reductions)
    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()

