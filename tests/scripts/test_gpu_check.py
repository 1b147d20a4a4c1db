"""scripts/gpu_check.sh when a step runs into the time limit, on the CPU (--dry-run, with a
step that sleeps): the kit stopped by SIGTERM from outside (as a machine's per-command limit
stops it) still records the running step, names the steps it did not reach, writes the summary
and packs the results; and the kit's own time limit (GPU_CHECK_TIME_LIMIT) cuts a step before
such an outside limit would, and does not start the steps that no longer fit."""
import json
import os
import signal
import subprocess
import tarfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KIT = os.path.join(REPO, "scripts", "gpu_check.sh")


def _kit(out, pack, *args, env=None, **kw):
    return subprocess.Popen(["bash", KIT, str(out), "--dry-run", "--no-setup", "--only", "sleepy",
                             "--pack", str(pack), *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, **(env or {})), **kw)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_stopped_by_sigterm_still_writes_the_summary_and_the_archive(tmp_path):
    out, pack, pidfile = tmp_path / "out", tmp_path / "pack", tmp_path / "sleep.pid"
    kit = _kit(out, pack, "--step", f"sleepy=echo $$ > {pidfile}; exec sleep 300",
               "--step", "after=true", start_new_session=True)
    deadline = time.monotonic() + 120
    while not pidfile.exists() or not pidfile.read_text().strip():
        assert kit.poll() is None and time.monotonic() < deadline, kit.communicate()[0]
        time.sleep(0.2)
    os.killpg(kit.pid, signal.SIGTERM)  # the kit's process group, as a command's limit does
    t = time.monotonic()
    log = kit.communicate(timeout=60)[0]
    assert kit.returncode == 143, log
    assert time.monotonic() - t < 30, "the kit took too long to stop"
    s = json.loads((out / "summary.json").read_text())
    steps = {st["name"]: st for st in s["steps"]}
    assert steps["sleepy"]["status"] == "interrupted"
    assert "stopped by SIGTERM during this step" in steps["sleepy"]["note"]
    assert steps["after"]["status"] == "skipped" and "not reached" in steps["after"]["note"]
    assert not s["ok"] and s["failed_steps"] == ["sleepy"]
    assert "| sleepy | interrupted |" in (pack / "summary.md").read_text()
    assert json.loads((pack / "summary.json").read_text())["failed_steps"] == ["sleepy"]
    with tarfile.open(pack / "gpu_check.tgz") as t:
        assert {"steps.jsonl", "sleepy.log", "summary.md", "summary.json"} <= set(t.getnames())
    pid = int(pidfile.read_text())
    for _ in range(50):  # the step was stopped too
        if not _alive(pid):
            break
        time.sleep(0.1)
    assert not _alive(pid), "the interrupted step's process is still running"


def test_own_time_limit_cuts_the_step_and_skips_what_no_longer_fits(tmp_path):
    out, pack = tmp_path / "out", tmp_path / "pack"
    t = time.monotonic()
    kit = _kit(out, pack, "--step", "sleepy=sleep 300", "--step", "after=true",
               env={"GPU_CHECK_TIME_LIMIT": "14", "GPU_CHECK_RESERVE": "4"})
    log = kit.communicate(timeout=120)[0]
    assert kit.returncode == 1, log
    assert time.monotonic() - t < 14 + 5, log
    steps = {st["name"]: st for st in json.loads((out / "summary.json").read_text())["steps"]}
    assert steps["sleepy"]["status"] == "timeout" and steps["sleepy"]["timeout_s"] <= 10
    assert "the command's time limit" in steps["sleepy"]["note"]
    assert steps["after"]["status"] == "skipped" and "not started" in steps["after"]["note"]
    assert (pack / "gpu_check.tgz").exists() and (pack / "summary.md").exists()


def test_step_names_must_be_plain(tmp_path):
    kit = _kit(tmp_path / "out", tmp_path / "pack", "--step", "a b=true")
    log = kit.communicate(timeout=60)[0]
    assert kit.returncode == 2 and "--step needs NAME=COMMAND" in log


def test_a_call_checks_packed_attention_and_the_training_phase_right_after_the_build(tmp_path):
    """The order a real run takes (printed by --dry-run): the setup, then the packed attention
    equivalence tests and the training-phase benchmark, then the rest; and their dry steps:
    the packed attention tests are collected, the benchmark plans both model shapes at
    4096-token responses with model FLOPs."""
    out = tmp_path / "out"
    kit = subprocess.run(["bash", KIT, str(out), "--dry-run", "--no-setup", "--only",
                          "packed-attention,bench-train-phase"], cwd=REPO, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    assert kit.returncode == 0, kit.stdout
    order = next(line for line in kit.stdout.splitlines()
                 if line.startswith("order: ")).split()[1:]
    assert order[:6] == ["install", "build", "env", "packed-attention", "bench-train-phase",
                         "gpu-tests"], order
    assert {"cpu-tier-on-gpu", "bench-kernel", "bench-lm-head", "bench-rl"} <= set(order[6:])
    # gpu-tests does not run the packed attention tests a second time
    gpu_tests = next(line for line in kit.stdout.splitlines() if "gpu-tests: " in line)
    assert "--ignore=tests/gpu/" in gpu_tests
    steps = {st["name"]: st for st in json.loads((out / "summary.json").read_text())["steps"]}
    assert [steps[n]["status"] for n in ("dry-packed-attention", "dry-bench-train-phase")] == \
        ["ok", "ok"]
    collected = (out / "dry-packed-attention.log").read_text()
    assert "packed attention tests: " in collected and "varlen" in collected
    plan = (out / "dry-bench-train-phase.log").read_text()
    for model in ("qwen2.5-1.5b", "qwen2.5-0.5b"):
        for path in ("packed+fused", "padded+logits"):
            assert any(line.startswith(model) and " 4096 " in line and path in line
                       and "TFLOP model" in line for line in plan.splitlines()), (model, path)


def test_the_recipe_says_what_a_single_call_gets():
    """The header's recipe: the first call runs the default order (no --only) with an archive
    for the device tool's $OUT, and says what it gets when it is the only call."""
    usage = subprocess.run(["bash", KIT, "--help"], cwd=REPO, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT).stdout
    recipe = usage[usage.index("Recipe for the lent"):]
    first = recipe[recipe.index("  1 timeout_s"):recipe.index("  2 at once")]
    assert "--pack $OUT" in first and "--only" not in first.split("If only one call")[0]
    single = " ".join(first.split("If only one call is possible")[1].split())
    for what in ("the build", "packed attention equivalence tests", "training-phase benchmark",
                 "MFU", "gpu tier", "skipped"):
        assert what in single, what
