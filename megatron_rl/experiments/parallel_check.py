"""Parallel-equivalence check: the same weights and batch under several TP x PP layouts.

Run under torchrun (any world size divisible by each layout's TP*PP; the rest is data
parallelism). For each layout it loads one HF checkpoint into a trainable `Policy`, runs one
forward/backward of a token log-likelihood loss through megatron-core's pipeline schedule with
the global batch split over DP ranks and microbatches, and writes, per layout:
  <out>/<TPxPP>/logits_rank<r>.pt  {sample index: full-vocab logits [s, V]} (last stage, TP rank 0)
  <out>/<TPxPP>/grads.pt           the full gradient state dict, megatron names (global rank 0)
  <out>/<TPxPP>/loss_rank<r>.pt    this rank's summed microbatch losses
`tools/parallel_demo.py` and tests/distributed compare these against transformers.

    torchrun --nproc-per-node 4 -m megatron_rl.experiments.parallel_check --hf DIR --out DIR
    torchrun --nproc-per-node 4 -m megatron_rl.experiments.parallel_check --load MEGATRON_CKPT --out DIR
"""

from __future__ import annotations

import argparse
import os

import torch


def make_batch(vocab_size: int, global_batch: int, seq_len: int, seed: int = 0):
    """A fixed token batch and loss mask (same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (global_batch, seq_len), generator=g)
    mask = (torch.rand(global_batch, seq_len - 1, generator=g) < 0.8).float()
    mask[:, 0] = 1.0
    return tokens, mask


def transformers_reference(hf_path: str, global_batch: int, seq_len: int):
    """transformers' logits [B, s, V] on make_batch's tokens, and the gradient (megatron names)
    of the same masked token log-likelihood loss that run_layout uses."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.models import ModelArgs, hf_mapping

    args = ModelArgs.from_pretrained(hf_path)
    model = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32)
    tokens, mask = make_batch(args.vocab_size, global_batch, seq_len)
    logits = model(tokens).logits
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]
    (-(logp * mask).sum() / mask.sum()).backward()
    grads = hf_mapping.hf_to_megatron({k: p.grad for k, p in model.named_parameters()}, args)
    return logits.detach(), grads


def load_layout_outputs(out_dir: str, layout: str):
    """(logits {sample: [s, V]}, full grads) written by run_layout for `layout` ("TPxPP")."""
    import glob

    logits = {}
    for f in glob.glob(os.path.join(out_dir, layout, "logits_rank*.pt")):
        logits.update(torch.load(f))
    return logits, torch.load(os.path.join(out_dir, layout, "grads.pt"))


def run_layout(hf_path: str | None, tp: int, pp: int, out_dir: str, global_batch: int,
               seq_len: int, micro_batch: int, load: str | None = None,
               rl_configs: list[str] = (), generate: bool = False, packed: bool = False) -> None:
    """One layout. Weights come from a HF directory (`hf_path`) or a Megatron checkpoint
    (`load`, saved in any layout: this exercises dist_checkpointing resharding)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_rl.batch import next_token_targets
    from megatron_rl.models import ModelArgs
    from megatron_rl.models.optim import OptimConfig
    from megatron_rl.models.policy import Policy
    from megatron_rl.ops import vocab_parallel_logprobs
    from megatron_rl.parallel import ParallelConfig, init_distributed

    dp = init_distributed(ParallelConfig(tp, pp))
    if load is not None:
        from megatron_rl.checkpoint import load_checkpoint, resolve_checkpoint
        from megatron_rl.convert import load_megatron_args

        ckpt = resolve_checkpoint(load)
        args = load_megatron_args(ckpt)
        policy = Policy(args, trainable=True, optim=OptimConfig(lr=0.0))
        load_checkpoint(ckpt, policy, with_optimizer=False)
    else:
        args = ModelArgs.from_pretrained(hf_path)
        policy = Policy(args, trainable=True, optim=OptimConfig(lr=0.0))
        policy.load_hf(hf_path)
    tokens, mask = make_batch(args.vocab_size, global_batch, seq_len)
    global_tokens = mask.sum()
    per_dp = global_batch // dp
    dp_rank = ps.get_data_parallel_rank()
    idx = list(range(dp_rank * per_dp, (dp_rank + 1) * per_dp))
    microbatches = [{"tokens": tokens[idx[i:i + micro_batch]], "mask": mask[idx[i:i + micro_batch]],
                     "index": idx[i:i + micro_batch]} for i in range(0, per_dp, micro_batch)]
    vocab_local = args.vocab_size // tp

    def loss_fn(batch, logits):
        logp = vocab_parallel_logprobs(
            logits, next_token_targets(batch["tokens"]).to(logits.device),
            tp_group=ps.get_tensor_model_parallel_group(),
            vocab_start=ps.get_tensor_model_parallel_rank() * vocab_local)[:, :-1]
        loss = -(logp * batch["mask"].to(logp.device)).sum() / global_tokens
        full = gather_from_tensor_model_parallel_region(logits.detach())
        return loss, {"loss": loss.detach().clone(), "logits": full.cpu(), "index": batch["index"]}

    results = policy.forward_backward(microbatches, loss_fn)
    grads = policy.full_grads(dst=0)
    layout_dir = os.path.join(out_dir, f"{tp}x{pp}")
    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(layout_dir, exist_ok=True)
    dist.barrier()
    if results and ps.get_tensor_model_parallel_rank() == 0:
        logits = {i: r["logits"][j] for r in results for j, i in enumerate(r["index"])}
        torch.save(logits, os.path.join(layout_dir, f"logits_rank{rank}.pt"))
        torch.save(sum(float(r["loss"]) for r in results),
                   os.path.join(layout_dir, f"loss_rank{rank}.pt"))
    if grads is not None:
        torch.save(grads, os.path.join(layout_dir, "grads.pt"))
    dist.barrier()
    if rl_configs:
        _run_rl_configs(policy, args, tokens, mask, idx, micro_batch, rl_configs, layout_dir,
                        packed)
    if generate:
        _run_generation(policy, tokens, layout_dir)
    ps.destroy_model_parallel()


# "estimator:placement[:policy loss]" (default ppo-clip): the sequence-level gspo, whose ratio
# is a mean over each sequence's tokens, and cispo once each
RL_CONFIGS = [f"{e}:{p}" for e in ("k1", "k3") for p in ("reward", "loss", "reward+loss")] + [
    "k1:none", "exact:reward+loss", "k1:reward:gspo", "k3:loss:cispo"]
# every placement once, for the packed-sequence / fused-LM-head comparison
PACKED_CONFIGS = ["k1:reward", "k1:none", "k3:loss", "k3:reward+loss", "exact:reward+loss",
                  "k1:reward:gspo", "k3:loss:cispo"]


def rl_batch(policy, tokens, mask, group_size: int = 2, seed: int = 0):
    """A deterministic RL batch on `tokens`: on-policy old log-probs (recomputed in this layout),
    a perturbed reference, random 0/1 rewards."""
    g = torch.Generator().manual_seed(seed)
    old = policy.token_logprobs(tokens, tokens.shape[0])
    ref = old + 0.3 * torch.randn(old.shape, generator=g)
    rewards = (torch.rand(tokens.shape[0], generator=g) < 0.5).float()
    return old, ref, rewards, group_size


def perturbed_reference(policy, args, scale: float = 0.2, seed: int = 123):
    """A frozen Policy in `policy`'s layout whose weights are the policy's plus seeded noise
    (per full tensor, scale x its std; 0.05 for constant tensors such as norm weights): the same
    reference model at every layout, different enough from the policy for a visible KL."""
    from megatron_rl.models.policy import Policy

    full = policy.full_state_dict(dst=None)
    g = torch.Generator().manual_seed(seed)
    noisy = {}
    for name in sorted(full):
        t = full[name].float()
        std = float(t.std()) if t.numel() > 1 else 0.0
        noise = torch.randn(t.shape, generator=g) * (scale * std if std > 0 else 0.05)
        noisy[name] = (t + noise).to(full[name].dtype)
    reference = Policy(args, trainable=False, params_dtype=policy.params_dtype,
                       parallel=policy.parallel, options=policy.options)
    reference.load_full_state_dict(noisy, source="perturbed policy")
    return reference


def packed_lengths(global_batch: int, seq_len: int) -> list[int]:
    """Unequal sequence lengths (tokens before the right padding) for the packed RL check."""
    return [seq_len - (3 * i) % 7 for i in range(global_batch)]


def _run_rl_configs(policy, args, tokens, mask, idx, micro_batch, configs, layout_dir,
                    packed: bool = False):
    """For each "estimator:placement[:policy loss]", one forward/backward of the trainer's RL
    loss on this DP rank's share; full gradients and the summed loss written to <layout_dir>/rl_<config>.pt.
    The sampled-token estimators use a perturbed copy of the policy's log-probs as the
    reference's; "exact" needs a reference model: `perturbed_reference`, run inside the step as
    the trainer does (score_reference_exact for the reward side, the reference's stage in
    forward_backward for the loss side).

    packed: also the same with sequences of unequal lengths (packed_lengths; the loss mask
    ends with each), once right-padded through the logits path (rl_<config>_padded.pt) and
    once packed two per microbatch through the fused LM head (rl_<config>_packed.pt): the two
    must agree at every layout."""
    from megatron_rl.packing import Layout

    old, ref, rewards, group_size = rl_batch(policy, tokens, mask)
    reference = [None]
    variants = [("", Layout(packed=False, micro_batch_size=micro_batch), None, mask)]
    if packed:
        lengths = packed_lengths(tokens.shape[0], tokens.shape[1])
        ends = torch.arange(tokens.shape[1] - 1)[None] < torch.tensor(lengths)[:, None] - 1
        short = mask * ends
        variants += [("_padded", Layout(packed=False, micro_batch_size=micro_batch), lengths,
                      short),
                     ("_packed", Layout(packed=True, max_tokens=2 * tokens.shape[1]), lengths,
                      short)]
    fused = policy.fused_lm_head
    for suffix, lay, lengths, m in variants:
        policy.fused_lm_head = lay.packed  # the packed variant scores from hidden states
        for spec in configs if not suffix else [c for c in configs if c in PACKED_CONFIGS]:
            _run_rl_config(policy, args, spec, tokens, m, idx, lay, lengths, reference,
                           (old, ref, rewards, group_size),
                           os.path.join(layout_dir, f"rl_{spec.replace('+', '_')}{suffix}.pt"))
    policy.fused_lm_head = fused


def _run_rl_config(policy, args, spec, tokens, mask, idx, lay, lengths, reference, data, path):
    import torch.distributed as dist

    from megatron_rl.kl import KLConfig
    from megatron_rl.loss import LossConfig, build_advantages
    from megatron_rl.update import loss_microbatch, make_rl_loss_fn, score_reference_exact

    old, ref, rewards, group_size = data
    estimator, placement, *policy_loss = spec.split(":")
    cfg = LossConfig(kl=KLConfig(estimator=estimator, placement=placement, coef=0.5),
                     policy_loss=policy_loss[0] if policy_loss else "ppo-clip")
    if policy_loss:  # off-policy (the same at every layout): ratios away from 1, so that a
        # sequence ratio taken over the wrong tokens would show
        noise = 0.2 * torch.randn(old.shape, generator=torch.Generator().manual_seed(7))
        old = old + noise.to(old.device)
    ref_lp, token_kl = ref, None
    if cfg.kl.exact:
        reference[0] = reference[0] or perturbed_reference(policy, args)
        reference[0].fused_lm_head = policy.fused_lm_head
        ref_lp, token_kl = score_reference_exact(policy, reference[0], tokens, lay, lengths)
    adv = build_advantages(rewards, old, ref_lp, mask, cfg, group_size, token_kl=token_kl)
    batch = _RLRows(tokens, mask, old)
    micro = [loss_microbatch(batch, adv, ref_lp, mb)
             for mb in lay.microbatches(tokens, lengths, idx, policy.pad_multiple,
                                        policy.pp_size > 1)]
    ref_model = reference[0] if cfg.kl.exact_kl_in_loss else None
    loss_fn = make_rl_loss_fn(policy, cfg, float(mask.sum()), float(tokens.shape[0]), ref_model)
    results = policy.forward_backward(micro, loss_fn, reference=ref_model, for_scoring=True)
    loss = torch.tensor([sum(float(r["loss"]) for r in results)], dtype=torch.float64)
    dist.all_reduce(loss)  # DP ranks' shares add up; first stages hold 0; TP ranks repeat it
    loss /= policy.tp_size
    grads = policy.full_grads(dst=0)
    if grads is not None:
        torch.save({"loss": float(loss), "grads": grads}, path)


class _RLRows:
    """The per-row tensors update.loss_microbatch reads from a RolloutBatch."""

    def __init__(self, tokens, loss_mask, old_logprobs):
        self.tokens, self.loss_mask, self.old_logprobs = tokens, loss_mask, old_logprobs
        self.device = tokens.device


def _run_generation(policy, tokens, layout_dir):
    """Sample from the local engine on prompts of unequal length (left padding exercised); the
    tokens and log-probs are written to <layout_dir>/generate.pt by global rank 0."""
    import torch.distributed as dist

    from megatron_rl.rollout.base import SamplingParams
    from megatron_rl.rollout.local import LocalEngine

    prompts = [tokens[i, : 3 + 2 * i].tolist() for i in range(tokens.shape[0])]
    groups = LocalEngine(policy).generate(prompts, 2, SamplingParams(max_new_tokens=6, seed=11))
    if dist.get_rank() == 0:
        torch.save([[(c.token_ids, c.rollout_logprobs, c.finish_reason) for c in g]
                    for g in groups], os.path.join(layout_dir, "generate.pt"))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf", help="HF checkpoint directory (config.json + safetensors)")
    src.add_argument("--load", help="Megatron checkpoint (root or iteration directory)")
    p.add_argument("--out", required=True)
    p.add_argument("--layouts", default="1x1,2x1,1x2,2x2", help="comma list of TPxPP")
    p.add_argument("--global-batch-size", type=int, default=4)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--seq-length", type=int, default=16)
    p.add_argument("--generate", action="store_true", help="also sample from the local engine")
    p.add_argument("--packed", action="store_true", help="also run the RL configs on sequences of "
                   "unequal length, right-padded (logits) and packed (fused LM head)")
    p.add_argument("--rl-configs", default="", help='also run the RL loss for these comma-separated '
                   '"estimator:placement[:policy loss]" configs ("all" for the standard set)')
    a = p.parse_args(argv)
    import torch.distributed as dist

    from megatron_rl.processes import skip_exit_collection

    for layout in a.layouts.split(","):
        tp, pp = (int(x) for x in layout.lower().split("x"))
        configs = RL_CONFIGS if a.rl_configs == "all" else [c for c in a.rl_configs.split(",") if c]
        run_layout(a.hf, tp, pp, a.out, a.global_batch_size, a.seq_length, a.micro_batch_size,
                   load=a.load, rl_configs=configs, generate=a.generate, packed=a.packed)
    if dist.is_initialized():
        dist.destroy_process_group()
    skip_exit_collection()


if __name__ == "__main__":
    main()
