"""Multi-node launching, on one machine.

Two "nodes": `scripts/launch_multinode.sh` run twice, as two torchrun agents (NNODES=2, one
process each, a c10d rendezvous on 127.0.0.1), train one TP2 model split across them under
gloo: 2 RL steps with a checkpoint, then a resume for a third. Before the save and after the
resume the run logs the metrics of an uninterrupted single-process TP1 run, to the tolerance
test_train_multirank.py allows TP2 against TP1.

An attached rollout server: a vLLM server started by hand as its own process (the command
docs/launch.md gives for a server on another node), and a trainer attached to it with
`--rollout-url`; the server serves the weights of every step.
"""
import json
import os
import subprocess
import sys
import time

import pytest

# tests/distributed/test_train_multirank.py: its training flags and metrics file
from test_train_multirank import _train_metrics

from megatron_rl.rollout.net import free_port

pytestmark = pytest.mark.distributed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCH = os.path.join(REPO, "scripts", "launch_multinode.sh")
# what every layout samples alike, and what differs only by float reduction order (grown by
# Adam's normalised step at lr 1e-2 to ~1e-4 relative by step 3): as test_train_multirank.py
EXACT = ("reward/mean", "response/length_mean", "response/truncated_fraction")
CLOSE = ("kl_k1", "kl_k3", "pg_loss", "entropy", "grad_norm", "kl_forward")


def two_nodes(nproc: int, args: list[str], timeout: int = 300) -> str:
    """Stands in for the `torchrun` fixture: `python -m megatron_rl.train ARGS` over 2 nodes of
    nproc // 2 processes, each node `scripts/launch_multinode.sh` with its own NODE_RANK, meeting
    at a c10d store on a free local port."""
    assert args[:2] == ["-m", "megatron_rl.train"] and nproc % 2 == 0, args
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", NNODES="2",
               GPUS_PER_NODE=str(nproc // 2), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               RDZV_BACKEND="c10d", RDZV_ID=f"test-{port}",
               TORCHRUN=f"{sys.executable} -m torch.distributed.run")
    agents = [subprocess.Popen(["bash", LAUNCH, *args[2:]], env=dict(env, NODE_RANK=str(rank)),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
              for rank in (0, 1)]
    outs = []
    try:
        for agent in agents:
            outs.append(agent.communicate(timeout=timeout)[0])
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, 9)
                agent.wait()
    if any(a.returncode != 0 for a in agents):
        pytest.fail("\n".join(f"node {r} exited {a.returncode}:\n{out[-4000:]}"
                              for r, (a, out) in enumerate(zip(agents, outs))))
    for rank, out in enumerate(outs):
        assert f"[launch] node {rank}/2" in out and "c10d rendezvous" in out, out[-2000:]
    return "\n".join(outs)


def test_two_node_tp2_saves_resumes_and_logs_tp1_metrics(tmp_path, char_model, char_ref,
                                                         arithmetic_jsonl, tp1_metrics):
    tp2 = ["--tensor-model-parallel-size", "2"]
    run = lambda launch, nproc, name, iters, flags: _train_metrics(
        launch, nproc, str(tmp_path / name), char_model, char_ref, arithmetic_jsonl, flags,
        iters=iters)

    t0 = time.monotonic()
    tp1 = tp1_metrics  # the uninterrupted TP1 run (3 steps)
    first = run(two_nodes, 2, "tp2", 2, tp2 + ["--save-interval", "2"])
    save = tmp_path / "tp2"
    assert (save / "latest").read_text().strip() == "iter_0000002"
    for rank in (0, 1):  # each node wrote its part of the checkpoint
        assert (save / "iter_0000002" / f"extra_rank{rank}.pt").exists()
    resumed = run(two_nodes, 2, "tp2", 3, tp2 + ["--save-interval", "2"])
    print(f"two-node TP2 (2 steps, save, resume for the 3rd) in {time.monotonic() - t0:.1f} s")

    assert [r["step"] for r in tp1] == [1, 2, 3] and tp1[-1]["grad_norm"] > 1e-4
    assert resumed[:2] == first and [r["step"] for r in resumed] == [1, 2, 3]
    # the uninterrupted TP1 run: steps 1-2 before the save, step 3 after the resume (it needs
    # the weights, Adam moments, RNG and data position back to sample and step alike)
    for a, b in zip(tp1, resumed):
        for key in EXACT:
            assert b[key] == a[key], (a["step"], key)
        for key in CLOSE:
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-6), (a["step"], key)


@pytest.mark.server
@pytest.mark.extended  # attached servers: tests/e2e (tensor sync); disk sync: test_vllm_engine
@pytest.mark.shared_server("vllm")
def test_trainer_attached_to_a_separately_started_vllm_server(tmp_path, served_models,
                                                              shared_servers):
    """The server runs as its own process with the flags docs/launch.md gives for a server on
    another node (tests/conftest.py: vllm_server_argv); the trainer only knows its URL. Weights
    go by disk sync: the trainer exports each step's weights under --save and the server
    reloads them from that path, so trainer and server need one file system (here the same
    machine; across nodes a shared mount). The server's log-probs match the trainer's
    recomputation at every step (it serves the current weights); afterwards its workers report
    the last synced version and its log-probs are those of the last export."""
    from megatron_rl.data.records import TaskExample, write_jsonl
    from megatron_rl.rollout.base import SamplingParams
    from megatron_rl.rollout.vllm_engine import VLLMConfig, VLLMEngine

    model, ref = served_models
    data = str(tmp_path / "train.jsonl")
    write_jsonl(data, [TaskExample(f"Calculate {a}+{b}.", str(a + b), "arithmetic")
                       for a in range(8) for b in range(8)])
    url = shared_servers.vllm()
    save = str(tmp_path / "run")
    args = ["--hf-checkpoint", model, "--ref-checkpoint", ref, "--train-data", data,
            "--save", save, "--train-iters", "2", "--num-prompts-per-step", "4",
            "--group-size", "2", "--max-new-tokens", "3", "--lr", "1e-2",
            "--micro-batch-size", "8", "--prompt-template", "{prompt}=",
            "--no-task-instruction", "--seed", "3", "--kl-placement", "reward+loss",
            "--kl-estimator", "k3", "--kl-coef", "1.0",
            "--rollout-engine", "vllm", "--rollout-url", url, "--weight-sync", "disk"]
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.train", *args],
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(os.path.join(save, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["grad_norm"] > 1e-4 for r in rows)  # the weights change every step
    for r in rows:  # step 2 was sampled from step 1's weights, synced by path
        assert r["mismatch/abs_delta_max"] < 1e-3, (r["step"], r["mismatch/abs_delta_max"])

    # the trainer is gone, the server stays: a client attached as the trainer was finds the
    # last synced version in its workers and samples with the last export's log-probs
    exported = os.path.join(save, "vllm", "weights")
    final = os.path.join(exported, max(os.listdir(exported)))  # v000002
    client = VLLMEngine(final, VLLMConfig(work_dir=str(tmp_path / "client"), url=url))
    assert client.server_weight_version() == 2
    prompt = [5, 17, 30, 42]
    sample = client.generate([prompt], 1, SamplingParams(max_new_tokens=4, seed=0))[0][0]
    delta = lambda hf: max(abs(a - b) for a, b in zip(
        _hf_logprobs(hf, prompt, sample.token_ids), sample.rollout_logprobs))
    assert delta(final) < 1e-3 and delta(model) > 1e-2  # the trained weights, not the initial


def _hf_logprobs(hf_dir: str, prompt: list[int], response: list[int]) -> list[float]:
    """transformers' log-probs of `response` after `prompt` under the HF weights in hf_dir."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    seq = torch.tensor([prompt + response])
    with torch.no_grad():
        lp = torch.log_softmax(model(seq).logits[0, len(prompt) - 1:-1].float(), -1)
    return lp.gather(-1, seq[0, len(prompt):, None]).squeeze(-1).tolist()
