"""Launching multi-process tests with torchrun on CPU (gloo, one thread per rank)."""
import os
import subprocess
import sys

import pytest

from megatron_rl.rollout.net import free_port


@pytest.fixture(scope="session")
def torchrun():
    """torchrun(nproc, [args...], timeout=...) runs `python -m torch.distributed.run` and fails
    the test with the ranks' output when it exits non-zero."""

    def run(nproc: int, args: list[str], timeout: int = 300) -> str:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        for _ in range(3):
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                   "--master-addr=127.0.0.1", f"--master-port={free_port()}", *args]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
            out = proc.stdout + proc.stderr
            # the free port was taken by another process (a concurrent test) before torchrun's
            # rendezvous bound it: no rank started, so the launch is tried again on another
            if not (proc.returncode and "EADDRINUSE" in out and "rendezvous" in out):
                break
        if proc.returncode != 0:
            pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}:\n{out[-6000:]}")
        return out

    return run


@pytest.fixture(scope="session")
def export_hf():
    """export_hf(save, out) exports the latest checkpoint of the run in `save` to an HF
    directory `out` from one process (`megatron_rl.convert megatron-to-hf`; dist_checkpointing
    reshards whatever layout saved it) and returns the exported state dict; the test fails
    with the converter's output when it exits non-zero."""
    from megatron_rl.models import hf_mapping

    def run(save: str, out: str) -> dict:
        proc = subprocess.run([sys.executable, "-m", "megatron_rl.convert", "megatron-to-hf",
                               "--load", save, "--save", out], capture_output=True, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
        if proc.returncode != 0:
            pytest.fail(f"megatron-to-hf --load {save} exited {proc.returncode}:\n"
                        f"{proc.stderr[-4000:]}")
        return hf_mapping.load_hf_state_dict(out)

    return run


@pytest.fixture(scope="session")
def arithmetic_jsonl(tmp_path_factory):
    """64 two-term additions ("Calculate a+b.") as prepared JSONL: the training runs' data."""
    from megatron_rl.data.records import TaskExample, write_jsonl

    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    write_jsonl(path, [TaskExample(f"Calculate {a}+{b}.", str(a + b), "arithmetic")
                       for a in range(8) for b in range(8)])
    return str(path)


@pytest.fixture(scope="session")
def char_model(tmp_path_factory):
    """A random tiny character-level model (seed 0) in HF format: the policy of training runs
    (4 heads, 2 KV groups: TP2 splits both)."""
    from megatron_rl.experiments.tiny_model import make_char_model

    return make_char_model(str(tmp_path_factory.mktemp("char_model")), 0)


@pytest.fixture(scope="session")
def char_ref(tmp_path_factory):
    """A different random model of the same shape as the reference: the KL term has a gradient
    from the first step (a random policy earns no reward on arithmetic)."""
    from megatron_rl.experiments.tiny_model import make_char_model

    return make_char_model(str(tmp_path_factory.mktemp("char_ref")), 1)


@pytest.fixture(scope="session")
def tp1_metrics(tmp_path_factory, torchrun, char_model, char_ref, arithmetic_jsonl):
    """The metrics.jsonl rows of test_train_multirank._train_metrics's run (3 RL steps, local
    engine) at TP1, one process: what every model-parallel layout of that run must log
    (test_train_multirank.py, test_multinode_launch.py). Run once per session."""
    from test_train_multirank import _train_metrics

    return _train_metrics(torchrun, 1, str(tmp_path_factory.mktemp("tp1")), char_model, char_ref,
                          arithmetic_jsonl, [])
