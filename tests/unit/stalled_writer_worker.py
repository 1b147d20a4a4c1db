"""A writer that stalls once its first safetensors file is written, until killed: what a kill -9
in the middle of a conversion or a disk weight export leaves. Prints "stalled" then.

Usage: python stalled_writer_worker.py convert LOAD SAVE   (megatron-rl convert megatron-to-hf)
       python stalled_writer_worker.py export ROOT HF_DIR  (a disk weight export, version 1)"""
import sys
import time

import safetensors.torch


def _stall_after_the_first_file() -> None:
    real = safetensors.torch.save_file

    def save_file(*args, **kwargs):
        real(*args, **kwargs)
        print("stalled", flush=True)
        time.sleep(600)

    safetensors.torch.save_file = save_file  # hf_mapping imports it at each call


def main(what: str, a: str, b: str) -> None:
    _stall_after_the_first_file()
    if what == "convert":
        from megatron_rl.convert import main as convert

        convert(["megatron-to-hf", "--load", a, "--save", b])
    else:
        from megatron_rl.models import ModelArgs, hf_mapping
        from megatron_rl.rollout.weight_sync import WeightExporter

        WeightExporter(a).export_state_dict(hf_mapping.load_hf_state_dict(b),
                                            ModelArgs.from_pretrained(b), 1)


if __name__ == "__main__":
    main(*sys.argv[1:])
