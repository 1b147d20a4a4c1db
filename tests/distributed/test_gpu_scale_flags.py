"""GPU-scale flags under gloo on CPU, 2 and 4 ranks.

--use-distributed-optimizer: at DP2, megatron's DistributedOptimizer (Adam state sharded over
the DP ranks) trains to the plain optimizer's parameters, in fp32 and in bf16 (fp32 main
parameters and gradients), and a save / load resumes it exactly; the LR schedule's state
resumes with either optimizer.
--sequence-parallel: TP2 with sequence parallelism gives TP1's logits, loss and gradients (a
sequence length TP does not divide is padded), and after a step the same token log-probs and
local-engine samples, through the KV decoder (which runs outside the sequence-parallel region)
and through megatron's forward; TP2 x PP2 with sequence parallelism and Qwen3's per-head q/k
norms (4 ranks) too.
The worker is tests/distributed/gpu_scale_worker.py.
"""
import os

import pytest
import torch

pytestmark = pytest.mark.distributed
WORKER = os.path.join(os.path.dirname(__file__), "gpu_scale_worker.py")


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.fixture(scope="module")
def distopt(tiny_qwen2, tmp_path_factory, torchrun):
    out = tmp_path_factory.mktemp("distopt")
    torchrun(2, [WORKER, "distopt", "--hf", tiny_qwen2, "--out", str(out)])
    return torch.load(os.path.join(out, "distopt.pt"), weights_only=False)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_distributed_optimizer_matches_the_plain_one_at_dp2(distopt, dtype):
    plain, sharded = distopt[(dtype, False)], distopt[(dtype, True)]
    assert plain["type"] == ("FP32Optimizer" if dtype == "float32"
                             else "Float16OptimizerWithFloat16Params")
    assert sharded["type"] == "DistributedOptimizer"
    # each of the 2 DP ranks keeps about half of the main parameters (and so of Adam's state)
    local, total = sharded["state_numel"]
    assert total == sharded["model_numel"] and local < 0.6 * total
    # fp32 main parameters and gradients in both, bf16 included
    for r in (plain, sharded):
        assert r["main_dtypes"] == ["torch.float32"] and r["main_grad_dtypes"] == ["torch.float32"]
    assert plain["lr"] == sharded["lr"] > 0
    assert sharded["grad_norms"] == pytest.approx(plain["grad_norms"], rel=1e-6)
    assert _max_diff(plain["params"], sharded["params"]) <= 1e-6


@pytest.mark.parametrize("distributed", [False, True])
def test_optimizer_and_lr_schedule_resume_exactly(distopt, distributed):
    """Save after 3 steps of a warm-up + cosine schedule, load into a fresh policy, take 2 more
    steps: the same learning rates, step counts and parameters as without the save."""
    r = distopt[("resume", distributed)]
    assert all(a == b for a, b in r["lr"]) and len({a for a, _ in r["lr"]}) == 3
    assert r["num_steps"] == (5, 5)
    assert _max_diff(r["continued"], r["resumed"]) == 0.0


def _check_sp(result, layouts, logits_atol=1e-5, grad_atol=2e-6):
    ref = result["tp1"]
    assert sorted(ref["logits"]) == [0, 1, 2, 3] and ref["logits"][0].shape[0] == 15
    assert max(float(g.abs().max()) for g in ref["grads"].values()) > 1e-2
    for name in layouts:
        got = result[name]
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6)
        for i, logits in ref["logits"].items():
            torch.testing.assert_close(got["logits"][i], logits, rtol=0, atol=logits_atol)
        for k, g in ref["grads"].items():
            torch.testing.assert_close(got["grads"][k], g, rtol=1e-4, atol=grad_atol,
                                       msg=lambda m: f"{name} grad {k}: {m}")
        # after one optimizer step (lr 1e-5: Adam's normalised step moves every weight by
        # about lr, so the layouts' rounding differences stay at that scale)
        assert _max_diff(got["params"], ref["params"]) <= 2e-6
        torch.testing.assert_close(got["logprobs"], ref["logprobs"], rtol=0, atol=1e-5)
        assert set(got["samples"]) == ({False} if "pp2" in name else {True, False})
        for kv in got["samples"]:
            assert sum(len(t) for g in ref["samples"][kv] for t, _ in g) > 0
            for g_got, g_ref in zip(got["samples"][kv], ref["samples"][kv]):
                for (t_got, lp_got), (t_ref, lp_ref) in zip(g_got, g_ref):
                    assert t_got == t_ref, (name, kv)
                    torch.testing.assert_close(torch.tensor(lp_got), torch.tensor(lp_ref),
                                               rtol=0, atol=1e-5)


@pytest.mark.extended  # sequence parallelism at TP2 x PP2: the Qwen3 test below
def test_sequence_parallel_tp2_matches_tp1_qwen2(tiny_qwen2, tmp_path, torchrun):
    torchrun(2, [WORKER, "sp", "--hf", tiny_qwen2, "--out", str(tmp_path)])
    result = torch.load(os.path.join(tmp_path, "sp.pt"), weights_only=False)
    _check_sp(result, ["tp2", "tp2_sp"])


def test_sequence_parallel_tp2_pp2_matches_tp1_qwen3_qk_norms(tiny_qwen3, tmp_path, torchrun):
    """4 ranks: sequence parallelism with pipeline parallelism (the stages exchange [s/TP, b, h]
    activations of the padded sequence) and Qwen3's per-head q/k norms."""
    torchrun(4, [WORKER, "sp", "--hf", tiny_qwen3, "--out", str(tmp_path),
                 "--layouts", "tp1,tp2_pp2_sp"])
    result = torch.load(os.path.join(tmp_path, "sp.pt"), weights_only=False)
    _check_sp(result, ["tp2_pp2_sp"])
