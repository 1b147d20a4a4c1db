"""vLLM rollout engine: a vLLM OpenAI-compatible server in its own venv, driven over HTTP.

Generation: `POST /v1/completions` with the prompts as token ids (a seeded call: one request per
prompt, each with its own seed, base.prompt_seed), `n` samples each, `logprobs=0`
(only the sampled token's log-prob), `return_token_ids` and `return_tokens_as_token_ids` (so no
tokenizer is needed: the server runs with `--skip-tokenizer-init`). Generation stops only at
`SamplingParams.stop_token_ids` (the caller lists the tokenizer's EOS there) or at
`max_new_tokens`: `ignore_eos` keeps vLLM from adding stop tokens of its own, so every engine
stops on the same tokens. The server runs with `--logprobs-mode processed_logprobs`, so
rollout_logprobs are log-probs of the distribution actually sampled (after temperature, and
after top-k/top-p renormalisation when those are set); at temperature 1 without truncation they
are the policy's own log-probs.

Weight sync (`update_weights`, through weight_sync.WeightSync): the policy is exported as an HF
directory through the shared mapping, then the worker extension in vllm_worker.py reloads it in
place (`/collective_rpc mrl_reload_weights`, ~0.03 s for a tiny model) and re-packs a tied
lm_head, which vLLM's own `reload_weights` leaves stale on CPU. The worker echoes the version it
loaded, and the prefix cache is reset so no KV computed with old weights is reused. On an
attached server without the extension, the plain `reload_weights` RPC is used, and tied models
fall back to a restart (managed servers only).

The server is launched and owned by global rank 0; its URL is broadcast, so any rank may
generate. A server that dies is restarted from the newest exported weights (managed_server.py).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import os
import time
from typing import ClassVar

from megatron_rl.parallel import dist_rank
from megatron_rl.rollout.base import (BadAnswer, Completion, SamplingParams, ServerConfig,
                                      ServerError, prompt_seed)
from megatron_rl.rollout.managed_server import ManagedServer
from megatron_rl.rollout.interrupt import STREAM_INTERVAL, Ticket
from megatron_rl.rollout.net import ServerRequestError
from megatron_rl.rollout.server_engine import (REPO_ROOT, ServerBackedEngine, read_hf_config,
                                               server_python)
from megatron_rl.rollout.shm_weights import meta_nbytes
from megatron_rl.rollout.threads import BackgroundThreads
from megatron_rl.rollout.weight_sync import read_version, sync_engine

PYTHON_ENV_VAR = "MEGATRON_RL_VLLM_PYTHON"
WORKER_EXTENSION = "megatron_rl.rollout.vllm_worker.WeightSyncExtension"
SERVED_MODEL_NAME = "policy"


def vllm_python() -> str | None:
    """The vLLM venv's interpreter: $MEGATRON_RL_VLLM_PYTHON, else <repo>/.venv-vllm, or None."""
    return server_python(PYTHON_ENV_VAR, ".venv-vllm")


@dataclasses.dataclass(kw_only=True)
class VLLMConfig(ServerConfig):
    """How to run the vLLM server. `url` attaches to a running server instead of launching one
    (it must run with VLLM_SERVER_DEV_MODE=1, `--served-model-name policy`,
    `--skip-tokenizer-init`, `--logprobs-mode processed_logprobs` and, for weight versions and
    tied models, `--worker-extension-cls megatron_rl.rollout.vllm_worker.WeightSyncExtension`).

    Weights after each step (`sync`): "disk" (an HF export the workers reload) or "tensor"
    (shared-memory buckets of bucket_bytes, same host; needs the worker extension). The server
    configuration shared with SGLang is base.ServerConfig's.
    """

    SYNCS: ClassVar[tuple[str, ...]] = ("disk", "tensor")

    max_model_len: int = 4096
    # --enforce-eager (no torch.compile, no CUDA graphs: a faster start, slower decoding); None:
    # on the CPU, which has no CUDA graphs, and not on GPUs
    enforce_eager: bool | None = None
    kv_cache_memory_bytes: int | None = None   # CPU: bytes of KV cache (None: vLLM's default)
    gpu_memory_utilization: float | None = None
    tensor_parallel_size: int = 1
    sleep_mode: bool = False            # --enable-sleep-mode: release_memory / resume_memory


class VLLMEngine(ServerBackedEngine[VLLMConfig]):
    """RolloutEngine backed by a vLLM server (see module docstring).

    model_path: HF checkpoint served at start (the policy's initial weights).
    policy: the trainer's Policy; needed by update_weights, optional for generation only.
    """

    NAME = "vLLM"
    SHARED_MEMORY = True  # tensor sync: shared-memory buckets the worker extension reads
    RELEASE = ("/sleep?level=1", None)  # level 1: weights to host memory, KV cache dropped
    RESUME = ("/wake_up", None)
    # --partial-rollouts: abort the requests in flight (each streams its last tokens, finish
    # reason "abort") and hold new ones until /resume
    PAUSE = ("/pause?mode=abort", None)
    UNPAUSE = ("/resume", None)

    def __init__(self, model_path: str, config: VLLMConfig, policy=None, start: bool = True):
        self.config = config
        self.policy = policy
        self.weight_version = read_version(model_path) or 0
        hf_config = read_hf_config(model_path)
        self.tie_word_embeddings = bool(hf_config.get("tie_word_embeddings", False))
        self.vocab_size = hf_config.get("vocab_size")
        self.request_timeout = config.request_timeout
        self.has_extension = config.url is None  # an attached server is probed at start
        self._use_weight_sync()
        self._use_gate()
        self.last_sync_bytes = 0
        self.rank = dist_rank()
        self.python = config.python or vllm_python()
        self.server: ManagedServer | None = None
        if self.rank == 0:
            if config.url is not None:
                self.server = ManagedServer.attach(config.url, name="vllm",
                                                   on_start=self._on_start)
            else:
                if self.python is None:
                    raise ServerError(
                        f"no vLLM environment: set ${PYTHON_ENV_VAR} or run "
                        f"scripts/install_vllm_cpu.sh (creates {REPO_ROOT}/.venv-vllm)")
                self.server = ManagedServer(
                    "vllm", self._argv, os.path.abspath(model_path),
                    log_dir=os.path.join(config.work_dir, "logs"), env=self._env(),
                    startup_timeout=config.startup_timeout, max_restarts=config.max_restarts,
                    host=config.host, on_start=self._on_start)
        self.url: str | None = None
        if start:
            self.start()

    # -- process ---------------------------------------------------------------------------------
    def _argv(self, model_path: str, host: str, port: int,
              cuda: bool | None = None) -> list[str]:
        """The server's command line; `cuda`: whether it runs on GPUs (None: whether this
        process has CUDA, where the server runs)."""
        from megatron_rl.parallel import use_cuda

        c = self.config
        cuda = use_cuda() if cuda is None else cuda
        argv = [self.python, "-m", "vllm.entrypoints.openai.api_server",
                "--model", model_path, "--served-model-name", SERVED_MODEL_NAME,
                "--host", host, "--port", str(port), "--skip-tokenizer-init",
                "--dtype", c.dtype, "--max-model-len", str(c.max_model_len),
                "--seed", str(c.seed), "--logprobs-mode", "processed_logprobs",
                "--tensor-parallel-size", str(c.tensor_parallel_size),
                "--worker-extension-cls", WORKER_EXTENSION]
        if c.enforce_eager if c.enforce_eager is not None else not cuda:
            argv.append("--enforce-eager")
        if not cuda and not any("chunked-prefill" in arg for arg in c.extra_args):
            # vllm-cpu 0.32 dies ("CPU Generator does not use offset") when a seeded request's
            # prefill is split over engine steps, as concurrent long prompts are: each prompt is
            # prefilled in one step on the CPU
            argv.append("--no-enable-chunked-prefill")
        if c.partial_rollouts and not any("stream-interval" in arg for arg in c.extra_args):
            argv += ["--stream-interval", str(STREAM_INTERVAL)]  # the cut reads streams
        if c.sleep_mode:
            argv.append("--enable-sleep-mode")
        if c.kv_cache_memory_bytes is not None:
            argv += ["--kv-cache-memory-bytes", str(c.kv_cache_memory_bytes)]
        if c.gpu_memory_utilization is not None:
            argv += ["--gpu-memory-utilization", str(c.gpu_memory_utilization)]
        return argv + list(c.extra_args)

    def _env(self) -> dict[str, str]:
        pythonpath = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p)
        # The extension module must import in the server's workers; dev mode opens
        # /collective_rpc and /reset_prefix_cache.
        return {"PYTHONPATH": pythonpath, "VLLM_SERVER_DEV_MODE": "1", **self._device_env()}

    def _on_start(self, server: ManagedServer) -> None:
        """After every (re)start: the worker's version tag is that of the directory it loaded.
        Under tensor sync a restart serves the initial checkpoint: flagged, the server takes no
        request until the next update_weights (a ServerPool sits it out meanwhile)."""
        if self.config.sync == "tensor" and server.num_restarts and self.last_sync_bytes:
            self.needs_resync = True
        if not server.managed:  # an attached server: does it run the worker extension?
            try:
                resp = server.post("/collective_rpc", {"method": "mrl_weight_version"},
                                   retry=False)
                self.has_extension = isinstance(resp, dict) and "results" in resp
            except ServerRequestError:
                self.has_extension = False
        if self.has_extension:
            version = read_version(server.model_path) if server.managed else None
            if version is not None:
                server.post("/collective_rpc", {"method": "mrl_set_weight_version",
                                                "kwargs": {"version": str(version)}},
                            retry=False)

    # -- generation ------------------------------------------------------------------------------
    max_prompt_requests: int = 256  # requests in flight at once for one seeded call

    def _request(self, prompts: list[list[int]], n: int, params: SamplingParams,
                 ticket: Ticket | None = None) -> list[list[Completion]]:
        """The call's completions (streamed under a `ticket`: ServerBackedEngine._request). A seeded call of several prompts is one request per prompt,
        sent at once (at most `max_prompt_requests` in flight; the server batches them): the
        completions API takes one seed per request and gives every prompt of its list a
        generator seeded alike (sample j: seed + j), so that sample j of every prompt would draw
        the same noise. Prompt i is asked alone with base.prompt_seed(seed, i). Every request of
        the call has ended when it returns or raises; the first failure in prompt order is
        raised (a bad answer naming its prompt)."""
        if params.seed is None or len(prompts) == 1:
            return self._completions(prompts, n, params, ticket)
        threads = BackgroundThreads(min(len(prompts), self.max_prompt_requests),
                                    name="vllm-prompts")
        try:
            futures = [threads.submit(self._completions, [p], n,
                                      dataclasses.replace(params, seed=prompt_seed(params.seed, i)),
                                      ticket)
                       for i, p in enumerate(prompts)]
            cf.wait(futures)
        finally:
            threads.shutdown(wait=False)
        for i, f in enumerate(futures):
            error = f.exception()
            if isinstance(error, BadAnswer):
                raise BadAnswer(f"prompt {i} of {len(prompts)}: {error}") from None
            if error is not None:
                raise error
        return [f.result()[0] for f in futures]

    def _completions(self, prompts: list[list[int]], n: int, params: SamplingParams,
                     ticket: Ticket | None = None) -> list[list[Completion]]:
        """One /v1/completions request for `prompts` and its parsed answer (streamed under a
        `ticket`: `_stream`)."""
        payload = {
            "model": SERVED_MODEL_NAME, "prompt": prompts,
            "n": n, "max_tokens": params.max_new_tokens, "temperature": params.temperature,
            "top_p": params.top_p, "stop_token_ids": list(params.stop_token_ids),
            "ignore_eos": True, "skip_special_tokens": False, "logprobs": 0,
            "return_token_ids": True, "return_tokens_as_token_ids": True,
        }
        if params.top_k > 0:
            payload["top_k"] = params.top_k
        if params.seed is not None:
            payload["seed"] = params.seed
        if ticket is not None:
            return self._stream(payload, len(prompts), n, ticket)
        resp = self._post("/v1/completions", payload, self.request_timeout)
        try:
            choices = sorted(resp["choices"], key=lambda c: c["index"])
            if len(choices) != len(prompts) * n:
                raise BadAnswer(f"{len(choices)} choices for {len(prompts)} prompts x n={n}")
            out = []
            for i in range(len(prompts)):
                row = []
                for c in choices[i * n:(i + 1) * n]:
                    # "stop" / "length"; anything else ("abort") fails check_completions
                    row.append(Completion([int(t) for t in c["token_ids"]],
                                          [float(x) for x in c["logprobs"]["token_logprobs"]],
                                          str(c["finish_reason"])))
                out.append(row)
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise BadAnswer(f"malformed answer ({type(e).__name__}: {e}): "
                            f"{str(resp)[:300]!r}") from None
        return out

    def _stream(self, payload: dict, num_prompts: int, n: int,
                ticket: Ticket) -> list[list[Completion]]:
        """`payload` as a streamed request, read while `ticket` is live (_read_live): each event
        holds choices' new token ids and their log-probs, and a choice's finish reason on its
        last. A choice without its finish reason when a weight update cut the stream (or the
        pause stopped its request) ends "abort" with what was read before the cut."""
        size = num_prompts * n

        def read(url: str) -> list[list[Completion]]:
            ids: list[list[int]] = [[] for _ in range(size)]
            lps: list[list[float]] = [[] for _ in range(size)]
            finish: list[str | None] = [None] * size

            def take(event: dict) -> None:
                for c in event.get("choices", ()):
                    i = int(c["index"])
                    ids[i] += [int(t) for t in c.get("token_ids") or ()]
                    lps[i] += [float(x) for x in (c.get("logprobs") or {}).get(
                        "token_logprobs") or ()]
                    if c.get("finish_reason") is not None:
                        finish[i] = str(c["finish_reason"])

            cut = self._read_live(url, "/v1/completions", payload, ticket, take)
            if not cut and None in finish:
                raise BadAnswer(f"the stream ended without a finish reason for choice "
                                f"{finish.index(None)}")
            return [[Completion(ids[i * n + j], lps[i * n + j], finish[i * n + j] or "abort")
                     for j in range(n)] for i in range(num_prompts)]

        return self._on_server(read)

    # -- weights ---------------------------------------------------------------------------------
    def update_weights(self, version: int) -> None:
        """Collective over all training ranks: the policy's weights into the server (an HF
        export it reloads, or shared-memory buckets: config.sync)."""
        sync_engine(self.sync, self.policy, self, version)
        self.weight_version = version

    def load_weights_from_shared(self, path: str, metas: list[list[dict]], version: int) -> None:
        """Weights already in a shared buffer (one SharedBuckets.fill metadata list per bucket;
        a ServerPool fills one buffer for all its servers): the workers stage each bucket, then
        load them all in place (`mrl_load_staged`: vLLM's layer-wise reload), and echo the
        version."""
        with self._loading():
            if not self.has_extension:
                raise ServerError("--weight-sync tensor needs the worker extension in the vLLM "
                                  f"server (--worker-extension-cls {WORKER_EXTENSION})")
            t0 = time.perf_counter()
            server = self.server
            self.needs_resync = False  # a restart during the posts below sets it again
            for meta in metas:
                server.post("/collective_rpc", {"method": "mrl_stage_bucket",
                                                "kwargs": {"path": path, "meta": meta}},
                            retry=False)
            resp = server.post("/collective_rpc", {"method": "mrl_load_staged",
                                                   "kwargs": {"version": str(version),
                                                              "expected": sum(map(len, metas))}},
                               retry=False)
            loaded = {r["version"] for r in resp["results"]}
            if loaded != {str(version)}:
                raise ServerError(f"vLLM workers report weight versions {sorted(loaded)} after "
                                  f"loading version {version}")
            server.post("/reset_prefix_cache", None, retry=False)
            self.last_sync_seconds["load"] = time.perf_counter() - t0
            self.last_sync_bytes = sum(meta_nbytes(m) for m in metas)
            self.weight_version = version

    def load_weights_from_path(self, path: str, version: int) -> None:
        """Serve the HF checkpoint at `path` (rank 0), tagged `version`; checks the tag."""
        with self._loading():
            t0 = time.perf_counter()
            server = self.server
            path = os.path.abspath(path)
            if server.managed:
                server.model_path = path  # a restart from here on serves these weights
            if self.has_extension:
                resp = server.post("/collective_rpc", {
                    "method": "mrl_reload_weights",
                    "kwargs": {"weights_path": path, "version": str(version)}})
                loaded = {r["version"] for r in resp["results"]}
                if loaded != {str(version)}:
                    raise ServerError(f"vLLM workers report weight versions {sorted(loaded)} after "
                                      f"loading version {version}")
            elif self.tie_word_embeddings and server.managed:
                server.restart("tied embeddings: reload_weights would keep a stale lm_head")
            elif self.tie_word_embeddings:
                raise ServerError("attached vLLM server without the worker extension cannot reload "
                                  f"a tied-embedding model correctly; run it with "
                                  f"--worker-extension-cls {WORKER_EXTENSION}")
            else:
                server.post("/collective_rpc", {"method": "reload_weights",
                                                "kwargs": {"weights_path": path}})
            server.post("/reset_prefix_cache", None)
            self.last_sync_seconds["reload"] = time.perf_counter() - t0
            self.weight_version = version
            if server.managed:
                self.exporter.prune(path)

    def server_weight_version(self) -> int | None:
        """The version the server's workers report (None without the extension or untagged)."""
        if not self.has_extension:
            return None
        resp = self._post("/collective_rpc", {"method": "mrl_weight_version"}, 60.0)
        versions = set(resp["results"])
        if len(versions) != 1:
            raise ServerError(f"vLLM workers disagree on the weight version: {sorted(versions)}")
        v = versions.pop()
        return int(v) if v not in ("", None) else None

    # -- health ----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        self._stop_server()
        self.sync.close()


