"""Per-call overhead of the Python tool's bubblewrap sandbox (docs/agent.md).

    python tools/bench_sandbox.py --calls 20 --workers 4

Times ``--calls`` runs of ``print(1)``: the same interpreter started bare (no sandbox), then in
the sandbox one call at a time, then ``--calls`` calls on a ``ToolExecutor`` of ``--workers``
threads. Prints the median and spread per call and the machine's load.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import time

from megatron_rl.agent import PythonSandbox, ToolCall, ToolExecutor, ToolRegistry, python_tool


def _summary(name: str, seconds: list[float]) -> str:
    ms = sorted(s * 1000 for s in seconds)
    return f"| {name} | {statistics.median(ms):.0f} | {ms[0]:.0f}-{ms[-1]:.0f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args()
    sandbox = PythonSandbox()
    sandbox.check()  # warm the page cache
    bare, boxed = [], []
    for _ in range(args.calls):
        start = time.perf_counter()
        subprocess.run([sandbox.python, "-I", "-c", "print(1)"], check=True, capture_output=True)
        bare.append(time.perf_counter() - start)
        start = time.perf_counter()
        result = sandbox.run("print(1)")
        boxed.append(time.perf_counter() - start)
        assert result.stdout == "1\n", result
    with ToolExecutor(ToolRegistry([python_tool(sandbox, check=False)]), num_workers=args.workers) as ex:
        start = time.perf_counter()
        results = ex.run([ToolCall("python", {"code": "print(1)"})] * args.calls)
        concurrent = time.perf_counter() - start
    assert all(r.text == "1\n" for r in results), results
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}, {args.calls} calls")
    print("| what | median ms per call | min-max ms |\n|---|---|---|")
    print(_summary("python3 -c 'print(1)', no sandbox", bare))
    print(_summary("the same in the sandbox, one at a time", boxed))
    print(f"| {args.calls} sandboxed calls on {args.workers} workers | "
          f"{concurrent / args.calls * 1000:.0f} (wall / calls) | total {concurrent:.2f} s |")


if __name__ == "__main__":
    main()
