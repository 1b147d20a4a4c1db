"""tools/gpu_summary.py, the GPU kit's bookkeeping: step time limits under a per-command limit,
a summary that survives the half-written files a cut step leaves, and the archive that brings a
call's results back (and merges several calls' archives into one summary)."""
import importlib
import json
import os
import sys
import tarfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
gs = importlib.import_module("gpu_summary")


def test_plan_step_keeps_every_limit_inside_the_command_limit():
    # a fresh 600 s command: the step ends 45 s before it, pytest's session ends before the
    # step (the last test started then still fits in its per-test limit)
    limit, per_test, session = gs.plan_step(720, elapsed=0, time_limit=600, reserve=45)
    assert (limit, per_test, session) == (555, 185, 555 - 185 - gs.PYTEST_GRACE_S)
    assert session + per_test < limit
    # later in the command: the time left, not the step's own limit
    assert gs.plan_step(300, elapsed=400, time_limit=600)[0] == 155
    assert gs.plan_step(300, elapsed=0, time_limit=600)[0] == 300
    # the per-test limit never above GPU_CHECK_TEST_TIMEOUT
    assert gs.plan_step(600, elapsed=0, time_limit=0, test_timeout=120)[1] == 120
    # less than MIN_STEP_S left: not started
    assert gs.plan_step(300, elapsed=551, time_limit=600) == (0, 0, 0)
    # no command limit: the step's own
    assert gs.plan_step(720, elapsed=5000, time_limit=0)[0] == 720


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def test_summary_names_unreadable_files_a_cut_step_left(tmp_path):
    out = str(tmp_path)
    gs.record_step(out, "gpu-tests", 124, 300.0, 300, os.path.join(out, "gpu-tests.log"))
    gs.record_step(out, "bench-kernel", 143, 12.0, 300, "", "stopped by SIGTERM")
    with open(os.path.join(out, "steps.jsonl"), "a") as f:
        f.write('{"name": "bench-rl", "sta')  # a record cut mid-write
    _write(os.path.join(out, "junit_gpu.xml"), '<testsuite tests="3"><testcase name="a"')
    _write(os.path.join(out, "bench_logprob_kl.json"), '{"rows": [{"n": 1')
    _write(os.path.join(out, "bench_train_phase.json"), json.dumps(
        {"num_layers": 24, "train_phase": [{"max_response": 1024, "kl": "k3:loss",
                                            "combo": "packed+fused", "status": "ok",
                                            "step_s": 2.0, "response_tokens_per_s": 9000.0,
                                            "cuda_peak_gib": 30.5}],
         "ratios": [{"max_response": 1024, "kl": "k3:loss", "goal": 1.8, "ratio": 2.1,
                     "met": True}]}))
    s = gs.write_summary(out)
    assert [st["status"] for st in s["steps"]] == ["timeout", "interrupted"]
    assert s["failed_steps"] == ["gpu-tests", "bench-kernel"] and not s["ok"]
    assert sorted(u.split(":")[0] for u in s["unreadable"]) == ["bench_logprob_kl.json",
                                                               "junit_gpu.xml"]
    assert s["goals"][0]["measured"] == "2.10x" and s["goals"][0]["met"]
    md = open(os.path.join(out, "summary.md")).read()
    assert "- unreadable: junit_gpu.xml" in md and "## Training phase" in md



def test_summary_shows_the_training_phases_tokens_per_second_and_mfu(tmp_path):
    out = str(tmp_path)
    gs.record_step(out, "bench-train-phase", 0, 200.0, 300, "")
    row = {"model": "qwen2.5-1.5b", "num_layers": 28, "max_response": 4096, "kl": "k3:loss",
           "status": "ok", "step_s": 4.0, "all_tokens_per_s": 20000.0,
           "response_tokens_per_s": 19000.0, "model_tflops_per_s": 330.0, "mfu": 0.3337,
           "peak_tflops": 989.0, "peak_source": "NVIDIA H200 dense bf16 data sheet",
           "cuda_peak_gib": 60.0}
    _write(os.path.join(out, "bench_train_phase.json"), json.dumps(
        {"num_layers": 24, "train_phase": [{**row, "combo": "packed+fused"},
                                           {**row, "combo": "padded+logits", "mfu": 0.1}],
         "ratios": [{"model": "qwen2.5-1.5b", "max_response": 4096, "kl": "k3:loss",
                     "goal": 1.5, "ratio": 1.0, "met": False}],
         "mfu_goals": [{"model": "qwen2.5-1.5b", "combo": "packed+fused", "max_response": 4096,
                        "kl": "k3:loss", "goal": 0.35, "mfu": 0.3337, "by": 0.3337 - 0.35,
                        "met": False, "peak_source": "NVIDIA H200 dense bf16 data sheet"}]}))
    s = gs.write_summary(out)
    assert "qwen2.5-1.5b" in s["goals"][0]["goal"]
    assert s["goals"][0]["target"] == ">= 1.5x" and not s["goals"][0]["met"]
    assert s["goals"][1] == {
        "goal": "train phase MFU (qwen2.5-1.5b, packed+fused, responses <= 4096, k3:loss)",
        "target": ">= 35%", "measured": "33.4% (missed by 1.6 points)", "met": False}
    md = open(os.path.join(out, "summary.md")).read()
    assert ("| train phase MFU (qwen2.5-1.5b, packed+fused, responses <= 4096, k3:loss) "
            "| >= 35% | 33.4% (missed by 1.6 points) | no |") in md
    assert ("| qwen2.5-1.5b | 28 | 4096 | k3:loss | packed+fused | ok | 4.00 | 20000 | 19000 "
            "| 330.0 | 33.4% | 60.00 |") in md
    assert "- MFU's peak: 989 TFLOP/s (NVIDIA H200 dense bf16 data sheet)" in md


def test_pack_then_merge_two_calls(tmp_path):
    calls = []
    for i, (step, rc) in enumerate([("gpu-tests", 1), ("gpu-tests", 0)]):
        out = tmp_path / f"call{i}"
        out.mkdir()
        gs.record_step(str(out), "install", 0, 20.0, 180, "")
        gs.record_step(str(out), step, rc, 100.0, 400, "")
        big = "x" * (gs.LOG_TAIL_BYTES + 1000) + "the end\n"
        _write(out / f"{step}.log", big)
        if i == 1:
            _write(out / "bench_vs_trl.json", json.dumps({"sides": {},
                                                          "ratio_megatron_over_trl": 1.7}))
        gs.write_summary(str(out))
        so = tmp_path / "_C.cpython-312-x86_64-linux-gnu.so"
        so.write_bytes(b"\x7fELF not really")
        written = gs.pack(str(out), str(tmp_path / f"pack{i}"), extension=str(so))
        assert sorted(os.path.basename(p) for p in written) == [
            "extension.tgz", "gpu_check.tgz", "summary.json", "summary.md"]
        calls.append(str(tmp_path / f"pack{i}" / "gpu_check.tgz"))
    with tarfile.open(calls[0]) as t:
        log = t.extractfile("gpu-tests.log").read()
        assert log.startswith(b"[gpu_check: the first 1008 of") and log.endswith(b"the end\n")
        assert len(log) < gs.LOG_TAIL_BYTES + 100
    with tarfile.open(tmp_path / "pack0" / "extension.tgz") as t:
        assert t.getnames() == ["megatron_rl/_C.cpython-312-x86_64-linux-gnu.so"]
    s = gs.merge(str(tmp_path / "merged"), calls)
    assert [(st["name"], st["status"]) for st in s["steps"]] == [("install", "ok"),
                                                                 ("gpu-tests", "ok")]
    assert s["bench_vs_trl"]["ratio_megatron_over_trl"] == 1.7
    assert os.path.exists(tmp_path / "merged" / "summary.md")


def test_the_mfu_goal_not_measured_or_not_judged_says_why():
    bench = {"mfu_goals": [
        {"model": "qwen2.5-1.5b", "combo": "packed+fused", "max_response": None, "kl": None,
         "goal": 0.35, "mfu": None, "met": None, "by": None,
         "why": "no qwen2.5-1.5b packed+fused configuration ran"},
        {"model": "qwen2.5-1.5b", "combo": "packed+fused", "max_response": 1024, "kl": "k1:reward",
         "goal": 0.35, "mfu": 0.5, "by": 0.15, "met": None,
         "why": "not the qwen2.5-1.5b shape (4 layers, hidden 1536, vocab 151936)"},
        {"model": "qwen2.5-1.5b", "combo": "packed+fused", "max_response": 4096, "kl": "k3:loss",
         "goal": 0.35, "mfu": 0.36, "by": 0.01, "met": True}]}
    got = gs.train_phase_goals(bench)
    assert [g["measured"] for g in got] == [
        "n/a (no qwen2.5-1.5b packed+fused configuration ran)",
        "50.0% (not judged: not the qwen2.5-1.5b shape (4 layers, hidden 1536, vocab 151936))",
        "36.0% (1.0 points over)"]
    assert [g["met"] for g in got] == [False, False, True]
    assert got[0]["goal"] == "train phase MFU (qwen2.5-1.5b, packed+fused)"
