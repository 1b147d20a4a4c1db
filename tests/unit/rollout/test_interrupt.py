"""rollout/interrupt.py: the gate a weight update shares with the requests in flight, and the
continuation of the responses it cut (the engines' own tests: tests/e2e/test_partial_rollouts.py,
tests/e2e/test_server_partial_rollouts.py)."""
import threading
import time

import torch

from megatron_rl.rollout.base import Completion
from megatron_rl.rollout.interrupt import UpdateGate, continue_interrupted, label


def test_a_cut_ends_reading_and_a_request_waits_for_the_new_version():
    served = {"v": 3}
    gate = UpdateGate(lambda: served["v"])
    ticket = gate.enter()
    assert (ticket.epoch, ticket.version) == (0, 3)
    with gate.reading(ticket) as live:
        assert live
    entered = []
    with gate.updating():
        gate.cut()
        with gate.reading(ticket) as live:
            assert not live  # nothing read after the cut is kept
        waiter = threading.Thread(target=lambda: entered.append(gate.enter()))
        waiter.start()
        time.sleep(0.1)
        assert not entered and gate.updating_now  # a new request waits for the weights
        served["v"] = 4
    waiter.join(5)
    assert [(t.epoch, t.version) for t in entered] == [(1, 4)]
    with gate.reading(entered[0]) as live:
        assert live


def _c(tokens, finish, version, experts=None):
    c = Completion(list(tokens), [-0.5] * len(tokens), finish, routed_experts=experts)
    label([[c]], version)
    return c


def test_continuation_groups_by_length_and_goes_on_until_each_response_ends():
    prompts = [[1, 2], [3]]
    # prompt 0: cut after 2 and after 1 token; prompt 1: one finished, one cut after 2
    flat = [_c([10, 11], "abort", 0), _c([12], "abort", 0), _c([13, 14, 15], "stop", 0),
            _c([16, 17], "abort", 0)]
    calls = []

    def resume(ask, budget, row):
        calls.append((ask, budget, row))
        version = len(calls)
        if len(calls) == 1:  # the one cut after 1 token is cut again after 1 more
            return [[_c([20], "abort", version)]]
        return [[_c([30 + i] * budget, "length", version)] for i in range(len(ask))]

    made = continue_interrupted(prompts, flat, 2, 4, resume)
    # cut after 1 first (one request), then after 2 (two responses, one request), then the
    # response cut twice, after 2 again
    assert calls == [([[1, 2, 12]], 3, 1), ([[1, 2, 10, 11], [3, 16, 17]], 2, 0),
                     ([[1, 2, 12, 20]], 2, 1)]
    assert made == 4
    assert flat[0].token_ids == [10, 11, 30, 30] and flat[0].token_versions == [0, 0, 2, 2]
    assert flat[1].token_ids == [12, 20, 30, 30] and flat[1].token_versions == [0, 1, 3, 3]
    assert flat[2].token_ids == [13, 14, 15] and flat[2].finish_reason == "stop"
    assert flat[3].token_ids == [16, 17, 31, 31] and flat[3].finish_reason == "length"
    assert all(len(c.rollout_logprobs) == len(c.token_ids) == len(c.token_versions)
               for c in flat)


def test_a_response_cut_with_its_budget_spent_ends_length():
    flat = [_c([1, 2, 3], "abort", 0)]
    assert continue_interrupted([[9]], flat, 1, 3, lambda ask, budget, row: 1 / 0) == 0
    assert flat[0].finish_reason == "length"


def test_routed_experts_of_the_continuation_start_at_the_prefix_last_token():
    # prompt of 2 and 2 tokens cut: routes for positions 0..2 (the last token is fed in later)
    first = _c([5, 6], "abort", 0, experts=torch.zeros(3, 1, 2, dtype=torch.int16))

    def resume(ask, budget, row):
        # the continuation forwards prompt + prefix (4 tokens) and its 2 tokens but the last
        routes = torch.arange(5, dtype=torch.int16)[:, None, None].expand(5, 1, 2)
        return [[_c([7, 8], "length", 1, experts=routes)]]

    continue_interrupted([[1, 2]], [first], 1, 4, resume)
    assert first.routed_experts[:, 0, 0].tolist() == [0, 0, 0, 3, 4]


def test_a_server_continues_each_response_in_a_request_of_its_own_at_once():
    flat = [_c([10, 11], "abort", 0), _c([12], "abort", 0), _c([13], "stop", 0)]
    barrier = threading.Barrier(2, timeout=5)  # both requests in flight together
    calls = []

    def resume(ask, budget, row):
        barrier.wait()
        calls.append((ask, budget, row))
        return [[_c([40 + row] * budget, "length", 1)]]

    assert continue_interrupted([[1], [2]], flat, 2, 3, resume, concurrent=True) == 2
    assert sorted(calls) == [([[1, 10, 11]], 1, 0), ([[1, 12]], 2, 1)]
    assert [c.token_ids for c in flat] == [[10, 11, 40], [12, 41, 41], [13]]
