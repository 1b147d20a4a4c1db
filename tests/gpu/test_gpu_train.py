"""`megatron_rl.train.train()` on one GPU in bf16 with the local engine, for every KL placement:
3 RL steps with a checkpoint after step 2, then the same command again, which must resume from
that checkpoint and redo step 3 exactly as the uninterrupted run did.

Each run is its own process (as a torchrun rank would be), with deterministic algorithms
requested (torch.use_deterministic_algorithms(warn_only=True), CUBLAS_WORKSPACE_CONFIG). Both
step-3 computations start from the same weights (the resumed run loads what the first run had
after step 2, bf16 parameters and fp32 main parameters), so the samples and every forward
quantity (reward, KL, loss, entropy, response length) must be equal exactly. The gradient norm is
compared with rel 1e-4: it comes from backward kernels (attention, embedding) that may
accumulate with atomics where no deterministic kernel exists, which warn_only lets through.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest

from gpu_helpers import arithmetic_jsonl, char_model, train_args

pytestmark = pytest.mark.gpu
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# a run of train() in a fresh process; the last line reports the GPU memory it used
RUN = ("import sys, torch; torch.use_deterministic_algorithms(True, warn_only=True)\n"
       "from megatron_rl.config import parse_config\n"
       "from megatron_rl.train import train\n"
       "train(parse_config(sys.argv[1:]))\n"
       "print('max_memory_allocated', torch.cuda.max_memory_allocated())\n")
EXACT_KEYS = ("reward/mean", "response/length_mean", "kl_k1", "pg_loss", "entropy")
KL_FLAGS = {
    "reward": ["--kl-placement", "reward", "--kl-estimator", "k1"],
    "loss": ["--kl-placement", "loss", "--kl-estimator", "k3"],
    "reward+loss": ["--kl-placement", "reward+loss", "--kl-estimator", "k3"],
    "none": ["--kl-placement", "none"],
}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_train")
    return {"model": char_model(str(root / "model"), seed=0),
            "ref": char_model(str(root / "ref"), seed=1),  # a different reference: KL moves
            "data": arithmetic_jsonl(str(root / "train.jsonl"))}


def _run(args: list[str]) -> int:
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8", OMP_NUM_THREADS="2",
               PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-c", RUN, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (line,) = [l for l in proc.stdout.splitlines() if l.startswith("max_memory_allocated")]
    return int(line.split()[-1])


def _rows(save: str) -> list[dict]:
    with open(os.path.join(save, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _rewind_to(save: str, step: int) -> None:
    """Make the newest checkpoint the one of `step`, as if the run had been killed right after
    writing it (megatron_rl.checkpoint's layout: <save>/iter_XXXXXXX, <save>/latest)."""
    keep = f"iter_{step:07d}"
    assert os.path.isdir(os.path.join(save, keep)), sorted(os.listdir(save))
    for name in os.listdir(save):
        if name.startswith("iter_") and name > keep:
            shutil.rmtree(os.path.join(save, name))
    with open(os.path.join(save, "latest"), "w") as f:
        f.write(keep + "\n")


@pytest.mark.parametrize("placement", list(KL_FLAGS))
def test_train_bf16_three_steps_then_exact_resume(placement, inputs, tmp_path):
    save = str(tmp_path / "run")
    args = train_args(inputs["model"], inputs["data"], save, 3,
                      ["--bf16", "--rollout-engine", "local", "--kl-coef", "1.0",
                       "--save-interval", "2", *KL_FLAGS[placement]], ref=inputs["ref"])
    used = _run(args)
    assert used > 0, "train() allocated no GPU memory: it did not run on the GPU"
    first = _rows(save)
    assert [r["step"] for r in first] == [1, 2, 3]
    for r in first:
        assert all(v == v and abs(v) != float("inf") for v in r.values()), r
        assert r["skipped_update"] == 0.0, r
        # with a KL term the different reference moves the policy; without one, a step whose
        # rewards are all 0 (the random model finds no answer) has zero advantages and so an
        # exactly zero gradient
        if placement == "none" and r["reward/mean"] == 0.0:
            assert r["grad_norm"] == 0.0, r
        else:
            assert r["grad_norm"] > 0, r

    _rewind_to(save, 2)
    _run(args)
    resumed = _rows(save)
    # one step redone after the checkpoint: none lost, none repeated
    assert [r["step"] for r in resumed] == [1, 2, 3]
    assert resumed[:2] == first[:2]
    a, b = first[2], resumed[2]
    for key in EXACT_KEYS:
        assert b[key] == a[key], (placement, key, a[key], b[key])
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), placement
