"""Every logged metric is the global batch's: two data-parallel ranks holding one half each log
what one rank holding the whole batch logs (megatron_rl.metrics over gloo)."""
import importlib.util
import json
import os

import pytest

pytestmark = pytest.mark.distributed

WORKER = os.path.join(os.path.dirname(__file__), "metrics_worker.py")


def _metrics(out: str) -> dict:
    line = next(l for l in out.splitlines() if l.startswith("METRICS "))
    return json.loads(line[len("METRICS "):])


def test_dp2_logs_dp1_values_for_the_same_global_batch(torchrun):
    one, two = _metrics(torchrun(1, [WORKER])), _metrics(torchrun(2, [WORKER]))
    assert set(one) == set(two) and len(one) >= 20
    for k, v in one.items():
        assert two[k] == pytest.approx(v, rel=1e-6, abs=1e-9), k  # fp32 inputs, other sum order


def test_ratio_extremes_are_those_of_every_microbatch_of_every_rank(torchrun):
    """ratio_max / ratio_min (and the sequence ratio's) are logged, as the maximum / minimum
    over the microbatches of both ranks, not averaged."""
    spec = importlib.util.spec_from_file_location("metrics_worker", WORKER)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    results = worker.global_batch()[7]
    logged = _metrics(torchrun(2, [WORKER]))
    for k, pick in [("ratio_max", max), ("seq_ratio_max", max), ("ratio_min", min),
                    ("seq_ratio_min", min)]:
        assert logged[k] == pytest.approx(pick(float(r[k]) for r in results), rel=1e-6), k
