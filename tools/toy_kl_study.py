"""Exact toy study of KL estimator configurations (paper Sec. 3.3); see megatron_rl/experiments/toy.py.

Usage: python tools/toy_kl_study.py [--out outputs/toy] [--seq-len 8] [--num-trials 200] ...
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rl.experiments.toy import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
