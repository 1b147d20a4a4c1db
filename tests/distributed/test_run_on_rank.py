"""Work one rank does alone (a rollout client's generation, scoring, evaluation) may take longer
than the process groups' timeout (--distributed-timeout-minutes): the ranks that wait for it
wait outside the collectives (parallel.run_on_rank, base.on_client) and get its result, and a
failure there reaches them at once as an error naming that rank. Two gloo ranks under torchrun,
a 6 s timeout, rank 0 working 9 s (run_on_rank_worker.py)."""
import json
import os

import pytest

pytestmark = pytest.mark.distributed

WORKER = os.path.join(os.path.dirname(__file__), "run_on_rank_worker.py")
TIMEOUT_S = 6.0


@pytest.fixture(scope="module")
def results(torchrun) -> dict:
    """{(phase, rank): the fields that rank reported} from one two-rank run of the worker."""
    rows = _results(torchrun(2, [WORKER], timeout=120))
    return {(r.pop("phase"), r.pop("rank")): r for r in rows}


def _results(out: str) -> list[dict]:
    """Every `RESULT {json}` the ranks printed: found anywhere in the output, since two ranks
    writing at once can put one's line right after the other's, without a newline between."""
    decoder, rows, at = json.JSONDecoder(), [], out.find("RESULT ")
    while at >= 0:
        row, end = decoder.raw_decode(out, at + len("RESULT "))
        rows.append(row)
        at = out.find("RESULT ", end)
    return rows


def test_a_client_longer_than_the_timeout_gives_every_rank_its_result(results):
    expected = {"prompts": [[1, 2, 3]], "rewards": [1.0, 0.0]}
    for rank in (0, 1):
        slow = results[("slow", rank)]
        assert slow["result"] == expected
        assert slow["seconds"] > TIMEOUT_S  # the wait did outlast the groups' timeout
    # ... which is the flag's, in the default group and megatron-core's groups alike, and
    # which a wait inside a collective does not survive
    for rank in (0, 1):
        assert results[("groups", rank)]["seconds"] == {
            "default": TIMEOUT_S, "data_parallel": TIMEOUT_S, "model_parallel": TIMEOUT_S}
    plain = results[("plain", 1)]
    assert plain["raised"] is not None and "timed out" in plain["message"].lower()
    assert TIMEOUT_S - 1 < plain["seconds"] < TIMEOUT_S + 2.5


def test_a_client_error_reaches_the_waiting_rank_at_once(results):
    client, waiter = results[("error", 0)], results[("error", 1)]
    assert client["raised"] == "ValueError"  # the client raises its own exception
    assert waiter["raised"] == "RankFailed"
    assert waiter["message"] == ("rank 0 failed while generating step 7's batch: ValueError: "
                                 "the server sent 3 completions for 4 prompts")
    assert waiter["seconds"] < TIMEOUT_S / 2  # told, not timed out


def test_a_model_parallel_group_takes_its_first_ranks_answer(torchrun):
    """parallel.model_parallel_source (the agent loop's tool calls under the in-process engine
    at TP2): the function runs on the group's first rank alone, and both ranks get its result,
    so the group's next generate call has the same prompts on both."""
    worker = os.path.join(os.path.dirname(__file__), "model_parallel_source_worker.py")
    out = torchrun(2, [worker], timeout=120)
    rows = {r["rank"]: r for r in _results(out)}
    expected = {"answered_by": 0, "text": "tool output on rank 0"}
    assert rows[0] == {"rank": 0, "got": expected, "ran": [0]}
    assert rows[1] == {"rank": 1, "got": expected, "ran": []}
