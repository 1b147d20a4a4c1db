"""What a process's shutdown costs after the trainer's imports, with and without
`processes.skip_exit_collection()` (gc.freeze() before returning).

Each trial starts a fresh interpreter that imports what a trainer rank imports (megatron_rl.train,
megatron-core's GPT model, transformers' tokenizers), prints a line and returns; the time from that
line to the process's exit is its shutdown. The two variants alternate, `--trials` each; the
result (medians and their ratio, with every trial) goes to stdout and to `--out` as JSON.

    python tools/bench_exit.py --trials 5 --out benchmarks/process_exit_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

CHILD = """
import megatron_rl.train, megatron.core.models.gpt, transformers
from transformers import AutoTokenizer
if {freeze}:
    from megatron_rl.processes import skip_exit_collection
    skip_exit_collection()
print("ready", flush=True)
"""


def shutdown_seconds(freeze: bool) -> float:
    """Seconds from the child's last line to its exit."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", CHILD.format(freeze=freeze)], env=env,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    t0 = time.perf_counter()
    proc.wait()
    assert proc.returncode == 0, proc.returncode
    return time.perf_counter() - t0


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=5, help="runs of each variant (alternating)")
    p.add_argument("--out", help="write the result as JSON to this file")
    a = p.parse_args(argv)
    runs: dict[str, list[float]] = {"default": [], "skip_exit_collection": []}
    for _ in range(a.trials):
        runs["default"].append(shutdown_seconds(False))
        runs["skip_exit_collection"].append(shutdown_seconds(True))
    med = {k: statistics.median(v) for k, v in runs.items()}
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU",
              "python": platform.python_version(), "trials": runs,
              "median_s": med, "ratio_default_over_frozen": med["default"] / med["skip_exit_collection"]}
    print(f"shutdown after the trainer's imports: {med['default']:.2f} s by default, "
          f"{med['skip_exit_collection']:.2f} s with skip_exit_collection "
          f"({result['ratio_default_over_frozen']:.1f}x), median of {a.trials}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
