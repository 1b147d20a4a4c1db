"""megatron_rl.progress: plain lines on a file or pipe (count, content, timing), a tqdm bar on a
terminal."""
import io
import re

import pytest

from megatron_rl import progress as progress_mod
from megatron_rl.progress import progress


class FakeClock:
    """Stands in for time.monotonic: the time moves only when a test sets it."""

    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(progress_mod, "_clock", c)
    return c


class Tty(io.StringIO):
    def isatty(self):
        return True


def lines(stream):
    return stream.getvalue().splitlines()


def test_a_line_every_n_steps_and_a_final_line(clock):
    out = io.StringIO()
    seen = []
    bar = progress(range(100), "RL", every=10, interval=1e9, file=out)
    for i in bar:
        seen.append(i)
        clock.t += 0.5
        bar.set_postfix({"reward": 0.41234, "kl_k1": "0.002"})
    assert seen == list(range(100))
    got = lines(out)
    assert len(got) == 11  # steps 10, 20, ..., 100, then the final line
    assert "\r" not in out.getvalue()
    assert [re.match(r"RL: (\d+)/100 ", s).group(1) for s in got] == \
        [str(n) for n in range(10, 101, 10)] + ["100"]
    assert got[0] == "RL: 10/100 (10%) elapsed 00:05, eta 00:45, 2.00 it/s | reward=0.412, kl_k1=0.002"
    assert got[-1] == "RL: 100/100 (100%) done in 00:50, 2.00 it/s | reward=0.412, kl_k1=0.002"


def test_a_line_every_interval_when_steps_are_slow(clock):
    out = io.StringIO()
    for _ in progress(range(3), "SFT", unit="step", file=out):
        clock.t += 40.0  # past the 30 s interval at every step
    assert lines(out) == ["SFT: 1/3 (33%) elapsed 00:40, eta 01:20, 40.00 s/step",
                          "SFT: 2/3 (67%) elapsed 01:20, eta 00:40, 40.00 s/step",
                          "SFT: 3/3 (100%) elapsed 02:00, eta 00:00, 40.00 s/step",
                          "SFT: 3/3 (100%) done in 02:00, 40.00 s/step"]


def test_whichever_comes_first(clock):
    """every=5 and interval=30 s, steps of 1 s but one of 40 s: the count fires at step 5, the
    interval at step 7 (two steps later), the count again at step 12."""
    out = io.StringIO()
    for i in progress(range(12), "x", every=5, interval=30.0, file=out):
        clock.t += 40.0 if i == 6 else 1.0
    assert [int(re.match(r"x: (\d+)/", s).group(1)) for s in lines(out)] == [5, 7, 12, 12]


def test_resumed_run_counts_from_initial(clock):
    out = io.StringIO()
    for _ in progress(range(5, 10), "RL", total=10, initial=5, every=1, file=out):
        clock.t += 1.0
    got = lines(out)
    assert [s.split()[1] for s in got] == ["6/10", "7/10", "8/10", "9/10", "10/10", "10/10"]
    assert got[0] == "RL: 6/10 (60%) elapsed 00:01, eta 00:04, 1.00 it/s"
    assert got[-1] == "RL: 10/10 (100%) done in 00:05, 1.00 it/s"  # the 5 steps of this run


def test_default_every_is_a_twentieth_of_the_total(clock):
    out = io.StringIO()
    for _ in progress(range(1000), "data", file=out):
        pass
    assert len(lines(out)) == 21


def test_without_a_total_and_left_early(clock):
    out = io.StringIO()
    bar = progress((i for i in range(1000)), "gen", every=2, file=out)
    for i in bar:
        clock.t += 0.5
        if i == 4:
            break
    bar.close()
    bar.close()  # once only
    assert lines(out) == ["gen: 2 elapsed 00:01, 2.00 it/s", "gen: 4 elapsed 00:02, 2.00 it/s",
                          "gen: 4 done in 00:02, 1.60 it/s"]  # 4 steps counted in 2.5 s


def test_stopped_before_the_total(clock):
    out = io.StringIO()
    with progress(range(10), "RL", every=100, file=out) as bar:
        for i in bar:
            if i == 2:
                break
    assert lines(out) == ["RL: 2/10 (20%) stopped in 00:00, ? it/s"]  # no time has passed


def test_disabled_prints_nothing(clock):
    out = io.StringIO()
    bar = progress(range(50), "RL", disable=True, every=1, file=out)
    assert list(bar) == list(range(50))
    bar.set_postfix({"a": 1.0})
    assert out.getvalue() == ""


def test_a_terminal_gets_a_tqdm_bar(clock):
    out = Tty()
    bar = progress(range(4), "RL", total=4, file=out)
    assert bar._bar is not None
    for _ in bar:
        bar.set_postfix({"reward": "0.5"})
    text = out.getvalue()
    assert "\r" in text and "4/4" in text and "reward=0.5" in text


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="must be positive"):
        progress(range(3), every=0, file=io.StringIO())
