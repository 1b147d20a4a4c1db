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
from megatron_rl.config import TrainConfig
from megatron_rl.loss import LossConfig
from megatron_rl.parallel import use_cuda


@dataclasses.dataclass
class Runtime:
    cfg: TrainConfig
    loss_cfg: LossConfig
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

    @property
    def is_logger(self) -> bool:
        return not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1

    # -- text <-> tokens ----------------------------------------------------------------------
    def encode_prompt(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=not self.cfg.chat_template)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # -- metrics ------------------------------------------------------------------------------
    def batch_metrics(self, batch) -> dict:
        r = batch.rewards
        lengths = torch.tensor(batch.response_lengths, dtype=torch.float32)
        mean, acc = torch.stack([r.mean(), (r >= 1.0).float().mean()]).tolist()
        return {"reward/mean": mean, "reward/accuracy": acc,
                "response/length_mean": float(lengths.mean()),
                "response/truncated_fraction": sum(f == "length" for f in batch.finish_reasons)
                / len(batch.finish_reasons)}

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
        with open(os.path.join(self.cfg.save, "metrics.jsonl"), "a") as f:
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
        with torch.no_grad():
            for p_ref, p in zip(self.reference.module.parameters(), self.policy.module.parameters()):
                p_ref.copy_(p)

    def save(self, step: int, data_state: dict | None = None) -> None:
        extra = {"rng": checkpoint.rng_state(),
                 "data": data_state or self.train_data.state_dict(),
                 "engine_version": self.engine.weight_version}
        checkpoint.save_checkpoint(self.cfg.save, step, self.policy, extra,
                                   hf_config=self.policy.args.to_hf_config())
        _save_reference(self, step)

    def close(self) -> None:
        self.engine.shutdown()
        self.scorer.close()
        if self.writer is not None:
            self.writer.close()


def _save_reference(rt: Runtime, step: int) -> None:
    """The reference differs from the initial weights only after a reset: save it then."""
    if rt.cfg.ref_reset_interval:
        checkpoint.save_checkpoint(os.path.join(rt.cfg.save, "reference"), step, rt.reference,
                                   with_optimizer=False)


def _is_number(v) -> bool:
    if isinstance(v, torch.Tensor):
        return v.numel() == 1
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _make_engine(cfg: TrainConfig, policy, pad_id: int):
    if cfg.rollout_engine == "local":
        from megatron_rl.rollout.local import LocalEngine

        return LocalEngine(policy, pad_token_id=pad_id)
    # servers start from the initial HF weights and are synced after every step
    work_dir = os.path.join(cfg.save, cfg.rollout_engine)
    dtype = "bfloat16" if cfg.bf16 else "float32"
    max_len = policy.args.max_position_embeddings  # servers refuse a longer context
    if cfg.rollout_engine == "vllm":
        from megatron_rl.rollout.vllm_engine import VLLMConfig, VLLMEngine

        # on CPU vLLM reserves most of the RAM for its KV cache unless told otherwise
        kv_bytes = None if use_cuda() else 2 << 30
        return VLLMEngine(cfg.hf_checkpoint, VLLMConfig(work_dir=work_dir, url=cfg.rollout_url,
                                                        dtype=dtype, seed=cfg.seed,
                                                        kv_cache_memory_bytes=kv_bytes,
                                                        max_model_len=max_len),
                          policy=policy)
    from megatron_rl.rollout.sglang_engine import SGLangConfig, SGLangEngine

    return SGLangEngine(cfg.hf_checkpoint, SGLangConfig(work_dir=work_dir, url=cfg.rollout_url,
                                                        dtype=dtype, seed=cfg.seed,
                                                        context_length=max_len), policy=policy)


def setup_runtime(cfg: TrainConfig) -> Runtime:
    from megatron.core import parallel_state as ps

    from megatron_rl.data.prompts import PromptBuilder, PromptDataset, load_tokenizer
    from megatron_rl.models import ModelArgs
    from megatron_rl.models.policy import OptimConfig, Policy
    from megatron_rl.parallel import ParallelConfig, init_distributed
    from megatron_rl.rewards import RewardScorer

    dp = init_distributed(ParallelConfig(cfg.tensor_model_parallel_size,
                                         cfg.pipeline_model_parallel_size), seed=cfg.seed)
    if cfg.num_prompts_per_step % (dp * cfg.ppo_minibatches):
        raise ValueError(f"--num-prompts-per-step {cfg.num_prompts_per_step} must be divisible by "
                         f"data-parallel size {dp} x --ppo-minibatches {cfg.ppo_minibatches}")
    per_minibatch = cfg.num_prompts_per_step // (dp * cfg.ppo_minibatches) * cfg.group_size
    if per_minibatch % cfg.micro_batch_size and cfg.pipeline_model_parallel_size > 1:
        raise ValueError(f"--micro-batch-size {cfg.micro_batch_size} must divide the {per_minibatch} "
                         "sequences of a minibatch per data-parallel rank under pipeline "
                         "parallelism (all microbatches need one shape)")
    os.makedirs(cfg.save, exist_ok=True)
    dtype = torch.bfloat16 if cfg.bf16 else torch.float32
    args = ModelArgs.from_pretrained(cfg.hf_checkpoint)
    policy = Policy(args, trainable=True, params_dtype=dtype,
                    optim=OptimConfig(lr=cfg.lr, weight_decay=cfg.weight_decay,
                                      clip_grad=cfg.clip_grad, adam_beta2=cfg.adam_beta2))
    reference = Policy(args, trainable=False, params_dtype=dtype)
    policy.load_hf(cfg.hf_checkpoint)
    reference.load_hf(cfg.ref_checkpoint or cfg.hf_checkpoint)
    tokenizer = load_tokenizer(cfg.hf_checkpoint)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos = tokenizer.eos_token_id
    stop_ids = tuple(sorted({eos} if isinstance(eos, int) else set(eos or [])))
    builder = PromptBuilder(tokenizer=tokenizer if cfg.chat_template else None,
                            template=cfg.prompt_template, use_chat_template=cfg.chat_template,
                            task_instruction=cfg.task_instruction)
    train_data = PromptDataset.from_jsonl(cfg.train_data, builder, seed=cfg.seed)
    eval_data = (PromptDataset.from_jsonl(cfg.eval_data, builder, shuffle=False)
                 if cfg.eval_data else None)
    rt = Runtime(cfg=cfg, loss_cfg=cfg.loss_config(), policy=policy, reference=reference,
                 engine=None, tokenizer=tokenizer, train_data=train_data, eval_data=eval_data,
                 scorer=RewardScorer(num_workers=2), dp_rank=ps.get_data_parallel_rank(),
                 dp_size=dp, pad_id=pad_id, stop_ids=stop_ids)
    ckpt = checkpoint.latest_checkpoint(cfg.load) if cfg.load else None
    if ckpt is not None:
        extra = checkpoint.load_checkpoint(ckpt, policy)
        rt.start_step = int(extra["step"])
        checkpoint.set_rng_state(extra["rng"])
        train_data.load_state_dict(extra["data"])
        if cfg.ref_reset_interval:
            ref_ckpt = checkpoint.latest_checkpoint(os.path.join(cfg.load, "reference"))
            if ref_ckpt is not None:
                checkpoint.load_checkpoint(ref_ckpt, reference, with_optimizer=False)
    rt.engine = _make_engine(cfg, policy, pad_id)
    if ckpt is not None or cfg.rollout_engine == "local":
        rt.engine.update_weights(rt.start_step)  # a resumed server must serve the resumed weights
    if rt.is_logger:
        from torch.utils.tensorboard import SummaryWriter

        rt.writer = SummaryWriter(os.path.join(cfg.save, "tensorboard"))
        with open(os.path.join(cfg.save, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(cfg), f, indent=2)
        if ckpt is not None:
            _truncate_metrics(os.path.join(cfg.save, "metrics.jsonl"), rt.start_step)
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
