#!/usr/bin/env python
"""The GPU verification kit's bookkeeping (scripts/gpu_check.sh): step records, environment,
wheel checks and the final summary. Standard library only (plus `packaging` for wheel checks),
so it runs before anything is installed.

    python tools/gpu_summary.py record OUT --name build --rc 0 --seconds 81.2 --timeout 600 --log OUT/build.log
    python tools/gpu_summary.py env OUT                  # OUT/env.json: device, torch, CUDA, nvcc
    python tools/gpu_summary.py check-wheels DIR         # one version each, deps covered, <= 64 MiB
    python tools/gpu_summary.py write OUT                # OUT/summary.json and OUT/summary.md

Files read from OUT by `write`: steps.jsonl (one record per step; the last record of a name
wins, so a step re-run in a later command replaces the earlier one), env.json, junit_*.xml
(pytest), bench_logprob_kl.json, bench_vs_trl.json and weight_sync.json (the benchmarks' --json
outputs).
Goals are reported, never asserted.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
import zipfile

# Packages of the GPU machine's image that the carried wheels rely on (from
# /work/.library/device/KINDS.md, "Python packages already there"). A requirement of a carried
# wheel must be carried too or be named here.
GPU_MACHINE_PROVIDES = {
    "torch", "numpy", "packaging", "accelerate", "huggingface-hub", "jinja2", "pandas", "psutil",
    "pyarrow", "pyyaml", "transformers", "filelock", "requests", "httpx", "tqdm", "xxhash",
    "fsspec", "aiohttp", "sympy", "einops", "safetensors", "tokenizers", "tensorboard", "pytest",
    "setuptools", "wheel", "ninja", "pybind11", "typing-extensions", "regex", "pytz",
}
WHEEL_LIMIT_MIB = 64
KERNEL_GOALS = {"fwd_bwd_pct_floor": 70.0, "fwd_bwd_x_mcore": 1.5, "peak_over_grad": 1.05}
RL_GOAL_RATIO = 1.5


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# ------------------------------------------------------------------------------------------------
# step records and environment
# ------------------------------------------------------------------------------------------------
def status_of(rc: int, note: str = "") -> str:
    """ok / failed / timeout (rc 124 or 137 from `timeout`) / skipped (rc -1)."""
    if rc == -1:
        return "skipped"
    if rc in (124, 137):
        return "timeout"
    return "ok" if rc == 0 else "failed"


def record_step(out: str, name: str, rc: int, seconds: float, timeout_s: int, log: str,
                note: str = "") -> dict:
    """Append one step's outcome to OUT/steps.jsonl."""
    row = {"name": name, "status": status_of(rc), "rc": rc, "seconds": round(seconds, 1),
           "timeout_s": timeout_s, "log": os.path.relpath(log, out) if log else "", "note": note,
           "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    with open(os.path.join(out, "steps.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
    return row


def read_steps(out: str) -> list[dict]:
    """Step records in first-run order, the last record of each name winning."""
    path = os.path.join(out, "steps.jsonl")
    steps: dict[str, dict] = {}
    if os.path.exists(path):
        for line in open(path):
            if line.strip():
                row = json.loads(line)
                steps[row["name"]] = row
    return list(steps.values())


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _first_line(cmd: list[str], pattern: str = "") -> str | None:
    try:
        text = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [l.strip() for l in text.splitlines() if pattern in l]
    return lines[-1] if lines else None


def collect_env() -> dict:
    """Device, driver, torch / CUDA / nvcc versions and the versions of the packages used."""
    env = {"python": platform.python_version(), "host": platform.node(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "nvcc": _first_line(["nvcc", "--version"], "release"),
           "driver": _first_line(["nvidia-smi", "--query-gpu=driver_version",
                                  "--format=csv,noheader"]),
           "git_commit": _first_line(["git", "rev-parse", "HEAD"])}
    try:
        import torch

        env.update(torch=torch.__version__, torch_cuda=torch.version.cuda,
                   cuda_available=torch.cuda.is_available())
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            env.update(device=props.name, capability=f"{props.major}.{props.minor}",
                       memory_gib=round(props.total_memory / 2**30, 1),
                       multiprocessors=props.multi_processor_count)
        else:
            env["device"] = f"CPU only ({platform.machine()}, {os.cpu_count()} cores)"
    except ImportError as exc:
        env["torch"] = f"not importable: {exc}"
    env["packages"] = {p: _version(p) for p in ("megatron-core", "transformers", "trl",
                                                "accelerate", "datasets", "math-verify",
                                                "triton", "numpy")}
    try:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from megatron_rl.ops import extension_backends

        env["extension_backends"] = list(extension_backends())
    except Exception as exc:  # noqa: BLE001 - recorded, not fatal
        env["extension_backends"] = f"not importable: {exc!r}"[:300]
    return env


# ------------------------------------------------------------------------------------------------
# wheels
# ------------------------------------------------------------------------------------------------
def wheel_metadata(path: str) -> tuple[str, str, list[str]]:
    """(name, version, Requires-Dist lines) of a wheel file."""
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    fields = {"Name": "", "Version": ""}
    requires = []
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(": ")
        if key in fields:
            fields[key] = value.strip()
        elif key == "Requires-Dist":
            requires.append(value.strip())
    return fields["Name"], fields["Version"], requires


def check_wheels(directory: str, limit_mib: float = WHEEL_LIMIT_MIB,
                 python_version: str = "3.12") -> tuple[list[str], int, list[tuple]]:
    """Problems with a wheel folder (an empty list when fine), its total size in bytes, and one
    (file, name, version, size) row per wheel. Checks: at least megatron-core, one version per
    package, every requirement (markers evaluated for CPython `python_version` on Linux x86-64,
    extras ignored) carried or provided by the GPU machine, total size <= limit_mib."""
    from packaging.requirements import Requirement

    files = sorted(glob.glob(os.path.join(directory, "*.whl")))
    rows, problems, names = [], [], {}
    for f in files:
        name, version, _ = wheel_metadata(f)
        rows.append((os.path.basename(f), name, version, os.path.getsize(f)))
        names.setdefault(_norm(name), []).append(version)
    total = sum(r[3] for r in rows)
    if "megatron-core" not in names:
        problems.append(f"{directory}: no megatron-core wheel (run scripts/gather_gpu_wheels.sh)")
    for name, versions in names.items():
        if len(versions) > 1:
            problems.append(f"{name}: {len(versions)} versions {versions} (keep one: pip stops)")
    marker_env = {"python_version": python_version, "python_full_version": python_version + ".0",
                  "sys_platform": "linux", "platform_system": "Linux",
                  "platform_machine": "x86_64", "implementation_name": "cpython",
                  "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
    for f in files:
        name, _, requires = wheel_metadata(f)
        for line in requires:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(marker_env):
                continue
            dep = _norm(req.name)
            if dep in names:
                if not req.specifier.contains(names[dep][0], prereleases=True):
                    problems.append(f"{name} needs {line}; carried {dep} {names[dep][0]}")
            elif dep not in GPU_MACHINE_PROVIDES:
                problems.append(f"{name} needs {line}: neither carried nor on the GPU machine")
    if total > limit_mib * 2**20:
        problems.append(f"{directory}: {total / 2**20:.1f} MiB of wheels > {limit_mib} MiB")
    return problems, total, rows


# ------------------------------------------------------------------------------------------------
# summary
# ------------------------------------------------------------------------------------------------
def junit_counts(path: str) -> dict:
    """Test counts of a pytest junit xml file and the failing tests' names and messages."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites)
              for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failed, skip_reasons = [], {}
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        for tag in ("failure", "error"):
            el = case.find(tag)
            if el is not None:
                msg = (el.get("message") or el.text or "").strip().splitlines()
                failed.append({"test": name, "kind": tag, "message": (msg[0] if msg else "")[:300]})
        el = case.find("skipped")
        if el is not None:
            reason = (el.get("message") or "").strip()[:200]
            skip_reasons[reason] = skip_reasons.get(reason, 0) + 1
    counts["failed_tests"] = failed
    counts["skip_reasons"] = skip_reasons
    return counts


def _load_json(path: str):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def kernel_goals(bench: dict) -> list[dict]:
    """The fused op's goals at the largest shape: fwd+bwd >= 70% of the HBM floor, >= 1.5x
    megatron-core, peak extra memory of one logits gradient."""
    rows = [r for r in bench.get("rows", []) if r["method"] == "ours-cuda" and not r.get("oom")]
    if not rows:
        return [{"goal": "fused op (CUDA kernel) benchmarked", "target": "yes", "measured": "no row",
                 "met": False}]
    big = max(rows, key=lambda r: r["n"] * r["v"])
    shape = f"N={big['n']}, V={big['v']}"
    peak_ratio = big["peak_extra_mib"] / big["grad_mib"] if big.get("grad_mib") else None
    x_mcore = big.get("fwd_bwd_x_mcore")
    return [
        {"goal": f"kernel fwd+bwd vs HBM floor ({shape})", "target": ">= 70%",
         "measured": f"{big['fwd_bwd_pct_floor']:.0f}%",
         "met": big["fwd_bwd_pct_floor"] >= KERNEL_GOALS["fwd_bwd_pct_floor"]},
        {"goal": f"kernel fwd+bwd speed vs megatron-core ({shape})", "target": ">= 1.5x",
         "measured": "no mcore row" if x_mcore is None else f"{x_mcore:.2f}x",
         "met": x_mcore is not None and x_mcore >= KERNEL_GOALS["fwd_bwd_x_mcore"]},
        {"goal": f"kernel peak extra memory / one logits gradient ({shape})", "target": "<= 1.05",
         "measured": "n/a" if peak_ratio is None else f"{peak_ratio:.3f}",
         "met": peak_ratio is not None and peak_ratio <= KERNEL_GOALS["peak_over_grad"]},
    ]


def rl_goals(bench: dict) -> list[dict]:
    ratio = bench.get("ratio_megatron_over_trl")
    return [{"goal": "RL step tokens/s vs TRL GRPOTrainer (same GPU, model, batch)",
             "target": ">= 1.5x", "measured": "n/a" if ratio is None else f"{ratio:.2f}x",
             "met": ratio is not None and ratio >= RL_GOAL_RATIO}]


def lm_head_goals(bench: dict) -> list[dict]:
    """tools/bench_lm_head.py's own goals (fused op's memory against megatron-core, its time
    against the logits path), in this summary's form."""
    return [{"goal": f"LM head: {g['goal']} ({g['dtype']}, N={g['n']})",
             "target": "see goal", "measured": ("n/a " + g.get("note", "")) if g["value"] is None
             else f"{g['value']:.3f}", "met": bool(g["met"])} for g in bench.get("goals", [])]


def build_summary(out: str) -> dict:
    steps = read_steps(out)
    tests = {os.path.basename(p)[len("junit_"):-len(".xml")]: junit_counts(p)
             for p in sorted(glob.glob(os.path.join(out, "junit_*.xml")))}
    kernel = _load_json(os.path.join(out, "bench_logprob_kl.json"))
    rl = _load_json(os.path.join(out, "bench_vs_trl.json"))
    sync = _load_json(os.path.join(out, "weight_sync.json"))
    lm_head = _load_json(os.path.join(out, "bench_lm_head.json"))
    goals = ((kernel_goals(kernel) if kernel else []) + (lm_head_goals(lm_head) if lm_head else [])
             + (rl_goals(rl) if rl else []))
    failed = [s["name"] for s in steps if s["status"] in ("failed", "timeout")]
    env = _load_json(os.path.join(out, "env.json")) or {}
    dry_run = bool(steps) and all(s["name"].startswith("dry-") for s in steps)
    return {"env": env, "steps": steps,
            "total_seconds": round(sum(s["seconds"] for s in steps), 1), "tests": tests,
            "bench_logprob_kl": kernel, "bench_lm_head": lm_head, "bench_vs_trl": rl,
            "weight_sync": sync, "goals": goals,
            "ok": (bool(steps) and not failed and (dry_run or bool(env.get("cuda_available")))
                   and all(not t["failures"] and not t["errors"] for t in tests.values())),
            "failed_steps": failed, "dry_run": dry_run}


def _fmt(v, spec: str = ".2f") -> str:
    return "" if v is None else format(v, spec)


def render_markdown(s: dict) -> str:
    env = s["env"]
    pk = env.get("packages", {})
    title = "GPU check, dry run" if s["dry_run"] else "GPU check"
    lines = [f"# {title}: {env.get('device', '?')} ({env.get('date', '?')})", "",
             f"- overall: **{'PASS' if s['ok'] else 'FAIL'}**"
             + (f" (failed steps: {', '.join(s['failed_steps'])})" if s["failed_steps"] else ""),
             f"- torch {env.get('torch')} (CUDA {env.get('torch_cuda')}), nvcc: {env.get('nvcc')}, "
             f"driver {env.get('driver')}, python {env.get('python')}",
             "- " + ", ".join(f"{k} {v}" for k, v in pk.items() if v),
             f"- extension backends: {env.get('extension_backends')}; commit {env.get('git_commit')}",
             f"- total step time {s['total_seconds']:.0f} s", "", "## Steps", "",
             "| step | status | seconds | timeout s | log | note |", "|---|---|---|---|---|---|"]
    for st in s["steps"]:
        lines.append(f"| {st['name']} | {st['status']} | {st['seconds']:.1f} | {st['timeout_s']} | "
                     f"{st['log']} | {st.get('note', '')} |")
    if s["tests"]:
        lines += ["", "## Tests", "", "| suite | tests | passed | failed | errors | skipped |",
                  "|---|---|---|---|---|---|"]
        for name, t in s["tests"].items():
            lines.append(f"| {name} | {t['tests']} | {t['passed']} | {t['failures']} | "
                         f"{t['errors']} | {t['skipped']} |")
        for name, t in s["tests"].items():
            for f in t["failed_tests"]:
                lines.append(f"- {name}: `{f['test']}` ({f['kind']}): {f['message']}")
            for reason, n in t["skip_reasons"].items():
                lines.append(f"- {name}: {n} skipped: {reason}")
    k = s["bench_logprob_kl"]
    if k:
        bw = k.get("copy_gbps")
        lines += ["", f"## Fused log-prob / K3 op ({k.get('dtype')}, {k.get('device')})", "",
                  f"HBM floor = bytes that must move / device-to-device copy bandwidth measured in "
                  f"the same run: {bw:.0f} GB/s" if bw else "no HBM floor (not a CUDA run)", "",
                  "| N | V | method | fwd ms | fwd % floor | fwd+bwd ms | fwd+bwd % floor | "
                  "fwd+bwd x mcore | peak extra MiB | peak / one grad |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in k.get("rows", []):
            if r.get("oom"):
                lines.append(f"| {r['n']} | {r['v']} | {r['method']} | OOM | | | | | | |")
                continue
            lines.append(
                f"| {r['n']} | {r['v']} | {r['method']} | {r['fwd_ms']:.2f} | "
                f"{_fmt(r.get('fwd_pct_floor'), '.0f')} | {r['fwd_bwd_ms']:.2f} | "
                f"{_fmt(r.get('fwd_bwd_pct_floor'), '.0f')} | {_fmt(r.get('fwd_bwd_x_mcore'))} | "
                f"{r['peak_extra_mib']:.1f} | {r['peak_extra_mib'] / r['grad_mib']:.3f} |")
    rl = s["bench_vs_trl"]
    if rl:
        cfg = rl.get("config", {})
        lines += ["", f"## RL step throughput: {cfg.get('model_shape')} model, {cfg.get('prompts')}"
                  f" prompts x {cfg.get('group_size')} samples x {cfg.get('max_new_tokens')} new "
                  f"tokens, {cfg.get('device')}", "",
                  "| side | median tokens/s | median step s | phases (median s) |", "|---|---|---|---|"]
        for side, d in rl.get("sides", {}).items():
            phases = ", ".join(f"{p.split('/')[-1]} {v:.2f}"
                               for p, v in d.get("phases_median_s", {}).items())
            lines.append(f"| {side} | {d['median_tokens_per_s']:.0f} | {d['median_step_s']:.2f} | "
                         f"{phases} |")
        lines.append(f"\nmegatron-rl / TRL tokens/s: {rl.get('ratio_megatron_over_trl', 0):.2f}x")
    sync = s.get("weight_sync")
    if sync:
        lines += ["", f"## Weight sync: {sync.get('model_gb', 0):.2f} GB model", "",
                  "| engine | mode | median s | s/GB |", "|---|---|---|---|"]
        for r in sync.get("rows", []):
            if "skipped" not in r:
                lines.append(f"| {r['engine']} | {r['mode']} | {r['median_s']:.3f} | "
                             f"{r['s_per_gb']:.2f} |")
    if s["goals"]:
        lines += ["", "## Goals (reported, not asserted)", "", "| goal | target | measured | met |",
                  "|---|---|---|---|"]
        for g in s["goals"]:
            lines.append(f"| {g['goal']} | {g['target']} | {g['measured']} | "
                         f"{'yes' if g['met'] else 'no'} |")
    return "\n".join(lines) + "\n"


def write_summary(out: str) -> dict:
    s = build_summary(out)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(s, f, indent=2)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(render_markdown(s))
    return s


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="append a step record to OUT/steps.jsonl")
    r.add_argument("out")
    r.add_argument("--name", required=True)
    r.add_argument("--rc", type=int, required=True)
    r.add_argument("--seconds", type=float, required=True)
    r.add_argument("--timeout", type=int, default=0)
    r.add_argument("--log", default="")
    r.add_argument("--note", default="")
    e = sub.add_parser("env", help="write OUT/env.json")
    e.add_argument("out")
    e.add_argument("--require-cuda", action="store_true", help="exit 1 when CUDA is unavailable")
    w = sub.add_parser("check-wheels", help="check a wheel folder for the GPU machine")
    w.add_argument("dir")
    w.add_argument("--limit-mib", type=float, default=WHEEL_LIMIT_MIB)
    sub.add_parser("write", help="write OUT/summary.json and OUT/summary.md").add_argument("out")
    a = p.parse_args(argv)
    if a.cmd == "record":
        row = record_step(a.out, a.name, a.rc, a.seconds, a.timeout, a.log, a.note)
        print(f"[gpu_check] {row['name']}: {row['status']} ({row['seconds']:.1f} s)")
    elif a.cmd == "env":
        env = collect_env()
        with open(os.path.join(a.out, "env.json"), "w") as f:
            json.dump(env, f, indent=2)
        print(f"[gpu_check] device {env.get('device')}, torch {env.get('torch')} "
              f"(CUDA {env.get('torch_cuda')}), nvcc {env.get('nvcc')}")
        if a.require_cuda and not env.get("cuda_available"):
            print("ERROR: torch.cuda.is_available() is False: the gpu tier would only skip",
                  file=sys.stderr)
            return 1
    elif a.cmd == "check-wheels":
        problems, total, rows = check_wheels(a.dir, a.limit_mib)
        for fname, name, version, size in rows:
            print(f"  {size / 2**20:7.2f} MiB  {name} {version}  ({fname})")
        print(f"  {total / 2**20:7.2f} MiB  total in {len(rows)} wheels (limit {a.limit_mib:g} MiB)")
        for msg in problems:
            print(f"ERROR: {msg}", file=sys.stderr)
        return 1 if problems else 0
    elif a.cmd == "write":
        s = write_summary(a.out)
        print(f"[gpu_check] summary: {os.path.join(a.out, 'summary.md')} "
              f"({'PASS' if s['ok'] else 'FAIL'})")
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
