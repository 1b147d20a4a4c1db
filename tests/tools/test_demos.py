"""The CPU demos (tools/cpu_demo.py, tools/agent_demo.py): the tool-use demo's careless teacher
writes what it says it writes, and each demo runs end to end in a few steps (its gains are
measured by running it, not asserted here)."""
import importlib
import json
import os
import random
import subprocess
import sys


TOOLS = os.path.join(os.path.dirname(__file__), "..", "..", "tools")
sys.path.insert(0, TOOLS)
agent_demo = importlib.import_module("agent_demo")


def test_careless_teacher_answers_from_its_head_and_miscopies_in_its_shares():
    from megatron_rl.agent.calculator import calculator_tool
    from megatron_rl.agent.parsing import parse_tool_calls
    from megatron_rl.agent.tools import OK, ToolRegistry, execute_tool_call

    tools = ToolRegistry([calculator_tool()])
    rng = random.Random(0)
    kinds: dict[str, int] = {}
    n = 4000
    for _ in range(n):
        a, b = rng.randint(100, 999), rng.randint(10, 99)
        kind, turns = agent_demo.teacher_trace(a, b, rng)
        kinds[kind] = kinds.get(kind, 0) + 1
        if kind == "head":  # no call, a wrong product
            assert len(turns) == 1 and turns[0] != str(a * b) and len(turns[0]) == len(str(a * b))
            continue
        call, answer = turns
        assert call.startswith(agent_demo.CALL_OPEN) and call.endswith("</tool_call>")
        result = execute_tool_call(tools, parse_tool_calls(call)[0])
        assert result.outcome == OK and answer is None  # the tool's answer is copied out
        assert (result.text == str(a * b)) == (kind == "right"), (kind, call, result.text)
    for kind, share in agent_demo.TEACHER.items():
        assert abs(kinds[kind] / n - share) < 0.03, kinds


def _run(tool: str, out, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, os.path.join(TOOLS, tool), "--out", str(out), *args],
                          env=env, capture_output=True, text=True, timeout=600)


def test_agent_demo_runs_end_to_end(tmp_path):
    """A few supervised and RL steps: the summary, the plot and the per-step tool metrics."""
    r = _run("agent_demo.py", tmp_path, "--sft-steps", "5", "--rl-steps", "2",
             "--prompts-per-step", "2", "--eval-interval", "2", "--eval-prompts", "8",
             "--eval-samples", "2")
    # status 1: no gain beyond noise, as after 5 supervised steps
    assert r.returncode in (0, 1) and "Traceback" not in r.stderr, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["rl_steps"] == 2 and summary["eval_prompts"] == 8
    assert os.path.getsize(tmp_path / "agent_demo.png") > 0
    rows = [json.loads(line) for line in open(tmp_path / "rl" / "metrics.jsonl")]
    assert all("rollout/agent/turns" in r for r in rows if "reward/mean" in r)
    assert "95% interval" in r.stdout


def test_cpu_demo_compare_placements_runs_end_to_end(tmp_path):
    """Each placement's run from the one base, its table and its figure."""
    r = _run("cpu_demo.py", tmp_path, "--sft-steps", "5", "--compare-placements",
             "--compare-steps", "2", "--eval-interval", "2", "--eval-prompts", "8",
             "--eval-samples", "2", "--prompts-per-step", "2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.load(open(tmp_path / "placements" / "summary.json"))
    assert list(summary["runs"]) == list(importlib.import_module("cpu_demo").PLACEMENTS)
    assert os.path.getsize(tmp_path / "placements.png") > 0
    assert "K3 in the loss" in r.stdout
