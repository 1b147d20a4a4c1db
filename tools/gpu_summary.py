#!/usr/bin/env python
"""The GPU verification kit's bookkeeping (scripts/gpu_check.sh): step records, time limits,
environment, wheel checks, the summary and the results' archive. Standard library only (plus
`packaging` for wheel checks), so it runs before anything is installed.

    python tools/gpu_summary.py record OUT --name build --rc 0 --seconds 81.2 --timeout 600 --log OUT/build.log
    python tools/gpu_summary.py plan-step 600 --elapsed 130 --time-limit 600  # limit, per-test, session s
    python tools/gpu_summary.py env OUT [--wheels DIR]   # OUT/env.json: device, torch, CUDA, nvcc
    python tools/gpu_summary.py pins                     # scripts/gpu_wheels.txt's pins
    python tools/gpu_summary.py check-wheels DIR [--pins] [--write-metadata]  # for the machine
    python tools/gpu_summary.py check-installed DIR      # on the machine, after the install
    python tools/gpu_summary.py write OUT                # OUT/summary.json and OUT/summary.md
    python tools/gpu_summary.py pack OUT DEST [--extension SO]  # DEST/gpu_check.tgz + summaries
    python tools/gpu_summary.py merge OUT ARCHIVE...     # several calls' archives into one OUT

Files read from OUT by `write`: steps.jsonl (one record per step; the last record of a name
wins, so a step re-run in a later command replaces the earlier one), env.json, junit_*.xml
(pytest), bench_logprob_kl.json, bench_exact_kl.json, bench_lm_head.json,
bench_train_phase.json, bench_vs_trl.json and weight_sync.json (the benchmarks' --json
outputs). A file that a cut step left unreadable (a half-written JSON or XML) is named in the
summary, not fatal. Goals are reported, never asserted.
"""
from __future__ import annotations

import argparse
import glob
import io
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
import zipfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The GPU machine's own packages (versions where recorded), the carried wheels' pins and their
# declared requirements (written by scripts/gather_gpu_wheels.sh from the wheels).
MACHINE_PACKAGES = os.path.join(REPO, "scripts", "gpu_machine_packages.txt")
WHEEL_PINS = os.path.join(REPO, "scripts", "gpu_wheels.txt")
WHEEL_METADATA = os.path.join(REPO, "scripts", "gpu_wheels_metadata.json")
WHEEL_LIMIT_MIB = 64
# What comes back from a lent machine's $OUT: at most 8 files of 16 MiB each (device README);
# the archive keeps each log's last LOG_TAIL_BYTES (halved until the archive fits).
RETURN_FILE_LIMIT = 16 << 20
LOG_TAIL_BYTES = 2 << 20
# plan_step: a step is not started with less than MIN_STEP_S left; pytest's session ends
# PYTEST_GRACE_S before the step's limit (its report is written in that time).
MIN_STEP_S = 5
PYTEST_GRACE_S = 15
KERNEL_GOALS = {"fwd_bwd_pct_floor": 70.0, "fwd_bwd_x_mcore": 1.5, "peak_over_grad": 1.05}
RL_GOAL_RATIO = 1.5


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# ------------------------------------------------------------------------------------------------
# step records and environment
# ------------------------------------------------------------------------------------------------
def status_of(rc: int, note: str = "") -> str:
    """ok / failed / timeout (rc 124 or 137 from `timeout`: cut at its limit) / interrupted
    (rc 130 or 143: the kit itself was stopped by SIGINT / SIGTERM during the step) / skipped
    (rc -1)."""
    if rc == -1:
        return "skipped"
    if rc in (124, 137):
        return "timeout"
    if rc in (130, 143):
        return "interrupted"
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
    """Step records in first-run order, the last record of each name winning (a line a killed
    writer left incomplete is dropped)."""
    path = os.path.join(out, "steps.jsonl")
    steps: dict[str, dict] = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                steps[row["name"]] = row
    return list(steps.values())


def plan_step(nominal: int, elapsed: float, time_limit: int, reserve: int = 45,
              test_timeout: int = 300) -> tuple[int, int, int]:
    """(limit, pytest per-test timeout, pytest session timeout) in seconds for a step whose own
    limit is `nominal`, started `elapsed` s into a command that may run `time_limit` s in all
    (0: no limit), of which the last `reserve` s are kept for the summary and the archive (and
    the kill grace of a step that ignores its interrupt). (0, 0, 0) when less than MIN_STEP_S is
    left: the step is not started.

    limit = min(nominal, time_limit - reserve - elapsed); per-test = min(test_timeout,
    limit // 3); session = limit - per-test - PYTEST_GRACE_S (at least 1): pytest starts no test
    after the session timeout, so its last test ends by limit - PYTEST_GRACE_S and it writes its
    report before the step's limit interrupts it."""
    limit = int(nominal)
    if time_limit > 0:
        left = int(time_limit - reserve - elapsed)
        if left < MIN_STEP_S:
            return 0, 0, 0
        limit = min(limit, left)
    per_test = max(1, min(int(test_timeout), limit // 3))
    return limit, per_test, max(1, limit - per_test - PYTEST_GRACE_S)


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


def collect_env(wheels: str | None = None) -> dict:
    """Device, driver, torch / CUDA / nvcc versions and the versions of the packages used
    (with `wheels`, a folder of carried wheels: also every package they require, as installed
    here: the readings for scripts/gpu_machine_packages.txt)."""
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
    if wheels:
        try:
            env["wheel_requirements_installed"] = check_installed(wheels)[1]
        except Exception as exc:  # noqa: BLE001 - recorded, not fatal
            env["wheel_requirements_installed"] = f"not read: {exc!r}"[:300]
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
def read_pins(path: str = WHEEL_PINS) -> list[str]:
    """The `name==version` lines of a pin file (comments and blank lines dropped)."""
    with open(path) as f:
        return [ln.split("#", 1)[0].strip() for ln in f if ln.split("#", 1)[0].strip()]


def machine_packages(path: str = MACHINE_PACKAGES) -> tuple[str, dict[str, str | None]]:
    """(Python version, {normalised package name: version, or None where only the name was
    recorded}) of the GPU machine (scripts/gpu_machine_packages.txt)."""
    python, packages = "", {}
    for line in read_pins(path):
        name, _, version = line.partition("==")
        if _norm(name) == "python":
            python = version.strip()
        else:
            packages[_norm(name)] = version.strip() or None
    return python, packages


def wheel_metadata(path: str) -> dict:
    """{"name", "version", "requires_python", "requires_dist"} of a wheel file, from its METADATA."""
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    out: dict = {"name": "", "version": "", "requires_python": "", "requires_dist": []}
    keys = {"Name": "name", "Version": "version", "Requires-Python": "requires_python"}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(": ")
        if key in keys:
            out[keys[key]] = value.strip()
        elif key == "Requires-Dist":
            out["requires_dist"].append(value.strip())
    return out


def requirement_problems(wheels: dict[str, dict], machine: dict[str, str | None], python: str
                         ) -> tuple[list[str], list[str]]:
    """(problems, unverified) of carried wheels on a machine.

    wheels: {normalised name: wheel_metadata(...)} of every carried wheel; machine: the
    machine's own packages, {normalised name: version or None (version unknown)}; python: its
    Python version. Each wheel's Requires-Python must hold `python`; each requirement (markers
    evaluated for that CPython on x86-64 Linux, extras of the requirement ignored, requirements
    of the wheel's own extras skipped) must be carried at a version in its range, else be a
    machine package at a version in its range. Carried wheels shadow the machine's packages
    (they come first on PYTHONPATH). `unverified` lists the requirements with a version range
    on machine packages whose version is unknown."""
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    marker_env = {"python_version": ".".join(python.split(".")[:2]), "python_full_version": python,
                  "sys_platform": "linux", "platform_system": "Linux",
                  "platform_machine": "x86_64", "implementation_name": "cpython",
                  "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
    problems, unverified = [], []
    for key, w in sorted(wheels.items()):
        label = f"{w['name']} {w['version']}"
        if w.get("requires_python") and not SpecifierSet(w["requires_python"]).contains(python):
            problems.append(f"{label} needs Python {w['requires_python']}; the machine has {python}")
        for line in w.get("requires_dist", []):
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(marker_env):
                continue
            dep = _norm(req.name)
            if dep in wheels:
                have, where = wheels[dep]["version"], "carried"
            elif dep in machine:
                have, where = machine[dep], "on the machine"
            else:
                problems.append(f"{label} needs {line}: neither carried nor on the GPU machine")
                continue
            if have is None:
                if str(req.specifier):
                    unverified.append(f"{label} needs {line}: the machine's version is not "
                                      "recorded")
            elif not req.specifier.contains(have, prereleases=True):
                problems.append(f"{label} needs {line}; {where}: {dep} {have}")
    return problems, unverified


def check_wheels(directory: str, limit_mib: float = WHEEL_LIMIT_MIB, pins: list[str] | None = None,
                 machine_file: str = MACHINE_PACKAGES
                 ) -> tuple[list[str], list[str], int, list[tuple], dict[str, dict]]:
    """Problems with a wheel folder (an empty list when fine), the requirements that could not
    be checked (requirement_problems' `unverified`), its total size in bytes, one (file, name,
    version, size) row per wheel, and {normalised name: metadata}. Checks: at least
    megatron-core, one version per package, exactly `pins` (when given), requirement_problems
    against the machine of `machine_file`, total size <= limit_mib."""
    files = sorted(glob.glob(os.path.join(directory, "*.whl")))
    rows, problems, versions, wheels = [], [], {}, {}
    for f in files:
        meta = wheel_metadata(f)
        rows.append((os.path.basename(f), meta["name"], meta["version"], os.path.getsize(f)))
        versions.setdefault(_norm(meta["name"]), []).append(meta["version"])
        wheels[_norm(meta["name"])] = meta
    total = sum(r[3] for r in rows)
    if "megatron-core" not in versions:
        problems.append(f"{directory}: no megatron-core wheel (run scripts/gather_gpu_wheels.sh)")
    for name, vs in versions.items():
        if len(vs) > 1:
            problems.append(f"{name}: {len(vs)} versions {vs} (keep one: pip stops)")
    if pins is not None:
        want = {_norm(p.split("==")[0]) + "==" + p.split("==")[1] for p in pins}
        have = {f"{n}=={v}" for n, vs in versions.items() for v in vs}
        for p in sorted(want - have):
            problems.append(f"{p} is pinned ({os.path.relpath(WHEEL_PINS, REPO)}) but not in "
                            f"{directory}")
        for p in sorted(have - want):
            problems.append(f"{p} is in {directory} but not pinned")
    python, machine = machine_packages(machine_file)
    found, unverified = requirement_problems(wheels, machine, python)
    problems += found
    if total > limit_mib * 2**20:
        problems.append(f"{directory}: {total / 2**20:.1f} MiB of wheels > {limit_mib} MiB")
    return problems, unverified, total, rows, wheels


def check_installed(directory: str) -> tuple[list[str], dict[str, str | None]]:
    """On the GPU machine, after the install: (problems, {package: installed version}) of the
    wheels in `directory` against what this interpreter imports (the machine's packages and
    the carried ones on PYTHONPATH): every carried package at its wheel's version, every
    requirement (as requirement_problems) satisfied by the installed version."""
    from importlib import metadata

    wheels = {_norm(m["name"]): m for m in (wheel_metadata(f) for f in
                                            sorted(glob.glob(os.path.join(directory, "*.whl"))))}
    names = set(wheels)
    for m in wheels.values():
        for line in m["requires_dist"]:
            names.add(_norm(re.split(r"[\s;\[<>=!~(]", line, maxsplit=1)[0]))
    installed = {}
    for n in sorted(names):
        try:
            installed[n] = metadata.version(n)
        except metadata.PackageNotFoundError:
            installed[n] = None
    problems = [f"{m['name']} {m['version']} is carried, but {installed[n] or 'nothing'} is "
                "installed" for n, m in sorted(wheels.items()) if installed[n] != m["version"]]
    # the installed versions stand for the machine; the carried ones are checked above
    machine = {n: v for n, v in installed.items() if v is not None and n not in wheels}
    found, _ = requirement_problems(wheels, machine, platform.python_version())
    return problems + found, installed


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


def train_phase_goals(bench: dict) -> list[dict]:
    """tools/bench_train_phase.py's goals: packed+fused / padded+logits training tokens/s
    ("ratios"), and the packed+fused training phase's MFU at the Qwen2.5-1.5B shape
    ("mfu_goals": measured with how far over or under the goal, or why not judged)."""
    out = [{"goal": "train phase packed+fused / padded+logits tokens/s ("
                    + (f"{r['model']}, " if r.get("model") else "")
                    + f"responses <= {r['max_response']}, {r['kl']})",
            "target": f">= {r['goal']}x",
            "measured": f"{r['ratio']:.2f}x" if r.get("ratio") is not None
            else f"n/a ({r.get('why', '')})", "met": bool(r.get("met"))}
           for r in bench.get("ratios", [])]
    for r in bench.get("mfu_goals", []):
        where = (f", responses <= {r['max_response']}, {r['kl']}"
                 if r.get("max_response") is not None else "")
        if r.get("mfu") is None:
            measured = f"n/a ({r.get('why', '')})"
        else:
            pts = 100 * abs(r["by"])
            measured = f"{100 * r['mfu']:.1f}% " + (
                f"(not judged: {r.get('why', '')})" if r.get("met") is None
                else f"({pts:.1f} points over)" if r["met"] else f"(missed by {pts:.1f} points)")
        out.append({"goal": f"train phase MFU ({r['model']}, {r['combo']}{where})",
                    "target": f">= {100 * r['goal']:.0f}%", "measured": measured,
                    "met": bool(r.get("met"))})
    return out


def _read(path: str, loader, unreadable: list[str]):
    """loader(path), None when absent; a file a cut step left unreadable goes to `unreadable`."""
    if not os.path.exists(path):
        return None
    try:
        return loader(path)
    except Exception as exc:  # noqa: BLE001 - a half-written file must not cost the summary
        unreadable.append(f"{os.path.basename(path)}: {type(exc).__name__}: {exc}"[:300])
        return None


def build_summary(out: str) -> dict:
    steps = read_steps(out)
    unreadable: list[str] = []
    tests = {}
    for p in sorted(glob.glob(os.path.join(out, "junit_*.xml"))):
        counts = _read(p, junit_counts, unreadable)
        if counts is not None:
            tests[os.path.basename(p)[len("junit_"):-len(".xml")]] = counts
    bench = {key: _read(os.path.join(out, f"{key}.json"), _load_json, unreadable) for key in
             ("bench_logprob_kl", "bench_exact_kl", "bench_lm_head", "bench_train_phase",
              "bench_vs_trl", "weight_sync")}
    goals = []
    for key, fn in (("bench_logprob_kl", kernel_goals), ("bench_lm_head", lm_head_goals),
                    ("bench_train_phase", train_phase_goals), ("bench_vs_trl", rl_goals)):
        if bench[key]:
            try:
                goals += fn(bench[key])
            except Exception as exc:  # noqa: BLE001 - an unexpected shape: named, not fatal
                unreadable.append(f"{key}.json: {type(exc).__name__}: {exc}"[:300])
    failed = [s["name"] for s in steps if s["status"] in ("failed", "timeout", "interrupted")]
    env = _read(os.path.join(out, "env.json"), _load_json, unreadable) or {}
    dry_run = bool(steps) and all(s["name"].startswith("dry-") for s in steps)
    return {"env": env, "steps": steps,
            "total_seconds": round(sum(s["seconds"] for s in steps), 1), "tests": tests,
            **bench, "goals": goals, "unreadable": unreadable,
            "ok": (bool(steps) and not failed and not unreadable
                   and (dry_run or bool(env.get("cuda_available")))
                   and all(not t["failures"] and not t["errors"] for t in tests.values())),
            "failed_steps": failed, "dry_run": dry_run}


def _fmt(v, spec: str = ".2f") -> str:
    return "" if v is None else format(v, spec)


def render_markdown(s: dict) -> str:
    """summary.md: the overview and the steps always; each further section where its data is,
    a section whose data has an unexpected shape replaced by a line saying so."""
    lines = _render_head(s)
    for section in (_render_tests, _render_kernel, _render_exact, _render_train_phase, _render_rl,
                    _render_sync, _render_goals):
        try:
            lines += section(s)
        except Exception as exc:  # noqa: BLE001 - one bad section must not cost the summary
            lines += ["", f"({section.__name__[len('_render_'):]}: not rendered: "
                      f"{type(exc).__name__}: {exc})"]
    return "\n".join(lines) + "\n"


def _render_head(s: dict) -> list[str]:
    env = s["env"]
    pk = env.get("packages", {})
    title = "GPU check, dry run" if s["dry_run"] else "GPU check"
    lines = [f"# {title}: {env.get('device', '?')} ({env.get('date', '?')})", "",
             f"- overall: **{'PASS' if s['ok'] else 'FAIL'}**"
             + (f" (failed steps: {', '.join(s['failed_steps'])})" if s["failed_steps"] else ""),
             f"- torch {env.get('torch')} (CUDA {env.get('torch_cuda')}), nvcc: {env.get('nvcc')}, "
             f"driver {env.get('driver')}, python {env.get('python')}",
             "- packages: " + (", ".join(f"{k} {v}" for k, v in pk.items() if v) or "not read"),
             f"- extension backends: {env.get('extension_backends')}; commit {env.get('git_commit')}",
             f"- total step time {s['total_seconds']:.0f} s", "", "## Steps", "",
             "| step | status | seconds | timeout s | log | note |", "|---|---|---|---|---|---|"]
    for st in s["steps"]:
        lines.append(f"| {st['name']} | {st['status']} | {st['seconds']:.1f} | {st['timeout_s']} | "
                     f"{st['log']} | {st.get('note', '')} |")
    for u in s.get("unreadable", []):
        lines.append(f"- unreadable: {u}")
    return lines


def _render_tests(s: dict) -> list[str]:
    lines = []
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
    return lines


def _render_kernel(s: dict) -> list[str]:
    lines = []
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
    return lines


def _render_exact(s: dict) -> list[str]:
    e = s.get("bench_exact_kl")
    if not e:
        return []
    lines = ["", f"## Exact KL against the K1 path ({e.get('dtype')}, {e.get('device')})", "",
             "| N | V | method | fwd ms | fwd+bwd ms | peak extra MiB | fwd+bwd / k1-path | "
             "peak / k1-path |", "|---|---|---|---|---|---|---|---|"]
    for r in e.get("rows", []):
        lines.append(f"| {r['n']} | {r['v']} | {r['method']} | {r['fwd_ms']:.2f} | "
                     f"{r['fwd_bwd_ms']:.2f} | {r['peak_extra_mib']:.1f} | "
                     f"{r['fwd_bwd_x_k1']:.2f}x | {r['peak_x_k1']:.2f} |")
    return lines


def _render_train_phase(s: dict) -> list[str]:
    t = s.get("bench_train_phase")
    if not t:
        return []
    lines = ["", f"## Training phase of one RL step ({t.get('limit_note', '')})", "",
             "| model | layers | responses <= | KL | path | status | step s | tok/s "
             "| response tok/s | model TFLOP/s | MFU | peak GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    peaks = set()
    for r in t.get("train_phase", []):
        ok = r.get("status") == "ok"
        peak = r.get("cuda_peak_gib", r.get("peak_rss_gib"))
        mfu = r.get("mfu")
        if ok and r.get("peak_source"):
            peaks.add(f"{r['peak_tflops']:.4g} TFLOP/s ({r['peak_source']})")
        lines.append(f"| {r.get('model', '')} | {r.get('num_layers', t.get('num_layers'))} | "
                     f"{r['max_response']} | {r['kl']} | {r['combo']} | {r.get('status')} | "
                     f"{_fmt(r.get('step_s')) if ok else ''} | "
                     f"{_fmt(r.get('all_tokens_per_s'), '.0f') if ok else ''} | "
                     f"{_fmt(r.get('response_tokens_per_s'), '.0f') if ok else ''} | "
                     f"{_fmt(r.get('model_tflops_per_s'), '.1f') if ok else ''} | "
                     + (f"{100 * mfu:.1f}%" if ok and mfu is not None else "")
                     + f" | {_fmt(peak)} |")
    lines += [f"- MFU's peak: {p}" for p in sorted(peaks)]
    return lines


def _render_rl(s: dict) -> list[str]:
    lines = []
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
    return lines


def _render_sync(s: dict) -> list[str]:
    lines = []
    sync = s.get("weight_sync")
    if sync:
        lines += ["", f"## Weight sync: {sync.get('model_gb', 0):.2f} GB model", "",
                  "| engine | mode | median s | s/GB |", "|---|---|---|---|"]
        for r in sync.get("rows", []):
            if "skipped" not in r:
                lines.append(f"| {r['engine']} | {r['mode']} | {r['median_s']:.3f} | "
                             f"{r['s_per_gb']:.2f} |")
    return lines


def _render_goals(s: dict) -> list[str]:
    lines = []
    if s["goals"]:
        lines += ["", "## Goals (reported, not asserted)", "", "| goal | target | measured | met |",
                  "|---|---|---|---|"]
        for g in s["goals"]:
            lines.append(f"| {g['goal']} | {g['target']} | {g['measured']} | "
                         f"{'yes' if g['met'] else 'no'} |")
    return lines


def write_summary(out: str) -> dict:
    s = build_summary(out)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(s, f, indent=2)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(render_markdown(s))
    return s


# ------------------------------------------------------------------------------------------------
# the results' archive (what comes back from a lent machine) and merging several calls' archives
# ------------------------------------------------------------------------------------------------
def _tail(path: str, keep: int) -> bytes:
    """A file's bytes; of a larger one, a line saying how much was dropped and its last `keep`."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if size <= keep:
            return f.read()
        f.seek(size - keep)
        return f"[gpu_check: the first {size - keep} of {size} bytes dropped]\n".encode() + f.read()


def pack(out: str, dest: str, extension: str | None = None) -> list[str]:
    """DEST/gpu_check.tgz (OUT's files, each *.log cut to its last LOG_TAIL_BYTES, halved until
    the archive is at most RETURN_FILE_LIMIT), DEST/summary.md and DEST/summary.json (OUT's),
    and with `extension` (a built megatron_rl/_C*.so) DEST/extension.tgz holding it as
    megatron_rl/<name>, debug sections stripped where `strip` exists: at most 4 files, each
    named in letters, digits, '.', '_' and '-', as a lent machine's $OUT returns them. Returns
    the paths written."""
    os.makedirs(dest, exist_ok=True)
    archive = os.path.join(dest, "gpu_check.tgz")
    outputs = {os.path.abspath(os.path.join(dest, n)) for n in
               ("gpu_check.tgz", "gpu_check.tgz.tmp", "extension.tgz")}
    files = sorted(p for p in glob.glob(os.path.join(out, "**", "*"), recursive=True)
                   if os.path.isfile(p) and os.path.abspath(p) not in outputs)
    keep = LOG_TAIL_BYTES
    while True:
        tmp = archive + ".tmp"
        with tarfile.open(tmp, "w:gz") as t:
            for p in files:
                data = _tail(p, keep) if p.endswith(".log") else open(p, "rb").read()
                info = tarfile.TarInfo(os.path.relpath(p, out))
                info.size, info.mtime, info.mode = len(data), int(os.path.getmtime(p)), 0o644
                t.addfile(info, io.BytesIO(data))
        os.replace(tmp, archive)
        if os.path.getsize(archive) <= RETURN_FILE_LIMIT or keep < 4096:
            break
        keep //= 2
    written = [archive]
    for name in ("summary.md", "summary.json"):
        src = os.path.join(out, name)
        if os.path.exists(src) and os.path.abspath(src) != os.path.abspath(
                os.path.join(dest, name)):
            shutil.copyfile(src, os.path.join(dest, name))
            written.append(os.path.join(dest, name))
    if extension:
        with tempfile.TemporaryDirectory() as tmpdir:
            so = os.path.join(tmpdir, os.path.basename(extension))
            shutil.copyfile(extension, so)
            if shutil.which("strip"):
                subprocess.run(["strip", "--strip-debug", so], capture_output=True, timeout=120)
            ext = os.path.join(dest, "extension.tgz")
            with tarfile.open(ext, "w:gz") as t:
                t.add(so, arcname=f"megatron_rl/{os.path.basename(extension)}")
        written.append(ext)
    return written


def merge(out: str, archives: list[str]) -> dict:
    """Several calls' gpu_check.tgz into OUT, in order: their files (a later archive's replaces
    an earlier one's) and their steps.jsonl records appended to OUT's (the last record of a
    step wins, as within one OUT_DIR); then the summary of it all."""
    os.makedirs(out, exist_ok=True)
    root = os.path.abspath(out)
    for archive in archives:
        with tarfile.open(archive) as t:
            for m in t.getmembers():
                path = os.path.abspath(os.path.join(out, m.name))
                if not m.isfile() or not path.startswith(root + os.sep):
                    continue
                src = t.extractfile(m)
                assert src is not None  # a regular file
                data = src.read()
                if m.name == "steps.jsonl":
                    with open(path, "ab") as f:
                        f.write(data if data.endswith(b"\n") or not data else data + b"\n")
                    continue
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    f.write(data)
    return write_summary(out)


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
    ps = sub.add_parser("plan-step", help="print a step's limit, pytest's per-test and session "
                        "timeouts (0 0 0: not started)")
    ps.add_argument("nominal", type=int, help="the step's own limit (s)")
    ps.add_argument("--elapsed", type=float, required=True, help="seconds since the command began")
    ps.add_argument("--time-limit", type=int, required=True,
                    help="seconds the command may run (0: no limit)")
    ps.add_argument("--reserve", type=int, default=45)
    ps.add_argument("--test-timeout", type=int, default=300)
    e = sub.add_parser("env", help="write OUT/env.json")
    e.add_argument("out")
    e.add_argument("--require-cuda", action="store_true", help="exit 1 when CUDA is unavailable")
    e.add_argument("--wheels", help="also record the installed versions of what these need")
    sub.add_parser("pins", help=f"print {os.path.relpath(WHEEL_PINS, REPO)}'s pins")
    w = sub.add_parser("check-wheels", help="check a wheel folder for the GPU machine")
    w.add_argument("dir")
    w.add_argument("--limit-mib", type=float, default=WHEEL_LIMIT_MIB)
    w.add_argument("--pins", action="store_true",
                   help=f"the folder must hold exactly {os.path.relpath(WHEEL_PINS, REPO)}")
    w.add_argument("--write-metadata", action="store_true",
                   help=f"write the wheels' requirements to {os.path.relpath(WHEEL_METADATA, REPO)}")
    ci = sub.add_parser("check-installed", help="on the GPU machine: the carried wheels' "
                        "requirements against the installed versions")
    ci.add_argument("dir")
    sub.add_parser("write", help="write OUT/summary.json and OUT/summary.md").add_argument("out")
    pk = sub.add_parser("pack", help="DEST/gpu_check.tgz, summary.md, summary.json "
                        "[, extension.tgz]")
    pk.add_argument("out")
    pk.add_argument("dest")
    pk.add_argument("--extension", help="a built megatron_rl/_C*.so to return too")
    m = sub.add_parser("merge", help="several calls' gpu_check.tgz into OUT, and its summary")
    m.add_argument("out")
    m.add_argument("archives", nargs="+")
    a = p.parse_args(argv)
    if a.cmd == "record":
        row = record_step(a.out, a.name, a.rc, a.seconds, a.timeout, a.log, a.note)
        print(f"[gpu_check] {row['name']}: {row['status']} ({row['seconds']:.1f} s)")
    elif a.cmd == "plan-step":
        print(*plan_step(a.nominal, a.elapsed, a.time_limit, a.reserve, a.test_timeout))
    elif a.cmd == "env":
        env = collect_env(a.wheels)
        with open(os.path.join(a.out, "env.json"), "w") as f:
            json.dump(env, f, indent=2)
        print(f"[gpu_check] device {env.get('device')}, torch {env.get('torch')} "
              f"(CUDA {env.get('torch_cuda')}), nvcc {env.get('nvcc')}")
        if a.require_cuda and not env.get("cuda_available"):
            print("ERROR: torch.cuda.is_available() is False: the gpu tier would only skip",
                  file=sys.stderr)
            return 1
    elif a.cmd == "pins":
        print("\n".join(read_pins()))
    elif a.cmd == "check-wheels":
        problems, unverified, total, rows, wheels = check_wheels(
            a.dir, a.limit_mib, read_pins() if a.pins else None)
        for fname, name, version, size in rows:
            print(f"  {size / 2**20:7.2f} MiB  {name} {version}  ({fname})")
        print(f"  {total / 2**20:7.2f} MiB  total in {len(rows)} wheels (limit {a.limit_mib:g} MiB)")
        for msg in unverified:
            print(f"  unverified here (the kit's install step checks it on the machine): {msg}")
        if a.write_metadata:
            text = json.dumps({n: wheels[n] for n in sorted(wheels)}, indent=1) + "\n"
            old = open(WHEEL_METADATA).read() if os.path.exists(WHEEL_METADATA) else None
            if text != old:
                with open(WHEEL_METADATA, "w") as f:
                    f.write(text)
                print(f"  {os.path.relpath(WHEEL_METADATA, REPO)} updated: commit it")
        for msg in problems:
            print(f"ERROR: {msg}", file=sys.stderr)
        return 1 if problems else 0
    elif a.cmd == "check-installed":
        problems, installed = check_installed(a.dir)
        print("  installed: " + ", ".join(f"{n} {v}" for n, v in installed.items()))
        for msg in problems:
            print(f"ERROR: {msg}", file=sys.stderr)
        return 1 if problems else 0
    elif a.cmd == "write":
        s = write_summary(a.out)
        print(f"[gpu_check] summary: {os.path.join(a.out, 'summary.md')} "
              f"({'PASS' if s['ok'] else 'FAIL'})")
        return 0
    elif a.cmd == "pack":
        for path in pack(a.out, a.dest, a.extension):
            print(f"[gpu_check] packed {path} ({os.path.getsize(path) / 2**20:.2f} MiB)")
    elif a.cmd == "merge":
        s = merge(a.out, a.archives)
        print(f"[gpu_check] merged {len(a.archives)} archive(s) into {a.out}: "
              f"{'PASS' if s['ok'] else 'FAIL'} ({len(s['steps'])} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
