#!/usr/bin/env python
"""Render training curves (PNG) from one or more runs' metrics.jsonl.

    python tools/plot_runs.py outputs/run_a outputs/run_b --out curves.png
"""
import argparse
import os

from megatron_rl.experiments.plots import plot_run, read_metrics


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("runs", nargs="+", help="run directories (containing metrics.jsonl) or files")
    p.add_argument("--out", default="curves.png")
    p.add_argument("--title", default="")
    a = p.parse_args()
    rows = {}
    for run in a.runs:
        path = os.path.join(run, "metrics.jsonl") if os.path.isdir(run) else run
        rows[os.path.basename(os.path.normpath(run))] = read_metrics(path)
    print(plot_run(rows, a.out, title=a.title))


if __name__ == "__main__":
    main()
