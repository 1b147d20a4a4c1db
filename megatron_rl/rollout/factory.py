"""Which rollout engines exist, what each can do, and building the one a run asks for.

`ENGINES` is the one table of engine facts the rest of the package may consult (configuration
checks, the training loop's defaults); `build_engine` turns a TrainConfig into a RolloutEngine
(rollout/base.py). Nothing outside rollout/ branches on an engine's name.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Callable

from megatron_rl.rollout.memory import GiB, ServerMemory, model_server_memory
from megatron_rl.rollout.needs import episode_tokens

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """What an engine is, as configuration and the loop need to know it.

    holds_own_weights: a copy of the weights of its own, refreshed by update_weights (so it can
        generate in the background while the trainer trains, --async-level).
    weight_syncs: the --weight-sync modes it takes ("auto" always).
    servers: it talks to inference servers (--rollout-url, --rollout-num-servers).
    release_memory: it can free its GPU memory for the training phase (--rollout-release-memory).
    trainer_numerics: it samples with the trainer's own model code, so at fp32 and temperature 1
        its log-probs are the trainer's up to float rounding (--old-logprobs auto uses them).
    routed_experts: it returns the experts a mixture-of-experts model routed each token to
        (SamplingParams.return_routed_experts, for --routing-replay).
    routed_experts_pipelined: it returns them also when the trainer is pipeline-parallel (an
        engine that generates in the trainer's layout sees, on each stage, only its own layers).
    no_partial_rollouts: why it cannot interrupt a generation at a weight update and continue
        it under the new weights (--partial-rollouts); "" where it can.
    """

    name: str
    holds_own_weights: bool
    weight_syncs: tuple[str, ...]
    servers: bool
    release_memory: bool
    trainer_numerics: bool
    routed_experts: bool
    routed_experts_pipelined: bool
    no_partial_rollouts: str = ""

    @property
    def partial_rollouts(self) -> bool:
        """It takes --partial-rollouts."""
        return not self.no_partial_rollouts


ENGINES: dict[str, EngineSpec] = {s.name: s for s in (
    EngineSpec("local", holds_own_weights=False, weight_syncs=("auto",), servers=False,
               release_memory=False, trainer_numerics=True, routed_experts=True,
               routed_experts_pipelined=False,
               no_partial_rollouts="it generates with the trainer's own weights, between "
               "updates"),
    EngineSpec("process", holds_own_weights=True, weight_syncs=("auto", "disk", "tensor"),
               servers=False, release_memory=False, trainer_numerics=True, routed_experts=True,
               routed_experts_pipelined=True),
    EngineSpec("vllm", holds_own_weights=True, weight_syncs=("auto", "disk", "tensor"),
               servers=True, release_memory=True, trainer_numerics=False, routed_experts=False,
               routed_experts_pipelined=False),
    EngineSpec("sglang", holds_own_weights=True,
               weight_syncs=("auto", "disk", "tensor", "distributed"), servers=True,
               release_memory=True, trainer_numerics=False, routed_experts=True,
               routed_experts_pipelined=True),
)}


def build_engine(cfg, policy, pad_id: int, longest_prompt: Callable[[], int]):
    """The RolloutEngine for `cfg` (a TrainConfig) around the trainer's `policy`. Server engines
    start from the initial HF weights (--hf-checkpoint): the caller syncs them when the run
    starts from other weights. `longest_prompt()`: the run's longest prompt in tokens, asked
    (on rank 0) only where servers are started here. Collective when distributed (server URLs
    and the longest prompt are broadcast)."""
    from megatron_rl.parallel import run_on_rank, use_cuda

    r, engine = cfg.rollout, cfg.rollout.rollout_engine
    if engine == "local":
        from megatron_rl.rollout.local import LocalEngine

        return LocalEngine(policy, pad_token_id=pad_id)
    if engine == "process":
        from megatron_rl.rollout.process import ProcessConfig, ProcessEngine

        return ProcessEngine(ProcessConfig(
            hf_checkpoint=cfg.model.hf_checkpoint,
            work_dir=os.path.join(cfg.checkpoint.save, engine),
            dtype="bfloat16" if cfg.model.bf16 else "float32", seed=cfg.seed,
            pad_token_id=pad_id, cores=tuple(r.rollout_process_cores),
            gpu=r.rollout_process_gpu,
            sync="tensor" if r.weight_sync == "auto" else r.weight_sync,
            bucket_bytes=r.weight_sync_bucket_mb << 20, deterministic=cfg.deterministic_mode,
            partial_rollouts=r.partial_rollouts),
            policy=policy)
    cuda = use_cuda()
    longest = gpu_bytes = None
    if not r.rollout_url:  # servers started here: their context length and memory budget
        longest = run_on_rank(0, longest_prompt, "measuring the longest prompt")
        gpu_bytes = _gpu_total_bytes(r.server_gpus()) if cuda else None
    configs = server_configs(cfg, policy.args, longest, cuda, gpu_bytes)
    hf = cfg.model.hf_checkpoint
    engines: list
    if engine == "vllm":
        from megatron_rl.rollout.vllm_engine import VLLMEngine

        engines = [VLLMEngine(hf, c, policy=policy, start=False) for c in configs]
    else:
        from megatron_rl.rollout.sglang_engine import SGLangEngine

        engines = [SGLangEngine(hf, c, policy=policy, start=False) for c in configs]
    if len(engines) == 1:
        engines[0].start()
        return engines[0]
    from megatron_rl.rollout.multi import ServerPool

    # boots the managed servers at once; on GPUs a lost managed server is not booted again
    # during the run (it would take its memory share from the training phase)
    return ServerPool(engines, policy=policy, reboot_managed=not cuda, routing=r.rollout_routing,
                      sticky_slack=r.rollout_sticky_slack)


def server_configs(cfg, args, longest_prompt: int | None, cuda: bool,
                   gpu_bytes: int | None = None) -> list:
    """The VLLMConfig / SGLangConfig of each server of `cfg` (a TrainConfig, --rollout-engine
    vllm or sglang) serving the model `args` (models.ModelArgs): one per --rollout-url, or per
    server started here (--rollout-num-servers). For started servers: `longest_prompt`, the
    run's longest prompt in tokens, sets their context length (server_context_len); `cuda`, that
    they run on GPUs: each on its device (--rollout-gpus), within its memory share of a GPU of
    `gpu_bytes` (checked up front: check_server_memory; for SGLang converted to its terms)."""
    r, engine = cfg.rollout, cfg.rollout.rollout_engine
    dtype = "bfloat16" if cfg.model.bf16 else "float32"
    work_dir = os.path.join(cfg.checkpoint.save, engine)
    mem = r.rollout_gpu_memory_utilization if cuda else None
    # several servers (--rollout-url a b ..., or --rollout-num-servers N): one ServerPool over
    # one engine per server, each in <work_dir>/server<i>; one server: the engine itself
    urls = list(r.rollout_url) or [None] * r.rollout_num_servers
    dirs = [work_dir] if len(urls) == 1 else [os.path.join(work_dir, f"server{i}")
                                               for i in range(len(urls))]
    gpus: list[tuple[int, ...]] = [()] * len(urls)
    plan: ServerMemory | None = None
    context_len: int | None = None  # attached servers: theirs
    if not r.rollout_url:
        assert longest_prompt is not None, "started servers need the longest prompt"
        # a rollout function declaring episode_context: an episode of --agent-max-tokens
        episode = episode_tokens(r.rollout_function, cfg.agent)
        context_len = server_context_len(r, longest_prompt, args.max_position_embeddings,
                                         episode)
        if cuda:
            gpus = [(g,) for g in r.server_gpus()]
            if mem is not None:
                assert gpu_bytes is not None, "a memory share needs the GPU's size"
                plan = server_memory_plan(cfg, args, context_len, gpu_bytes)
                check_server_memory(plan, r)
    common = dict(dtype=dtype, seed=cfg.seed, host=r.rollout_host,
                  bucket_bytes=r.weight_sync_bucket_mb << 20,
                  partial_rollouts=r.partial_rollouts)
    if engine == "vllm":
        from megatron_rl.rollout.vllm_engine import VLLMConfig

        # on CPU vLLM reserves most of the RAM for its KV cache unless told otherwise
        launch: dict = {"kv_cache_memory_bytes": None if cuda else 2 << 30,
                        "gpu_memory_utilization": mem, "sleep_mode": r.rollout_release_memory}
        if context_len is not None:
            launch["max_model_len"] = context_len
        # auto = disk, the faster of the two on the CPU machines measured (benchmarks/RESULTS.md,
        # "Weight sync"; tensor needs a server on this host)
        sync = "disk" if r.weight_sync == "auto" else r.weight_sync
        return [VLLMConfig(work_dir=d, url=url, gpus=g, sync=sync, **common, **launch)
                for d, url, g in zip(dirs, urls, gpus)]
    assert engine == "sglang", engine  # TrainConfig.validate checked --rollout-engine
    from megatron_rl.rollout.sglang_engine import SGLangConfig

    launch = {"memory_saver": r.rollout_release_memory,
              "routed_experts": cfg.algorithm.routing_replay}
    if context_len is not None:
        launch["context_length"] = context_len
    if plan is not None:  # the share in SGLang's terms (ServerMemory.sglang_args)
        launch["mem_fraction_static"], launch["max_total_tokens"] = plan.sglang_args()
    elif len(urls) > 1 and not cuda:
        # on CPU each server would size its KV cache from all the free RAM it sees at boot
        launch["mem_fraction_static"] = 0.3 / len(urls)
    # auto: disk on CPU (measured the faster, benchmarks/RESULTS.md "Weight sync"); on GPUs
    # update_weights_from_tensor, SGLang's colocated path (not measured here)
    sync = r.weight_sync if r.weight_sync != "auto" else ("tensor" if cuda else "disk")
    return [SGLangConfig(work_dir=d, url=url, gpus=g, sync=sync, **common, **launch)
            for d, url, g in zip(dirs, urls, gpus)]


def context_limit(r, max_position_embeddings: int) -> tuple[int, str]:
    """(tokens one sequence, prompt and response, may take in a run with the rollout settings
    `r` (a RolloutConfig) serving a model of `max_position_embeddings` positions, what sets
    that limit as a user names it): the model's positions, or --rollout-max-context-len where
    it is set, is smaller and applies (servers started here; server_context_len refuses it
    larger than the model's positions)."""
    started_servers = ENGINES[r.rollout_engine].servers and not r.rollout_url
    if started_servers and 0 < r.rollout_max_context_len < max_position_embeddings:
        return r.rollout_max_context_len, f"--rollout-max-context-len {r.rollout_max_context_len}"
    return max_position_embeddings, f"the model's max_position_embeddings ({max_position_embeddings})"


def server_context_len(r, longest_prompt: int, max_position_embeddings: int,
                       episode_tokens: int = 0) -> int:
    """Tokens of one sequence (prompt and response) a server started for the rollout settings
    `r` (a RolloutConfig) takes: --rollout-max-context-len, or `longest_prompt` (the run's
    longest prompt in tokens) + --max-new-tokens, or `episode_tokens` (a multi-turn episode's
    limit, --agent-max-tokens) where larger. ValueError where a prompt or an episode would not
    fit or the model has fewer positions."""
    need = max(longest_prompt + r.max_new_tokens, episode_tokens)
    context_len = r.rollout_max_context_len or need
    if context_len < need:
        if episode_tokens > longest_prompt + r.max_new_tokens:
            raise ValueError(f"--rollout-max-context-len {context_len} is shorter than an "
                             f"episode of --agent-max-tokens {episode_tokens}: raise it, or "
                             "lower --agent-max-tokens")
        raise ValueError(f"--rollout-max-context-len {context_len} holds prompts of up to "
                         f"{context_len - r.max_new_tokens} tokens with --max-new-tokens "
                         f"{r.max_new_tokens}; the longest prompt of --train-data / --eval-data "
                         f"has {longest_prompt}: raise it, or shorten the prompts")
    if context_len > max_position_embeddings:
        if r.rollout_max_context_len:
            what = f"--rollout-max-context-len {context_len}"
        elif episode_tokens == need:
            what = f"--agent-max-tokens {episode_tokens}"
        else:
            what = (f"the longest prompt ({longest_prompt} tokens) + --max-new-tokens "
                    f"({r.max_new_tokens}) = {context_len}")
        raise ValueError(f"{what} exceeds the model's max_position_embeddings "
                         f"({max_position_embeddings})")
    return context_len


def server_memory_plan(cfg, args, context_len: int, gpu_bytes: int) -> ServerMemory:
    """The memory budget (rollout/memory.py) of one server started for `cfg` (a TrainConfig
    with --rollout-gpu-memory-utilization) serving the model `args` (models.ModelArgs) with
    `context_len` tokens per sequence on a GPU of `gpu_bytes`."""
    u = cfg.rollout.rollout_gpu_memory_utilization
    assert u is not None, "without --rollout-gpu-memory-utilization the server sizes itself"
    return model_server_memory(args, dtype_bytes=2 if cfg.model.bf16 else 4, gpu_bytes=gpu_bytes,
                               utilization=u, context_len=context_len)


def check_server_memory(plan: ServerMemory, r) -> None:
    """Refuse (ValueError) a budget whose KV cache cannot hold one full-length request even
    without the reserve (the server would refuse to start); warn where only the reserve's
    estimate makes it short; log it otherwise."""
    if plan.fits:
        log.info("rollout server memory: %s", plan.describe())
        return
    need = plan.context_len * plan.kv_bytes_per_token / GiB
    what = (f"--rollout-gpu-memory-utilization {r.rollout_gpu_memory_utilization}: one request "
            f"of {plan.context_len} tokens (--rollout-max-context-len) needs {need:.2f} GiB of "
            f"KV cache; {plan.describe()}")
    if not dataclasses.replace(plan, reserve_bytes=0).fits:
        raise ValueError(f"{what}. Raise the share, or lower --rollout-max-context-len / "
                         "--max-new-tokens")
    log.warning("%s: the server may not start (the reserve is an estimate)", what)


def _gpu_total_bytes(gpus: list[int]) -> int:
    """The total memory of the smallest of the CUDA devices `gpus`, which must exist here."""
    import torch

    count = torch.cuda.device_count()
    if max(gpus) >= count:
        raise ValueError(f"--rollout-gpus {' '.join(map(str, gpus))}: this node shows {count} "
                         "CUDA devices")
    return min(torch.cuda.get_device_properties(g).total_memory for g in gpus)
