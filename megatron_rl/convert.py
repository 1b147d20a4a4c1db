"""Checkpoint conversion between Hugging Face (safetensors + config.json) and Megatron
(`dist_checkpointing`, reshardable) formats, in any TP/PP layout on either side.

Megatron checkpoints are written with megatron_rl.checkpoint (atomic, `latest` pointer) and carry
the HF config as `hf_config.json`, so they can be exported back without the original directory.
Both directions run in the current process group: a single process for TP=PP=1, or under torchrun
with world size TP*PP. The name/layout mapping is megatron_rl.models.hf_mapping (the same code that
syncs weights to rollout servers).
"""

from __future__ import annotations

import argparse
import glob
import os

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "generation_config.json",
                   "chat_template.jinja")


def _init(tp: int, pp: int):
    from megatron_rl.parallel import ParallelConfig, init_distributed

    init_distributed(ParallelConfig(tp, pp))


def hf_to_megatron(hf_dir: str, save_root: str, tp: int = 1, pp: int = 1) -> str:
    """Convert a HF checkpoint directory into a Megatron checkpoint root. Collective."""
    from megatron_rl.checkpoint import save_checkpoint
    from megatron_rl.models import ModelArgs
    from megatron_rl.models.policy import Policy

    _init(tp, pp)
    args = ModelArgs.from_pretrained(hf_dir)
    policy = Policy(args, trainable=False)
    policy.load_hf(hf_dir)
    out = save_checkpoint(save_root, 0, policy, with_optimizer=False, hf_config=args.to_hf_config())
    _copy_tokenizer(hf_dir, out)
    return out


def load_megatron_args(ckpt_dir: str):
    from megatron_rl.models import ModelArgs

    path = os.path.join(ckpt_dir, "hf_config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{ckpt_dir}: no hf_config.json; was it written by megatron-rl?")
    return ModelArgs.from_pretrained(path)


def resolve_checkpoint(path: str) -> str:
    """A checkpoint root (with `latest`) or one iteration directory -> the iteration directory."""
    from megatron_rl.checkpoint import latest_checkpoint

    latest = latest_checkpoint(path)  # None without a `latest` file
    return path if latest is None else latest


def megatron_to_hf(load: str, hf_dir: str, tp: int = 1, pp: int = 1, dtype: str | None = None) -> None:
    """Export a Megatron checkpoint (root or iteration dir) to a HF directory. Collective."""
    import torch

    from megatron_rl.checkpoint import load_checkpoint
    from megatron_rl.models import hf_mapping
    from megatron_rl.models.policy import Policy
    from megatron_rl.parallel import run_on_rank

    _init(tp, pp)
    ckpt = resolve_checkpoint(load)
    args = load_megatron_args(ckpt)
    policy = Policy(args, trainable=False)
    load_checkpoint(ckpt, policy, with_optimizer=False)
    full = policy.full_state_dict(dst=0)

    def write() -> None:
        hf = hf_mapping.megatron_to_hf(full, args, source=ckpt)
        extra = [f for f in (os.path.join(ckpt, n) for n in TOKENIZER_FILES) if os.path.exists(f)]
        hf_mapping.save_hf_checkpoint(hf, args, hf_dir, extra_files=tuple(extra),
                                      dtype=getattr(torch, dtype) if dtype else None)

    run_on_rank(0, write, f"writing the HF checkpoint {hf_dir}")  # the others wait outside


def _copy_tokenizer(src: str, dst: str) -> None:
    import shutil
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return
    for name in TOKENIZER_FILES:
        for f in glob.glob(os.path.join(src, name)):
            shutil.copy(f, dst)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="megatron-rl convert",
        description="Convert checkpoints between HF and Megatron formats. Run under torchrun "
                    "with world size TP*PP for a sharded layout.")
    p.add_argument("direction", choices=["hf-to-megatron", "megatron-to-hf"], help=(
        "hf-to-megatron: a Hugging Face directory (--load) into a Megatron checkpoint root "
        "(--save); megatron-to-hf: a Megatron checkpoint written by megatron-rl (--load) into a "
        "Hugging Face directory (--save)"))
    p.add_argument("--load", required=True, help=(
        "source: hf-to-megatron: the Hugging Face directory (config.json, safetensors, "
        "tokenizer files); megatron-to-hf: a Megatron checkpoint root (its `latest` iteration) "
        "or one iteration directory, with the hf_config.json megatron-rl stores. Required"))
    p.add_argument("--save", required=True, help=(
        "destination: hf-to-megatron: the checkpoint root, which gets iteration directory "
        "iter_0000000 (weights, hf_config.json, tokenizer files) and the `latest` pointer; "
        "megatron-to-hf: the Hugging Face directory (config.json, safetensors, the checkpoint's "
        "tokenizer files), replaced as a whole when it exists. Required"))
    p.add_argument("--tensor-model-parallel-size", type=int, default=1, help=(
        "tensor-parallel size the model is held in while converting; the Megatron checkpoint "
        "is reshardable, so it loads in any layout later. Launch with torchrun and exactly "
        "TP x PP processes (default: %(default)s)"))
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1, help=(
        "pipeline-parallel size (stages) the model is held in while converting; the Megatron "
        "checkpoint is reshardable, so it loads in any layout later. Launch with torchrun and "
        "exactly TP x PP processes (default: %(default)s)"))
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None, help=(
        "megatron-to-hf only: dtype of the exported safetensors tensors, also written to "
        "config.json as torch_dtype (default: unset, float32: the precision the converter "
        "holds the weights in)"))
    a = p.parse_args(argv)
    tp, pp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world != tp * pp:
        raise SystemExit(f"world size {world} != TP*PP = {tp * pp}: launch with "
                         f"`torchrun --nproc-per-node {tp * pp} ...`")
    if a.direction == "hf-to-megatron":
        out = hf_to_megatron(a.load, a.save, tp, pp)
        msg = f"wrote Megatron checkpoint {out}"
    else:
        megatron_to_hf(a.load, a.save, tp, pp, a.dtype)
        msg = f"wrote HF checkpoint {a.save}"
    from megatron_rl.parallel import destroy_distributed
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print(msg)
    destroy_distributed()


if __name__ == "__main__":
    main()
