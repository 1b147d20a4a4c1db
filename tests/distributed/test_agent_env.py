"""Agent environments under model parallelism with the in-process engine (the agent loop runs
on every rank of the group): the environments are made and stepped on the group's first rank
alone, and every rank gets their answers and failures, so that the group's generate calls stay
identical, and every rank stops alike when the environment fails too often
(agent_env_worker.py, two gloo ranks, TP2)."""
import json
import os
import re

import pytest

pytestmark = pytest.mark.distributed


def test_the_groups_first_rank_runs_the_environments_for_both(torchrun):
    out = torchrun(2, [os.path.join(os.path.dirname(__file__), "agent_env_worker.py")],
                   timeout=120)
    decoder, rows, at = json.JSONDecoder(), {}, out.find("RESULT ")
    while at >= 0:
        row, end = decoder.raw_decode(out, at + len("RESULT "))
        rows[row["rank"]] = row
        at = out.find("RESULT ", end)
    assert rows[0]["made"] == [0, 0, 0, 0] and rows[1]["made"] == []
    assert rows[0]["rows"] == rows[1]["rows"]
    good, _, bad, _ = rows[1]["rows"]
    text, mask, reward, end = good
    assert text == "7<eos>\nrank 0 says go on\n7<eos>" and (reward, end) == (1.0, "answer")
    assert mask.count(0) == len("\nrank 0 says go on\n")
    assert bad == ["", [], 0.0, "env_error"]
    # more failures than --agent-max-env-failures: both ranks stop, with the same message
    stopped = rows[0]["stopped"]
    assert stopped == rows[1]["stopped"]
    assert stopped.startswith("agent environment __main__:RankEnv (--agent-environment) failed 2 "
                              "of 4 episodes of this rollout, more than --agent-max-env-failures "
                              "0.25 of them; the first: reset on record bad raised ValueError: "
                              "no such game (at "), stopped
    assert re.search(r"agent_env_worker\.py:\d+ in reset\)$", stopped), stopped
