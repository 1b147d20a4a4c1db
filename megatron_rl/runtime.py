"""Everything the training loop holds: models, engine, tokenizer, data, scorer, logs, resume.

`setup_runtime(cfg)` builds it (and resumes from the newest checkpoint under --load when there is
one); train.py only calls its methods.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl import checkpoint
from megatron_rl.config import TrainConfig, to_flat_dict
from megatron_rl.parallel import use_cuda
from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout.threads import BackgroundThreads


@dataclasses.dataclass
class Runtime:
    cfg: TrainConfig
    policy: Any
    reference: Any
    engine: Any
    tokenizer: Any
    train_data: Any
    eval_data: Any
    scorer: Any
    dp_rank: int
    dp_size: int
    pad_id: int
    stop_ids: tuple[int, ...]
    start_step: int = 0
    writer: Any = None
    _rollout_pool: Any = None

    @property
    def is_logger(self) -> bool:
        return not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1

    # -- text <-> tokens ----------------------------------------------------------------------
    def encode_prompt(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=not self.cfg.data.chat_template)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def overlaps_rollout(self) -> bool:
        return self.cfg.overlaps_rollout()

    def rollout_thread(self) -> BackgroundThreads:
        """Rank 0's background generation thread(s) (--async-level with a server engine): up to
        k requests in flight."""
        if self._rollout_pool is None:
            self._rollout_pool = BackgroundThreads(max(self.cfg.algorithm.async_level, 1))
        return self._rollout_pool

    def sampling_params(self, seed: int) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(temperature=r.temperature, top_p=r.top_p,
                              max_new_tokens=r.max_new_tokens, stop_token_ids=self.stop_ids,
                              seed=seed)

    # -- metrics ------------------------------------------------------------------------------
    def log(self, step: int, metrics: dict) -> None:
        """TensorBoard scalars + one JSON line per step (<save>/metrics.jsonl), last rank only
        (the last pipeline stage, which holds the loss metrics)."""
        if not self.is_logger:
            return
        clean = {k: float(v) for k, v in metrics.items() if _is_number(v)}
        if self.writer is not None:
            for k, v in clean.items():
                self.writer.add_scalar(k, v, step)
            self.writer.flush()
        with open(os.path.join(self.cfg.checkpoint.save, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, **clean}) + "\n")
        if hasattr(self, "_bar") and self._bar is not None:
            self._bar.set_postfix({k.split("/")[-1]: f"{clean[k]:.3g}" for k in
                                   ("reward/mean", "kl_k1", "eval/mean_at_k") if k in clean})

    def progress(self, it):
        from tqdm import tqdm

        self._bar = tqdm(it, desc="RL", initial=self.start_step, total=self.cfg.train_iters,
                         disable=not self.is_logger, dynamic_ncols=True)
        return self._bar

    # -- reference and checkpoints ------------------------------------------------------------
    def reset_reference(self) -> None:
        _copy_weights(self.policy, self.reference)

    def save(self, step: int, data_state: dict | None = None) -> None:
        extra = {"rng": checkpoint.rng_state(),
                 "data": data_state or self.train_data.state_dict(),
                 "engine_version": self.engine.weight_version}
        checkpoint.save_checkpoint(self.cfg.checkpoint.save, step, self.policy, extra,
                                   hf_config=self.policy.args.to_hf_config())
        _save_reference(self, step)

    def close(self, abort: bool = False) -> None:
        """Stop the background generation and the engine. At the end of training the generation
        in flight finishes first; on an error (`abort`) nothing waits for it: the engine stops
        (a managed server is killed, so its request fails at once) and the request's daemon
        thread ends with the process, even when an attached server never answers."""
        if self._rollout_pool is not None:
            self._rollout_pool.shutdown(wait=not abort, cancel_futures=abort)
        self.engine.shutdown()
        self.scorer.close()
        if self.writer is not None:
            self.writer.close()


def _save_reference(rt: Runtime, step: int) -> None:
    """The reference differs from the initial weights only after a reset: save it then."""
    if rt.cfg.algorithm.ref_reset_interval:
        checkpoint.save_checkpoint(os.path.join(rt.cfg.checkpoint.save, "reference"), step,
                                   rt.reference,
                                   with_optimizer=False)


def _is_number(v) -> bool:
    if isinstance(v, torch.Tensor):
        return v.numel() == 1
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _copy_weights(src, dst) -> None:
    """dst's parameters := src's (same model, same layout)."""
    with torch.no_grad():
        for p_dst, p_src in zip(dst.module.parameters(), src.module.parameters()):
            p_dst.copy_(p_src)


def _make_engine(cfg: TrainConfig, policy, pad_id: int):
    engine = cfg.rollout.rollout_engine
    if engine == "local":
        from megatron_rl.rollout.local import LocalEngine

        return LocalEngine(policy, pad_token_id=pad_id)
    r = cfg.rollout
    dtype = "bfloat16" if cfg.model.bf16 else "float32"
    if engine == "process":
        from megatron_rl.rollout.process import ProcessConfig, ProcessEngine

        return ProcessEngine(ProcessConfig(
            hf_checkpoint=cfg.model.hf_checkpoint, work_dir=os.path.join(cfg.checkpoint.save,
                                                                         engine),
            dtype=dtype, seed=cfg.seed, pad_token_id=pad_id, cores=tuple(r.rollout_process_cores),
            sync="tensor" if r.weight_sync == "auto" else r.weight_sync,
            bucket_bytes=r.weight_sync_bucket_mb << 20, deterministic=cfg.deterministic_mode),
            policy=policy)
    # servers start from the initial HF weights and are synced after every step
    work_dir = os.path.join(cfg.checkpoint.save, engine)
    max_len = policy.args.max_position_embeddings  # servers refuse a longer context
    hf = cfg.model.hf_checkpoint
    mem = r.rollout_gpu_memory_utilization if use_cuda() else None
    # several servers (--rollout-url a b ..., or --rollout-num-servers N): one ServerPool over
    # one engine per server, each in <work_dir>/server<i>; one server: the engine itself
    urls = list(r.rollout_url) or [None] * r.rollout_num_servers
    dirs = [work_dir] if len(urls) == 1 else [os.path.join(work_dir, f"server{i}")
                                               for i in range(len(urls))]
    if engine == "vllm":
        from megatron_rl.rollout.vllm_engine import VLLMConfig, VLLMEngine

        # on CPU vLLM reserves most of the RAM for its KV cache unless told otherwise
        kv_bytes = None if use_cuda() else 2 << 30
        engines = [VLLMEngine(hf, VLLMConfig(work_dir=d, url=url, dtype=dtype, seed=cfg.seed,
                                             kv_cache_memory_bytes=kv_bytes,
                                             max_model_len=max_len, gpu_memory_utilization=mem,
                                             host=r.rollout_host,
                                             sync=_vllm_sync(r.weight_sync),
                                             sleep_mode=r.rollout_release_memory,
                                             bucket_bytes=r.weight_sync_bucket_mb << 20),
                              policy=policy, start=False) for d, url in zip(dirs, urls)]
    else:
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
                                                 nccl_bucket_bytes=r.weight_sync_bucket_mb << 20),
                                policy=policy, start=False) for d, url in zip(dirs, urls)]
    if len(engines) == 1:
        engines[0].start()
        return engines[0]
    from megatron_rl.rollout.multi import ServerPool

    # boots the managed servers at once; on GPUs a lost managed server is not booted again
    # during the run (it would take its memory share from the training phase)
    return ServerPool(engines, policy=policy, reboot_managed=not use_cuda())


def _vllm_sync(mode: str) -> str:
    """--weight-sync for a vLLM server: auto = disk, the faster of the two on the CPU machines
    measured (benchmarks/RESULTS.md, "Weight sync"; tensor needs a server on this host)."""
    return "disk" if mode == "auto" else mode


def checkpoints_to_load(cfg: TrainConfig) -> tuple[str | None, str | None]:
    """(run checkpoint to resume exactly, weights-only checkpoint to start from); either None.

    The newest checkpoint under --save resumes the run. Else --load: a run's checkpoint
    resumes (optimizer, RNG, data position, step), a weights-only one (tools/convert_checkpoint.py,
    or any with --finetune) gives the initial weights at step 0. A run resumed under --save that
    started from weights-only --load keeps that checkpoint as its reference.
    """
    from megatron_rl.convert import resolve_checkpoint

    ck = cfg.checkpoint
    given = (resolve_checkpoint(ck.load)
             if ck.load and os.path.abspath(ck.load) != ck.save else None)
    weights_only = given is not None and (ck.finetune or not checkpoint.is_run_checkpoint(given))
    own = checkpoint.latest_checkpoint(ck.save)
    if own is not None:
        return own, given if weights_only else None
    if given is not None and not weights_only:
        return given, None
    return None, given


def _load_weights(cfg: TrainConfig, rt: Runtime, resume: str | None, weights: str | None) -> None:
    """Policy and reference weights, each source read once: the reference copies the policy's
    initial weights instead of reading them again. The reference is --ref-checkpoint, else the
    weights-only checkpoint, else --hf-checkpoint (the initial weights of the run)."""
    policy, reference, hf = rt.policy, rt.reference, cfg.model.hf_checkpoint
    if resume is not None:
        extra = checkpoint.load_checkpoint(resume, policy)
        rt.start_step = int(extra["step"])
        checkpoint.set_rng_state(extra["rng"])
        rt.train_data.load_state_dict(extra["data"])
    elif weights is not None:
        checkpoint.load_checkpoint(weights, policy, with_optimizer=False)
    else:
        policy.load_hf(hf)
    if cfg.model.ref_checkpoint:
        reference.load_hf(cfg.model.ref_checkpoint)
    elif resume is None:
        _copy_weights(policy, reference)
    elif weights is not None:
        checkpoint.load_checkpoint(weights, reference, with_optimizer=False)
    else:
        reference.load_hf(hf)
    if resume is not None and cfg.algorithm.ref_reset_interval:
        ref_ckpt = checkpoint.latest_checkpoint(os.path.join(os.path.dirname(resume), "reference"))
        if ref_ckpt is not None:
            checkpoint.load_checkpoint(ref_ckpt, reference, with_optimizer=False)


def setup_runtime(cfg: TrainConfig) -> Runtime:
    from megatron.core import parallel_state as ps

    from megatron_rl.data.prompts import PromptBuilder, PromptDataset, load_tokenizer
    from megatron_rl.models import ModelArgs
    from megatron_rl.models.policy import Policy
    from megatron_rl.parallel import init_distributed
    from megatron_rl.rewards import RewardScorer

    algo, save = cfg.algorithm, cfg.checkpoint.save
    dp = init_distributed(cfg.parallel, seed=cfg.seed, deterministic=cfg.deterministic_mode)
    if algo.num_prompts_per_step % (dp * algo.ppo_minibatches):
        raise ValueError(f"--num-prompts-per-step {algo.num_prompts_per_step} must be divisible by "
                         f"data-parallel size {dp} x --ppo-minibatches {algo.ppo_minibatches}")
    per_minibatch = algo.num_prompts_per_step // (dp * algo.ppo_minibatches) * algo.group_size
    if (per_minibatch % algo.micro_batch_size and cfg.parallel.pipeline_model_parallel_size > 1
            and not algo.sequence_packing):
        raise ValueError(f"--micro-batch-size {algo.micro_batch_size} must divide the "
                         f"{per_minibatch} sequences of a minibatch per data-parallel rank under "
                         "pipeline parallelism (all microbatches need one shape)")
    os.makedirs(save, exist_ok=True)
    dtype = torch.bfloat16 if cfg.model.bf16 else torch.float32
    args = ModelArgs.from_pretrained(cfg.model.hf_checkpoint)
    policy = Policy(args, trainable=True, params_dtype=dtype, optim=cfg.optimizer,
                    parallel=cfg.parallel, options=cfg.model.options)
    reference = Policy(args, trainable=False, params_dtype=dtype, parallel=cfg.parallel,
                       options=cfg.model.options)
    tokenizer = load_tokenizer(cfg.model.hf_checkpoint)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos = tokenizer.eos_token_id
    stop_ids = tuple(sorted({eos} if isinstance(eos, int) else set(eos or [])))
    d = cfg.data
    builder = PromptBuilder(tokenizer=tokenizer if d.chat_template else None,
                            template=d.prompt_template, use_chat_template=d.chat_template,
                            task_instruction=d.task_instruction)
    train_data = PromptDataset.from_jsonl(d.train_data, builder, seed=cfg.seed)
    eval_data = (PromptDataset.from_jsonl(d.eval_data, builder, shuffle=False)
                 if d.eval_data else None)
    rt = Runtime(cfg=cfg, policy=policy, reference=reference, engine=None, tokenizer=tokenizer,
                 train_data=train_data, eval_data=eval_data, scorer=RewardScorer(num_workers=2),
                 dp_rank=ps.get_data_parallel_rank(), dp_size=dp, pad_id=pad_id,
                 stop_ids=stop_ids)
    resume, weights = checkpoints_to_load(cfg)
    _load_weights(cfg, rt, resume, weights)
    rt.engine = _make_engine(cfg, policy, pad_id)
    if resume is not None or weights is not None or cfg.rollout.rollout_engine == "local":
        rt.engine.update_weights(rt.start_step)  # a server must serve the loaded weights
    if rt.is_logger:
        from torch.utils.tensorboard import SummaryWriter

        rt.writer = SummaryWriter(os.path.join(save, "tensorboard"))
        with open(os.path.join(save, "config.json"), "w") as f:  # usable as --config
            json.dump(to_flat_dict(cfg), f, indent=2)
        if resume is not None:
            _truncate_metrics(os.path.join(save, "metrics.jsonl"), rt.start_step)
    return rt


def _truncate_metrics(path: str, step: int) -> None:
    """After a resume, drop logged steps beyond the checkpoint (they will be redone)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        rows = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(rows)
    os.replace(tmp, path)
