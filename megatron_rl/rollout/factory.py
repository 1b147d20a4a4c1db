"""Which rollout engines exist, what each can do, and building the one a run asks for.

`ENGINES` is the one table of engine facts the rest of the package may consult (configuration
checks, the training loop's defaults); `build_engine` turns a TrainConfig into a RolloutEngine
(rollout/base.py). Nothing outside rollout/ branches on an engine's name.
"""

from __future__ import annotations

import dataclasses
import os


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
    """

    name: str
    holds_own_weights: bool
    weight_syncs: tuple[str, ...]
    servers: bool
    release_memory: bool
    trainer_numerics: bool
    routed_experts: bool
    routed_experts_pipelined: bool


ENGINES: dict[str, EngineSpec] = {s.name: s for s in (
    EngineSpec("local", holds_own_weights=False, weight_syncs=("auto",), servers=False,
               release_memory=False, trainer_numerics=True, routed_experts=True,
               routed_experts_pipelined=False),
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


def build_engine(cfg, policy, pad_id: int):
    """The RolloutEngine for `cfg` (a TrainConfig) around the trainer's `policy`. Server engines
    start from the initial HF weights (--hf-checkpoint): the caller syncs them when the run
    starts from other weights. Collective when distributed (server URLs are broadcast)."""
    from megatron_rl.parallel import use_cuda

    r, engine = cfg.rollout, cfg.rollout.rollout_engine
    if engine == "local":
        from megatron_rl.rollout.local import LocalEngine

        return LocalEngine(policy, pad_token_id=pad_id)
    dtype = "bfloat16" if cfg.model.bf16 else "float32"
    work_dir = os.path.join(cfg.checkpoint.save, engine)
    if engine == "process":
        from megatron_rl.rollout.process import ProcessConfig, ProcessEngine

        return ProcessEngine(ProcessConfig(
            hf_checkpoint=cfg.model.hf_checkpoint, work_dir=work_dir,
            dtype=dtype, seed=cfg.seed, pad_token_id=pad_id, cores=tuple(r.rollout_process_cores),
            gpu=r.rollout_process_gpu,
            sync="tensor" if r.weight_sync == "auto" else r.weight_sync,
            bucket_bytes=r.weight_sync_bucket_mb << 20, deterministic=cfg.deterministic_mode),
            policy=policy)
    max_len = policy.args.max_position_embeddings  # servers refuse a longer context
    hf = cfg.model.hf_checkpoint
    mem = r.rollout_gpu_memory_utilization if use_cuda() else None
    # several servers (--rollout-url a b ..., or --rollout-num-servers N): one ServerPool over
    # one engine per server, each in <work_dir>/server<i>; one server: the engine itself
    urls = list(r.rollout_url) or [None] * r.rollout_num_servers
    dirs = [work_dir] if len(urls) == 1 else [os.path.join(work_dir, f"server{i}")
                                               for i in range(len(urls))]
    engines: list
    if engine == "vllm":
        from megatron_rl.rollout.vllm_engine import VLLMConfig, VLLMEngine

        # on CPU vLLM reserves most of the RAM for its KV cache unless told otherwise
        kv_bytes = None if use_cuda() else 2 << 30
        # auto = disk, the faster of the two on the CPU machines measured (benchmarks/RESULTS.md,
        # "Weight sync"; tensor needs a server on this host)
        sync = "disk" if r.weight_sync == "auto" else r.weight_sync
        engines = [VLLMEngine(hf, VLLMConfig(work_dir=d, url=url, dtype=dtype, seed=cfg.seed,
                                             kv_cache_memory_bytes=kv_bytes,
                                             max_model_len=max_len, gpu_memory_utilization=mem,
                                             host=r.rollout_host, sync=sync,
                                             sleep_mode=r.rollout_release_memory,
                                             bucket_bytes=r.weight_sync_bucket_mb << 20),
                              policy=policy, start=False) for d, url in zip(dirs, urls)]
    elif engine == "sglang":
        from megatron_rl.rollout.sglang_engine import SGLangConfig, SGLangEngine

        # auto: disk on CPU (measured the faster, benchmarks/RESULTS.md "Weight sync"); on GPUs
        # update_weights_from_tensor, SGLang's colocated path (not measured here)
        sync = r.weight_sync if r.weight_sync != "auto" else ("tensor" if use_cuda() else "disk")
        if mem is None and len(urls) > 1 and not use_cuda():
            # on CPU each server would size its KV cache from all the free RAM it sees at boot
            mem = 0.3 / len(urls)
        engines = [SGLangEngine(hf, SGLangConfig(work_dir=d, url=url, dtype=dtype, seed=cfg.seed,
                                                 context_length=max_len, mem_fraction_static=mem,
                                                 host=r.rollout_host, sync=sync,
                                                 memory_saver=r.rollout_release_memory,
                                                 routed_experts=cfg.algorithm.routing_replay,
                                                 bucket_bytes=r.weight_sync_bucket_mb << 20),
                                policy=policy, start=False) for d, url in zip(dirs, urls)]
    else:
        raise ValueError(f"--rollout-engine {engine!r}; valid: " + ", ".join(ENGINES))
    if len(engines) == 1:
        engines[0].start()
        return engines[0]
    from megatron_rl.rollout.multi import ServerPool

    # boots the managed servers at once; on GPUs a lost managed server is not booted again
    # during the run (it would take its memory share from the training phase)
    return ServerPool(engines, policy=policy, reboot_managed=not use_cuda())
