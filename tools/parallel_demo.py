#!/usr/bin/env python
"""Parallel-equivalence demo: one tiny Qwen2 and one tiny tied-embedding Llama, each run at
TP1, TP2, PP2 and TP2xPP2 on 4 CPU ranks (gloo), compared with transformers on the same weights.

    python tools/parallel_demo.py [--out outputs/parallel_demo]
Prints a table of the largest logit and gradient differences; exits non-zero above 1e-4.
"""
import argparse
import os
import subprocess
import sys

import torch

from megatron_rl.experiments.tiny_model import make_tiny_hf_checkpoint
from megatron_rl.experiments.parallel_check import load_layout_outputs, transformers_reference

LAYOUTS = ["1x1", "2x1", "1x2", "2x2"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="outputs/parallel_demo")
    a = p.parse_args()
    rows = []
    for family, tied in (("qwen2", False), ("llama", True)):
        hf = make_tiny_hf_checkpoint(os.path.join(a.out, f"hf_{family}"), family,
                                     tie_word_embeddings=tied)
        run_dir = os.path.join(a.out, f"run_{family}")
        print(f"[{family}] running layouts {LAYOUTS} on 4 ranks ...", flush=True)
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4",
                        "-m", "megatron_rl.experiments.parallel_check", "--hf", hf, "--out", run_dir,
                        "--layouts", ",".join(LAYOUTS)],
                       check=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        ref_logits, ref_grads = transformers_reference(hf, 4, 16)
        for layout in LAYOUTS:
            logits, grads = load_layout_outputs(run_dir, layout)
            dl = max(float((logits[i] - ref_logits[i]).abs().max()) for i in logits)
            dg = max(float((grads[k] - ref_grads[k]).abs().max()) for k in ref_grads)
            rows.append((family + (" (tied)" if tied else ""), layout, dl, dg))
    print("\n| model | TPxPP (DP fills 4 ranks) | max |logit diff| vs transformers | "
          "max |grad diff| |\n|---|---|---|---|")
    for m, layout, dl, dg in rows:
        print(f"| {m} | {layout} | {dl:.2e} | {dg:.2e} |")
    worst = max(max(r[2], r[3]) for r in rows)
    print(f"\n{'PASS' if worst < 1e-4 else 'FAIL'}: worst difference {worst:.2e}")
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
