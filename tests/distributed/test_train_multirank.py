"""`train()` end to end on two ranks under gloo: DP2 (two replicas, each with half of the
prompts) runs 2 RL steps with the local engine and saves a checkpoint. The checkpoint is
complete (every rank's part, `latest` pointing at it) and loadable: exported to HF from one
process, its weights are finite and are not the initial ones; the trainer resumes from it for a
third step. metrics.jsonl has one finite row per step.

TP2xPP2 logs TP1's metrics for 3 steps: one rank of each model-parallel group samples and the
group follows, so every layout draws the same tokens (TP2 alone, saved and resumed across two
launched nodes: test_multinode_launch.py; a TP-sharded checkpoint exported to HF:
test_parallel_equivalence.py). DP ranks of the local engine sample their shares with their own
seeds, so DP2's local-engine batch is not DP1's; the data-parallel reduction of every logged
metric is tested in test_metrics_reduction.py. With the process engine the whole batch is
sampled once, in one child: DP2 logs DP1's metrics end to end (a client rank under model
parallelism: the vLLM test below, whose engine has one too)."""
import json
import math
import os

import pytest
import torch

pytestmark = pytest.mark.distributed

# DP2's save from both ranks and its resume: test_preemption_multirank.py; TP2's across two nodes:
# test_multinode_launch.py; a sharded checkpoint exported to HF: test_parallel_equivalence.py
@pytest.mark.extended
def test_two_rank_train_runs_two_steps_and_saves(char_model, char_ref, arithmetic_jsonl,
                                                 tmp_path, torchrun, export_hf):
    from megatron_rl.models import hf_mapping

    save = str(tmp_path / "run")

    def train(iters):
        # KL to another model, in the reward and in the loss: the weights move from step 1
        torchrun(2, ["-m", "megatron_rl.train", "--hf-checkpoint", char_model,
                     "--ref-checkpoint", char_ref, "--kl-coef", "1.0",
                     "--train-data", arithmetic_jsonl, "--save", save, "--train-iters", str(iters),
                     "--num-prompts-per-step", "4", "--group-size", "2", "--max-new-tokens", "3",
                     "--lr", "1e-2", "--micro-batch-size", "4", "--prompt-template", "{prompt}=",
                     "--no-task-instruction", "--seed", "3", "--save-interval", "2",
                     "--kl-placement", "reward+loss", "--kl-estimator", "k3"], timeout=300)

    train(2)

    with open(os.path.join(save, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert all(math.isfinite(v) for v in r.values()), r
        assert r["skipped_update"] == 0.0 and r["grad_norm"] > 1e-4 and r["kl_k1"] > 0.0, r

    # the checkpoint: complete, from both ranks, the latest one
    ckpt = os.path.join(save, "iter_0000002")
    assert open(os.path.join(save, "latest")).read().strip() == "iter_0000002"
    assert not any(n.startswith(".tmp-") for n in os.listdir(save))
    for rank in (0, 1):
        extra = torch.load(os.path.join(ckpt, f"extra_rank{rank}.pt"), weights_only=False)
        assert extra["step"] == 2

    # loadable: one process reads it back (resharded to TP1) and exports HF weights
    init, trained = (hf_mapping.load_hf_state_dict(char_model),
                     export_hf(save, str(tmp_path / "hf")))
    assert set(trained) == set(init)
    for k in init:
        assert trained[k].shape == init[k].shape and torch.isfinite(trained[k]).all(), k
    assert any(not torch.equal(trained[k], init[k]) for k in init)  # the 2 steps were saved

    # and the trainer itself resumes from it in the same layout (weights, optimizer, rng, data)
    train(3)
    with open(os.path.join(save, "metrics.jsonl")) as f:
        resumed = [json.loads(line) for line in f]
    assert resumed[:2] == rows and [r["step"] for r in resumed] == [1, 2, 3]
    assert all(math.isfinite(v) for v in resumed[2].values()), resumed[2]


def _train_metrics(torchrun, nproc, save, model, ref, data, layout_flags, iters=3):
    torchrun(nproc, ["-m", "megatron_rl.train", "--hf-checkpoint", model, "--ref-checkpoint", ref,
                     "--kl-coef", "1.0", "--kl-placement", "reward+loss", "--kl-estimator", "k3",
                     "--train-data", data, "--save", save, "--train-iters", str(iters),
                     "--num-prompts-per-step", "4", "--group-size", "2", "--max-new-tokens", "4",
                     "--lr", "1e-2", "--micro-batch-size", "4", "--prompt-template", "{prompt}=",
                     "--no-task-instruction", "--seed", "5", *layout_flags], timeout=300)
    with open(os.path.join(save, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_model_parallel_layouts_log_tp1_metrics(char_model, char_ref, arithmetic_jsonl, tmp_path,
                                                torchrun, tp1_metrics):
    """3 RL steps at TP1 and TP2xPP2 (local engine): the same samples (rewards, lengths: equal)
    and the same losses, KL and gradient norms up to float reduction order."""
    run = lambda n, name, flags: _train_metrics(torchrun, n, str(tmp_path / name), char_model,  # noqa: E731
                                                char_ref, arithmetic_jsonl, flags)
    tp1 = tp1_metrics
    layouts = {"tp2pp2": run(4, "tp2pp2", ["--tensor-model-parallel-size", "2",
                                           "--pipeline-model-parallel-size", "2"])}
    assert [r["step"] for r in tp1] == [1, 2, 3] and tp1[-1]["grad_norm"] > 1e-4
    for name, rows in layouts.items():
        assert [r["step"] for r in rows] == [1, 2, 3], name
        for a, b in zip(tp1, rows):
            for key in ("reward/mean", "response/length_mean", "response/truncated_fraction"):
                assert b[key] == a[key], (name, a["step"], key)
            # the weights differ by float reduction order (~1e-7), which Adam's normalised step
            # at lr 1e-2 grows to ~1e-4 relative by step 3
            for key in ("kl_k1", "kl_k3", "pg_loss", "entropy", "grad_norm", "kl_forward"):
                assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-6), (name, a["step"], key)


def test_process_engine_batches_do_not_depend_on_the_layout(char_model, char_ref,
                                                            arithmetic_jsonl, tmp_path, torchrun):
    """--rollout-engine process samples each step's whole batch in one child process with the
    step's seed, then scatters it: DP2 (each replica trains on half of it) logs DP1's samples,
    losses, KL and gradient norms for 3 steps, and both call the engine once per step."""
    flags = ["--rollout-engine", "process"]
    run = lambda n, name, extra: _train_metrics(torchrun, n, str(tmp_path / name), char_model,  # noqa: E731
                                                char_ref, arithmetic_jsonl, flags + extra)
    dp1 = run(1, "dp1", [])
    layouts = {"dp2": run(2, "dp2", [])}
    assert dp1[-1]["grad_norm"] > 1e-4
    for name, rows in {"dp1": dp1, **layouts}.items():
        assert [r["rollout/generate_calls"] for r in rows] == [1.0, 2.0, 3.0], name
    for name, rows in layouts.items():
        assert [r["step"] for r in rows] == [1, 2, 3], name
        for a, b in zip(dp1, rows):
            for key in ("reward/mean", "response/length_mean", "response/truncated_fraction"):
                assert b[key] == a[key], (name, a["step"], key)
            for key in ("kl_k1", "kl_k3", "pg_loss", "entropy", "grad_norm", "kl_forward"):
                assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-6), (name, a["step"], key)


@pytest.mark.server
# the client rank under model parallelism: the process engine above; weights gathered from a
# TP x PP layout: test_weight_gather.py
@pytest.mark.extended
@pytest.mark.shared_server("vllm")
def test_vllm_engine_model_parallel_layouts_log_tp1_metrics(arithmetic_jsonl, tmp_path, torchrun,
                                                            served_models, shared_servers):
    """TP1 and TP2xPP2 trainers against a real vLLM server (attached, --rollout-url): global
    rank 0 is the one client (one generate request per step, whatever the layout), the batch is
    broadcast to the model-parallel group and the weights gathered from every rank (both
    tensor-parallel halves of both stages) reach the server. Both log the same samples and
    TP1's losses for 3 steps."""
    policy, ref = served_models  # vLLM's CPU attention needs head_dim >= 32; TP2 splits 2 KV heads

    def run(n, name, flags):  # each trainer starts with the server serving the initial weights
        return _train_metrics(torchrun, n, str(tmp_path / name), policy, ref, arithmetic_jsonl,
                              ["--rollout-engine", "vllm", "--rollout-url",
                               shared_servers.vllm(), *flags])

    tp1 = run(1, "tp1", [])
    layouts = {"tp2pp2": run(4, "tp2pp2", ["--tensor-model-parallel-size", "2",
                                           "--pipeline-model-parallel-size", "2"])}
    assert tp1[-1]["grad_norm"] > 1e-4
    for name, rows in {"tp1": tp1, **layouts}.items():
        assert [r["rollout/generate_calls"] for r in rows] == [1.0, 2.0, 3.0], name
        assert all(r["mismatch/abs_delta_max"] < 1e-3 for r in rows), name  # synced weights
    for name, rows in layouts.items():
        for a, b in zip(tp1, rows):
            for key in ("reward/mean", "response/length_mean", "response/truncated_fraction"):
                assert b[key] == a[key], (name, a["step"], key)
            for key in ("kl_k1", "kl_k3", "pg_loss", "entropy", "grad_norm", "kl_forward"):
                assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-6), (name, a["step"], key)


# the partition at every data-parallel size, packed or not, without a run:
# tests/unit/test_packing.py::test_a_ppo_minibatch_holds_the_same_groups_at_every_data_parallel_size_and_packing
@pytest.mark.extended
def test_a_resume_onto_two_ranks_continues_the_single_rank_run(char_model, char_ref, tmp_path,
                                                               torchrun):
    """A run preempted at DP1 and resumed at DP2 (packed, two PPO minibatches; the process
    engine samples the whole batch with the step's seed) logs the uninterrupted DP1 run's
    steps: each minibatch holds the same groups on any number of ranks. The prompts' lengths
    differ, so packing's dealing by token count does not follow the groups' order."""
    from megatron_rl.data.records import TaskExample, write_jsonl

    data = str(tmp_path / "lengths.jsonl")
    write_jsonl(data, [TaskExample(f"Calculate {a}+{b}.", str(a + b), "arithmetic")
                       for a in (1, 23, 456, 7890, 12345, 678901, 2345678, 90123456)
                       for b in range(8)])
    flags = ["--rollout-engine", "process", "--ppo-minibatches", "2", "--num-prompts-per-step", "8"]
    run = lambda n, name, iters: _train_metrics(torchrun, n, str(tmp_path / name), char_model,  # noqa: E731
                                                char_ref, data, flags, iters)
    whole = run(1, "whole", 3)
    run(1, "resumed", 1)
    resumed = run(2, "resumed", 3)
    assert [r["step"] for r in resumed] == [1, 2, 3] and whole[-1]["grad_norm"] > 1e-4
    for a, b in zip(whole[1:], resumed[1:]):
        for key in ("reward/mean", "response/length_mean", "response/truncated_fraction"):
            assert b[key] == a[key], (a["step"], key)
        for key in ("kl_k1", "kl_k3", "pg_loss", "entropy", "grad_norm", "kl_forward"):
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-6), (a["step"], key)
