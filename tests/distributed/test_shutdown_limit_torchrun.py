"""Inside a real torchrun worker, the trainer finds the limit torchrun's agent was given: torchrun
marks its workers (TORCHELASTIC_RUN_ID), its --shutdown-timeout is read from the agent's command
line and wins over TORCH_ELASTIC_SHUTDOWN_TIMEOUT, as in torchrun (the other sources, and the
warnings, are covered by tests/unit/test_shutdown_limit.py)."""
import pytest

pytestmark = pytest.mark.distributed

PROBE = """
import time, warnings
from megatron_rl.stopping import StopRequests, torchrun_shutdown_limit
limit = torchrun_shutdown_limit()
print(f"LIMIT {limit.seconds:g} {limit.source}" if limit else "LIMIT none", flush=True)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with StopRequests(True, 0.0, time.monotonic()):
        pass
print("WARNED", len(caught), *(str(w.message)[:40] for w in caught), flush=True)
"""


def test_a_worker_reads_the_limit_torchrun_was_given(tmp_path, torchrun, monkeypatch):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "11")
    out = torchrun(1, ["--shutdown-timeout=7", str(probe)], timeout=120)
    assert "LIMIT 7 torchrun --shutdown-timeout=7" in out, out[-3000:]
    assert "WARNED 0" in out, out[-3000:]  # a limit the user set: nothing to say at startup
