"""Shared pytest configuration: test tiers as markers, and hardware skips.

Markers: `distributed` (spawns processes / torch.distributed over gloo), `gpu` (needs CUDA;
skipped with a reason where it is absent), `slow` (deselect with -m "not slow"), `network`
(needs PyPI; skipped unless `--run-network` or MEGATRON_RL_NETWORK_TESTS=1), `server` (starts
real vLLM / SGLang server processes from their own venvs; skipped with a reason when absent),
`faults` (fault injection: the tests docs/faults.md names), `hostsync` (counts host
synchronisations of hot loops against budgets, megatron_rl.hostsync;
runs by default).
"""
import os
import re
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


def pytest_configure(config):
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


def pytest_collection_modifyitems(config, items):
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
