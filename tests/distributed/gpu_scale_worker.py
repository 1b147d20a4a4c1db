"""Worker for tests/distributed/test_gpu_scale_flags.py, launched under torchrun (gloo on CPU).

    torchrun --nproc-per-node 2 tests/distributed/gpu_scale_worker.py distopt --hf DIR --out DIR
    torchrun --nproc-per-node 2 tests/distributed/gpu_scale_worker.py sp --hf DIR --out DIR

distopt: DP2, the same weights and batches trained for 3 steps (a warm-up + cosine LR schedule)
  with megatron's distributed optimizer and with the plain one (fp32 and bf16); rank 0 writes
  both full state dicts, grad norms, main-parameter dtypes, the distributed optimizer's state
  sizes, and (fp32, both optimizers) a save / load / two steps against the same two steps
  without the save.
sp: TP1 (all DP), TP2, TP2 + sequence parallelism and TP2 x PP2 + sequence parallelism (4
  ranks), as --layouts picks, on one batch (sequence length not a multiple of TP, so the padding
  is exercised): logits, loss, full gradients, parameters after one step, token log-probs and
  local-engine samples (KV decoder where PP is 1, and megatron's forward) per layout.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch


def _batch(vocab: int, n: int, seq: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n, seq), generator=g)
    mask = (torch.rand(n, seq - 1, generator=g) < 0.8).float()
    mask[:, 0] = 1.0
    return tokens, mask


def _nll_loss_fn(policy, global_tokens: float, keep_logits: bool = False):
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_rl.batch import next_token_targets
    from megatron_rl.ops import vocab_parallel_logprobs

    def loss_fn(batch, logits):
        targets = next_token_targets(batch["tokens"]).to(logits.device)
        logp = vocab_parallel_logprobs(logits, targets, tp_group=policy.tp_group,
                                       vocab_start=policy.vocab_start)[:, :-1]
        loss = -(logp * batch["mask"].to(logp.device)).sum() / global_tokens
        metrics = {"loss": loss.detach().clone()}
        if keep_logits:
            metrics["logits"] = gather_from_tensor_model_parallel_region(logits.detach()).cpu()
            metrics["index"] = batch["index"]
        return loss, metrics

    return loss_fn


def _snapshot(policy, what: str = "params"):
    """The full state dict (or gradients), copied: on CPU at TP1, full_state_dict and
    full_grads can hand back the live tensors of replicated parameters."""
    full = policy.full_state_dict(dst=0) if what == "params" else policy.full_grads(dst=0)
    return None if full is None else {k: v.clone() for k, v in full.items()}


def _shares(tokens, mask, micro: int):
    """This DP rank's microbatches of the global batch."""
    from megatron.core import parallel_state as ps

    dp, r = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per = tokens.shape[0] // dp
    idx = list(range(r * per, (r + 1) * per))
    return [{"tokens": tokens[idx[i:i + micro]], "mask": mask[idx[i:i + micro]],
             "index": idx[i:i + micro]} for i in range(0, per, micro)]


def run_distopt(hf: str, out: str) -> None:
    import torch.distributed as dist

    from megatron_rl.checkpoint import load_checkpoint, save_checkpoint
    from megatron_rl.models import ModelArgs
    from megatron_rl.models.optim import OptimConfig
    from megatron_rl.models.policy import Policy
    from megatron_rl.parallel import ParallelConfig, init_distributed

    init_distributed(ParallelConfig())
    args = ModelArgs.from_pretrained(hf)
    # no clipping: the two optimizers sum the squared gradients in different orders (per
    # shard, then over DP), so their norms differ in the 7th digit, and Adam magnifies such a
    # difference on gradients that are pure rounding noise (the key bias: softmax ignores it)
    optim = OptimConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.0, lr_warmup_iters=1,
                        lr_decay_style="cosine", lr_decay_iters=8)
    result = {}
    for dtype in (torch.float32, torch.bfloat16):
        for distributed in (False, True):
            policy = Policy(args, trainable=True, optim=optim, params_dtype=dtype,
                            parallel=ParallelConfig(use_distributed_optimizer=distributed))
            policy.load_hf(hf)
            norms = []
            for step in range(3):  # step 0 runs at lr 0 (warm-up from --lr-warmup-init 0)
                tokens, mask = _batch(args.vocab_size, 4, 12, seed=step)
                policy.forward_backward(_shares(tokens, mask, 1),
                                        _nll_loss_fn(policy, float(mask.sum())))
                ok, norm = policy.step()
                assert ok
                norms.append(norm)
            key = (str(dtype).split(".")[-1], distributed)
            opt = policy.optimizer.chained_optimizers[0]
            result[key] = {"params": _snapshot(policy), "lr": policy.lr,
                           "type": type(opt).__name__, "grad_norms": norms,
                           "main_dtypes": sorted({str(p.dtype) for g in opt.optimizer.param_groups
                                                  for p in g["params"]}),
                           "main_grad_dtypes": sorted({str(p.main_grad.dtype)
                                                       for p in policy.parameters()})}
            if distributed:  # each DP rank holds about half of the Adam state
                local = sum(p.numel() for g in opt.optimizer.param_groups for p in g["params"])
                total = torch.tensor([local])
                dist.all_reduce(total)
                result[key]["state_numel"] = (local, int(total))
                result[key]["model_numel"] = sum(p.numel() for p in policy.parameters())
            if dtype == torch.float32:  # save, reload into a fresh policy, two more steps
                root = os.path.join(out, f"ckpt_{int(distributed)}")
                save_checkpoint(root, 3, policy)
                fresh = Policy(args, trainable=True, optim=optim, params_dtype=dtype,
                               parallel=ParallelConfig(use_distributed_optimizer=distributed))
                load_checkpoint(os.path.join(root, "iter_0000003"), fresh)
                lrs = [(policy.lr, fresh.lr)]
                for seed in (9, 10):  # two steps: Adam's step count matters from here
                    tokens, mask = _batch(args.vocab_size, 4, 12, seed=seed)
                    for p in (policy, fresh):
                        p.forward_backward(_shares(tokens, mask, 1),
                                           _nll_loss_fn(p, float(mask.sum())))
                        p.step()
                    lrs.append((policy.lr, fresh.lr))
                result[("resume", distributed)] = {
                    "continued": _snapshot(policy), "resumed": _snapshot(fresh), "lr": lrs,
                    "num_steps": (policy.scheduler.num_steps, fresh.scheduler.num_steps)}
    if dist.get_rank() == 0:
        torch.save(result, os.path.join(out, "distopt.pt"))


def run_sp(hf: str, out: str, layout_names=("tp1", "tp2", "tp2_sp")) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_rl.models import ModelArgs
    from megatron_rl.models.optim import OptimConfig
    from megatron_rl.models.policy import Policy
    from megatron_rl.parallel import ParallelConfig, init_distributed
    from megatron_rl.rollout.base import SamplingParams
    from megatron_rl.rollout.local import LocalEngine

    args = ModelArgs.from_pretrained(hf)
    tokens, mask = _batch(args.vocab_size, 4, 15)  # 15: not a multiple of TP 2
    result = {}
    layouts = {"tp1": ParallelConfig(), "tp2": ParallelConfig(2),
               "tp2_sp": ParallelConfig(2, sequence_parallel=True),
               "tp2_pp2_sp": ParallelConfig(2, 2, sequence_parallel=True)}  # 4 ranks
    for name in layout_names:
        cfg = layouts[name]
        init_distributed(cfg)
        policy = Policy(args, trainable=True, optim=OptimConfig(lr=1e-5), parallel=cfg)
        policy.load_hf(hf)
        assert policy.config.sequence_parallel == cfg.sequence_parallel
        outs = policy.forward_backward(_shares(tokens, mask, 1),
                                       _nll_loss_fn(policy, float(mask.sum()), keep_logits=True))
        logits = {i: o["logits"][j] for o in outs for j, i in enumerate(o["index"])}
        loss = torch.tensor([sum(float(o["loss"]) for o in outs)], dtype=torch.float64)
        dist.all_reduce(loss)  # DP shares add up; first PP stages hold 0; TP ranks repeat it
        loss /= policy.tp_size
        grads = _snapshot(policy, "grads")
        logits_all = [None] * dist.get_world_size()
        dist.all_gather_object(logits_all, logits)
        policy.step()
        params = _snapshot(policy)
        logprobs = policy.token_logprobs(tokens, 2).cpu()
        prompts = [tokens[i, : 3 + 2 * i].tolist() for i in range(tokens.shape[0])]
        samples = {}
        for kv in ((True, False) if cfg.pipeline_model_parallel_size == 1 else (False,)):
            # the KV decoder (outside the SP region) and megatron's forward
            engine = LocalEngine(policy, kv_cache=kv)
            groups = engine.generate(prompts, 2, SamplingParams(max_new_tokens=5, seed=3))
            samples[kv] = [[(c.token_ids, c.rollout_logprobs) for c in g] for g in groups]
        if dist.get_rank() == 0:
            merged = {k: v for d in logits_all for k, v in d.items()}
            result[name] = {"logits": merged, "loss": float(loss), "grads": grads,
                            "params": params, "logprobs": logprobs, "samples": samples}
        ps.destroy_model_parallel()
    if dist.get_rank() == 0:
        torch.save(result, os.path.join(out, "sp.pt"))


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["distopt", "sp"])
    p.add_argument("--hf", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--layouts", default="tp1,tp2,tp2_sp", help="sp mode: comma list")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    os.makedirs(a.out, exist_ok=True)
    if a.mode == "distopt":
        run_distopt(a.hf, a.out)
    else:
        run_sp(a.hf, a.out, a.layouts.split(","))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main()
    from megatron_rl.processes import skip_exit_collection

    skip_exit_collection()  # the heap is the imports': no shutdown collection over it
