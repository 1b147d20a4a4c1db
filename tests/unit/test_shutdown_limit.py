"""torchrun's shutdown limit (stopping.torchrun_shutdown_limit): torchrun SIGKILLs its workers a
fixed time after it forwards a SIGTERM (30 s unless TORCH_ELASTIC_SHUTDOWN_TIMEOUT or
--shutdown-timeout says otherwise), so a stop whose step and save take longer saves nothing. A
worker cannot change the limit, only read it and warn: at startup when it is torchrun's default
or ignored, and once a step is measured to take longer."""
import time
import warnings

from megatron_rl import stopping
from megatron_rl.stopping import StopRequests, torchrun_shutdown_limit

UNDER_TORCHRUN = {"TORCHELASTIC_RUN_ID": "none", "LOCAL_RANK": "0"}
TORCHRUN = ["/venv/bin/python", "/venv/bin/torchrun", "--nproc-per-node", "2"]


def test_the_limit_is_read_as_torchrun_reads_it():
    assert torchrun_shutdown_limit({}, []) is None  # not started by torchrun: no such limit
    default = torchrun_shutdown_limit(UNDER_TORCHRUN, TORCHRUN, configurable=True)
    assert default is not None and default.seconds == 30 and default.is_default
    env = dict(UNDER_TORCHRUN, TORCH_ELASTIC_SHUTDOWN_TIMEOUT="900")
    limit = torchrun_shutdown_limit(env, TORCHRUN, configurable=True)
    assert limit is not None and limit.seconds == 900 and not limit.is_default
    # torchrun's own flag (or its PET_ variable) wins over the variable, as in torchrun
    flag = torchrun_shutdown_limit(env, TORCHRUN + ["--shutdown-timeout", "600", "-m", "x"],
                                   configurable=True)
    assert flag is not None and flag.seconds == 600
    pet = torchrun_shutdown_limit(dict(env, PET_SHUTDOWN_TIMEOUT="700"), TORCHRUN,
                                  configurable=True)
    assert pet is not None and pet.seconds == 700
    # a torch whose torchrun has no --shutdown-timeout waits 30 s whatever is set
    old = torchrun_shutdown_limit(env, TORCHRUN, configurable=False)
    assert old is not None and old.seconds == 30
    assert old.ignored == "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=900"


def _steps(monkeypatch, env, seconds):
    """StopRequests with the signal handler, in `env`, through step boundaries `seconds`
    apart (a fake clock); the warnings it gave."""
    for name in ("TORCHELASTIC_RUN_ID", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "PET_SHUTDOWN_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(stopping, "_torchrun_takes_shutdown_timeout", lambda: True)
    monkeypatch.setattr(stopping, "_parent_command_line", lambda: TORCHRUN)
    clock = [1000.0]
    monkeypatch.setattr(stopping.time, "monotonic", lambda: clock[0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with StopRequests(True, 0.0, time.monotonic()) as stops:
            for s in seconds:
                clock[0] += s
                assert stops.reason() is None
    # the stop requests' own warnings (a ResourceWarning of another test's file, collected at
    # any moment, is not one of them)
    return [str(w.message) for w in caught if not issubclass(w.category, ResourceWarning)]


def test_torchruns_default_is_warned_at_startup(monkeypatch):
    said = _steps(monkeypatch, UNDER_TORCHRUN, [1, 1])
    assert len(said) == 1, said
    assert "torchrun kills this rank 30 s after it forwards a SIGTERM" in said[0]
    assert "set TORCH_ELASTIC_SHUTDOWN_TIMEOUT" in said[0]
    assert "terminationGracePeriodSeconds" in said[0]


def test_a_step_longer_than_the_limit_is_warned_once_measured(monkeypatch):
    env = dict(UNDER_TORCHRUN, TORCH_ELASTIC_SHUTDOWN_TIMEOUT="120")
    assert _steps(monkeypatch, env, [5, 100, 110]) == []  # steps (and saves) within the limit
    # the first boundary starts the clock (the time before it is the setup's); then a step of
    # 130 s, another, and one of 10: one warning, naming the step's time and the limit
    said = _steps(monkeypatch, env, [5, 130, 140, 10])
    assert len(said) == 1, said
    assert said[0].startswith("a step took 130 s") and "the 120 s torchrun lets" in said[0]
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=120" in said[0]


def test_nothing_is_warned_outside_torchrun_or_without_the_signal_handler(monkeypatch):
    assert _steps(monkeypatch, {}, [5, 1000]) == []
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with StopRequests(False, 0.0, time.monotonic()) as stops:
            stops.reason()
    assert not caught  # --no-exit-signal-handler: a SIGTERM stops at once anyway


def test_only_the_first_rank_of_a_node_warns(monkeypatch):
    assert _steps(monkeypatch, dict(UNDER_TORCHRUN, LOCAL_RANK="1"), [5, 1000]) == []
