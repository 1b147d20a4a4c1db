"""tools/bench_train_phase.py's memory limit: on a GPU every worker may use the whole device
(the kit's sizes, Qwen2.5-0.5B's 24 layers at 4096-token responses, need more than a fixed
24 GiB of an 80 GiB H100); on a CPU the default stays 24 GiB, capped by the free memory."""
import importlib
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
btp = importlib.import_module("bench_train_phase")

GIB = 1 << 30
H100, H200 = 81559 << 20, 143771 << 20  # total memory as nvidia-smi reports them there


def test_default_limit_is_the_whole_gpu():
    default = btp.build_parser().parse_args([]).mem_limit_gib
    for total in (H100, H200):
        limit, note = btp.memory_limit(default, total, None)
        assert limit == total, note


def test_flag_caps_the_gpu_share_and_the_cpu_default_is_unchanged():
    assert btp.memory_limit(24.0, H100, None)[0] == 24 * GIB
    assert btp.memory_limit(200.0, H100, None)[0] == H100
    default = btp.build_parser().parse_args([]).mem_limit_gib
    assert btp.memory_limit(default, None, 100 * GIB) == (24 * GIB, "24 GiB")
    limit, note = btp.memory_limit(default, None, 10 * GIB)
    assert limit == 9 * GIB and "--mem-limit-gib 24 capped" in note


# -- model FLOPs and MFU ------------------------------------------------------------------------

TINY = dict(hidden_size=4, num_attention_heads=2, head_dim=2, num_key_value_heads=1,
            intermediate_size=8, num_hidden_layers=1, vocab_size=10)


def _tiny_args(**kw):
    from types import SimpleNamespace

    return SimpleNamespace(**{**TINY, **kw})


def _hand_count_forward(lengths, layers=1, h=4, heads=2, d=2, kv_heads=1, f=8, vocab=10):
    """One forward's FLOPs counted term by term, multiply-adds x 2, loops instead of formulas."""
    flops = 0
    for n in lengths:
        for _ in range(n):  # per token
            for _ in range(layers):
                flops += 2 * h * heads * d          # q projection
                flops += 2 * 2 * h * kv_heads * d   # k and v projections
                flops += 2 * heads * d * h          # output projection
                flops += 2 * 2 * h * f              # gate and up projections
                flops += 2 * f * h                  # down projection
            flops += 2 * h * vocab                  # LM head
        for _ in range(layers):
            for _head in range(heads):
                for i in range(1, n + 1):           # query i sees keys 1..i (causal)
                    flops += 2 * d * i              # its i scores, q . k
                    flops += 2 * d * i              # the weighted sum of i values
    return flops


def test_forward_flops_equal_a_hand_count_of_a_tiny_shape():
    args = _tiny_args()
    # N = 4 (4 + 2 x 2) + 4 x 4 + 3 x 4 x 8 + 4 x 10 = 32 + 16 + 96 + 40
    assert btp.matmul_params(args) == 184
    for lengths in ([3], [3, 5], [1, 7, 2, 16]):
        assert btp.forward_flops(args, lengths) == _hand_count_forward(lengths)
    # [3, 5]: 2 x 184 x 8 dense + 2 x 4 x (3 x 4 + 5 x 6) attention
    assert btp.forward_flops(args, [3, 5]) == 2944 + 336
    two = _tiny_args(num_hidden_layers=2)
    assert btp.forward_flops(two, [3, 5]) == _hand_count_forward([3, 5], layers=2)


def test_a_steps_model_flops_count_each_pass_once():
    """K1 / K3: old + reference forward, then forward + backward (3F): 5F; the exact estimator
    scores the reference with the policy and the reference together (2F), and in the loss
    adds the reference's forward to the update; PPO epochs repeat the update."""
    from megatron_rl.kl import KLConfig

    args, lengths = _tiny_args(), [3, 5]
    f = btp.forward_flops(args, lengths)
    assert btp.model_flops(args, lengths, KLConfig("k3", "loss")) == 5 * f
    assert btp.model_flops(args, lengths, KLConfig("k1", "reward"), ppo_epochs=2) == 8 * f
    assert btp.model_flops(args, lengths, KLConfig("exact", "reward+loss")) == 7 * f
    assert btp.model_flops(args, lengths, KLConfig("exact", "loss")) == 7 * f
    assert btp.model_flops(args, lengths, KLConfig("exact", "reward")) == 6 * f
    # the dense part of the update is the familiar 6 N D
    update = btp.model_flops(args, lengths, KLConfig("k3", "loss")) - 2 * f
    attn = 2 * 4 * (3 * 4 + 5 * 6)
    assert update == 6 * 184 * 8 + 3 * attn


def test_qwen_shapes_parameter_counts():
    """N at the benchmarked shapes: Qwen2.5-0.5B's 494M weights minus the qkv biases and norms
    (its tied embedding counted once, as the LM head); 1.5B's likewise."""
    a = btp.build_parser().parse_args(["--model", "qwen2.5-0.5b", "qwen2.5-1.5b"])
    n05 = btp.matmul_params(btp.model_args(a, "qwen2.5-0.5b"))
    n15 = btp.matmul_params(btp.model_args(a, "qwen2.5-1.5b"))
    assert n05 == 24 * (896 * (896 + 2 * 128) + 896 * 896 + 3 * 896 * 4864) + 896 * 151936
    assert 0.49e9 < n05 < 0.50e9 and 1.5e9 < n15 < 1.55e9


@pytest.mark.distributed
def test_matmul_params_are_the_models_matmuls(dist_env):
    """torch's FlopCounterMode over a tiny megatron Qwen2's forward (qkv biases, GQA, untied LM
    head): its matrix multiplications take 2 N FLOPs per token. (Attention is the formula's
    other term; the counter has no rule for the CPU attention kernel, so it is left to the hand
    count above.)"""
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_rl.models.config import ModelArgs
    from megatron_rl.models.gpt import build_gpt_model

    args = ModelArgs(architecture="Qwen2ForCausalLM", vocab_size=96, hidden_size=32,
                     intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8, qkv_bias=True,
                     max_position_embeddings=64, rope_theta=1_000_000.0)
    model = build_gpt_model(args, use_te=False)
    lengths = [5, 11, 3]
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        for n in lengths:
            model(torch.randint(0, 96, (1, n)), torch.arange(n)[None], None)
    counts = counter.get_flop_counts()["Global"]
    matmuls = sum(v for k, v in counts.items() if str(k) in ("aten.mm", "aten.addmm",
                                                             "aten.bmm"))
    assert matmuls == 2 * btp.matmul_params(args) * sum(lengths) > 0


def test_peak_from_the_data_sheet_or_measured():
    assert btp.spec_peak_tflops("NVIDIA H200") == 989.0
    assert btp.spec_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert btp.spec_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert btp.spec_peak_tflops("NVIDIA H200 NVL") == 835.0
    assert btp.spec_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert btp.spec_peak_tflops("NVIDIA GeForce RTX 4090") is None
    a = btp.build_parser().parse_args(["--peak-tflops", "123"])
    assert btp.peak_tflops(a) == (123.0, "--peak-tflops")
    a = btp.build_parser().parse_args([])
    if not torch.cuda.is_available():
        peak, source = btp.peak_tflops(a)
        assert 0 < peak < 100 and "measured float32 1024^3 matmul" in source


def test_summary_reports_tokens_per_second_and_mfu():
    step = {"warmup": False, "seconds": 2.0, "updated": True, "response_tokens": 300,
            "all_tokens": 400, "model_tokens": 416, "microbatches": 2, "flops": 4e12,
            "model_flops": 3e12, "metrics": {}, "phases": dict.fromkeys(btp.PHASES, 0.4)}
    res = {"model": "qwen2.5-0.5b", "combo": "packed+fused", "kl": "k3:loss",
           "max_response": 1024, "status": "ok", "peak_tflops": 10.0, "peak_source": "x",
           "steps": [{**step, "warmup": True, "seconds": 9.0}, step, step]}
    s = btp.summarize_train(res)
    assert s["steps"] == 2 and s["step_s"] == 2.0 and s["all_tokens_per_s"] == 200.0
    assert s["model_flops_per_step"] == 3e12 and s["model_tflops_per_s"] == 1.5
    assert s["mfu"] == pytest.approx(0.15)


def test_results_are_saved_after_each_configuration(monkeypatch, capsys):
    """A run its time limit stops keeps the configurations it finished: run_benchmark hands
    the rows so far to `save` after each one (main rewrites --json with them), the larger model
    first when it is listed first."""
    a = btp.build_parser().parse_args(["--model", "qwen2.5-1.5b", "qwen2.5-0.5b",
                                       "--max-response", "4096"])
    ran = []

    def fake_child(a, worker, combo, kl, max_response, tag, extra=(), model=None):
        ran.append((model, combo))
        return {"model": model, "combo": combo, "kl": kl, "max_response": max_response,
                "status": "failed", "error": "not run"}

    monkeypatch.setattr(btp, "run_child", fake_child)
    saved = []
    out = btp.run_benchmark(a, lambda part: saved.append(len(part["train_phase"])))
    assert ran == [("qwen2.5-1.5b", "packed+fused"), ("qwen2.5-1.5b", "padded+logits"),
                   ("qwen2.5-0.5b", "packed+fused"), ("qwen2.5-0.5b", "padded+logits")]
    assert saved == [1, 2, 3, 4] and len(out["train_phase"]) == 4
    assert [x["why"] for x in out["mfu_goals"]] == ["failed: not run"]  # the 1.5B's, 4096


def _row(combo: str, mfu: float, tok_s: float, model: str = "qwen2.5-1.5b",
         max_response: int = 4096) -> dict:
    return {"model": model, "combo": combo, "kl": "k3:loss", "max_response": max_response,
            "status": "ok", "mfu": mfu, "response_tokens_per_s": tok_s,
            "peak_source": "NVIDIA H200 dense bf16 data sheet"}


def test_the_two_goals_are_judged_with_how_far_off():
    """Throughput: packed+fused >= 1.5x padded+logits tokens/s; MFU: packed+fused >= 35% at the
    Qwen2.5-1.5B shape, met or missed by how many points; a run at another shape or without
    that model says so."""
    assert btp.GOAL_RATIO == 1.5 and btp.MFU_GOAL == 0.35
    a = btp.build_parser().parse_args(["--model", "qwen2.5-1.5b", "qwen2.5-0.5b"])
    rows = [_row("packed+fused", 0.312, 1550.0), _row("padded+logits", 0.1, 1000.0),
            _row("packed+fused", 0.41, 1490.0, max_response=1024),
            _row("padded+logits", 0.1, 1000.0, max_response=1024),
            _row("packed+fused", 0.9, 5000.0, model="qwen2.5-0.5b"),
            {**_row("packed+fused", 0, 0, max_response=2048), "status": "oom",
             "error": "CUDA out of memory"}]
    out = btp.goals(rows, a)
    assert [(x["max_response"], x["met"]) for x in out["ratios"]] == [(4096, True), (1024, False)]
    assert out["ratios"][0]["goal"] == 1.5
    mfu = out["mfu_goals"]
    assert [(x["max_response"], x["met"]) for x in mfu] == [(4096, False), (1024, True),
                                                            (2048, None)]
    assert mfu[0]["by"] == pytest.approx(-0.038) and mfu[1]["by"] == pytest.approx(0.06)
    lines = [btp.mfu_goal_line(x) for x in mfu]
    assert lines[0] == ("- qwen2.5-1.5b, max response 4096, k3:loss: packed+fused "
                        "training-phase MFU = **31.2%** of NVIDIA H200 dense bf16 data sheet "
                        "(goal >= 35%: missed by 3.8 points)")
    assert lines[1].endswith("= **41.0%** of NVIDIA H200 dense bf16 data sheet "
                             "(goal >= 35%: met, 6.0 points over)")
    assert "not measured (oom: CUDA out of memory; goal >= 35%)" in lines[2]
    # fewer layers: the MFU is shown, not judged against the goal
    few = btp.mfu_goals(rows[:2], btp.build_parser().parse_args(
        ["--model", "qwen2.5-1.5b", "--num-layers", "4"]))
    assert few[0]["met"] is None and few[0]["mfu"] == 0.312
    assert "not judged: not the qwen2.5-1.5b shape (4 layers" in btp.mfu_goal_line(few[0])
    # no 1.5B configuration: one entry saying so
    (none,) = btp.mfu_goals(rows[4:5], a)
    assert none["met"] is None and none["max_response"] is None
    assert btp.mfu_goal_line(none) == ("- qwen2.5-1.5b: packed+fused training-phase MFU not "
                                       "measured (no qwen2.5-1.5b packed+fused configuration "
                                       "ran; goal >= 35%)")
