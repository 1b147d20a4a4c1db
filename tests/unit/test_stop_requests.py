"""StopRequests (stopping.py): what a signal asks of the training loop. The first SIGTERM or SIGINT
asks for a stop at the next step boundary; repeated SIGTERMs (torchrun forwards the scheduler's
to its workers) change nothing; a second Ctrl-C stops at once unless it is the copy that
torchrun forwards right after the first; the previous handlers come back afterwards."""
import os
import signal
import time

import pytest

from megatron_rl.stopping import StopRequests


def _send(sig):
    os.kill(os.getpid(), sig)
    time.sleep(0.05)  # the handler runs in the main thread between bytecodes


def test_sigterm_asks_for_a_stop_and_repeats_change_nothing():
    before = signal.getsignal(signal.SIGTERM)
    with StopRequests(True, 0.0, time.monotonic()) as stops:
        assert stops.reason() is None
        _send(signal.SIGTERM)
        _send(signal.SIGTERM)
        assert stops.reason() == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_second_ctrl_c_stops_at_once_unless_it_is_torchruns_copy(monkeypatch):
    monkeypatch.setattr(StopRequests, "REPEAT_SIGINT_S", 0.3)
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN in a shell's background job
    with StopRequests(True, 0.0, time.monotonic()) as stops:
        _send(signal.SIGINT)
        _send(signal.SIGINT)  # within REPEAT_SIGINT_S: the forwarded copy
        assert stops.reason() == "SIGINT"
        time.sleep(0.3)
        with pytest.raises(KeyboardInterrupt):
            _send(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before


def test_time_budget_and_no_handler():
    stops = StopRequests(False, 0.5 / 60, time.monotonic() - 1.0)  # 0.5 s budget, 1 s spent
    with stops:
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        assert stops.reason() == "--exit-duration-in-mins 0.00833333 spent"
    assert StopRequests(False, 0.0, time.monotonic() - 1e6).reason() is None


@pytest.mark.parametrize("how", ["flag", "config"])
def test_a_start_refused_for_its_flags_leaves_no_stop_marker(tmp_path, how):
    """A run stopped early (status 75, <save>/stopped_early), then a start whose flags are
    refused: the marker is gone, so a job that requeues on it (docs/launch.md) stops
    requeueing a run that cannot start."""
    from megatron_rl import train
    from megatron_rl.stopping import STOPPED_EARLY

    save = tmp_path / "run"
    save.mkdir()
    marker = save / STOPPED_EARLY
    marker.write_text('{"step": 3, "reason": "SIGTERM"}')
    if how == "flag":
        argv = ["--save", str(save), "--group-size", "five"]
    else:  # --save given by the config file, which holds a key no setting reads
        recipe = tmp_path / "recipe.yaml"
        recipe.write_text(f"save: {save}\nlearning_rate: 0.1\n")
        argv = ["--config", str(recipe)]
    with pytest.raises((SystemExit, ValueError)):
        train.main(argv)
    assert not marker.exists()
