"""TP=2, PP=2 and TP2xPP2 (4 ranks, DP fills the rest) give the logits and gradients of TP=1,
which in turn equal transformers' on the same weights; a checkpoint written at TP1 loads at
every layout (dist_checkpointing resharding) and gives the same logits."""
import os
import sys

import pytest
import torch

from megatron_rl.models import hf_mapping
from megatron_rl.experiments.parallel_check import (PACKED_CONFIGS, RL_CONFIGS, load_layout_outputs,
                                        transformers_reference)

pytestmark = pytest.mark.distributed
LAYOUTS = ["1x1", "2x1", "1x2", "2x2"]
GLOBAL_BATCH, SEQ = 4, 16


def _check(out_dir, hf_path):
    ref_logits, ref_grads = transformers_reference(hf_path, GLOBAL_BATCH, SEQ)
    for layout in LAYOUTS:
        logits, grads = load_layout_outputs(out_dir, layout)
        assert sorted(logits) == list(range(GLOBAL_BATCH)), layout
        for i in range(GLOBAL_BATCH):
            torch.testing.assert_close(logits[i], ref_logits[i], rtol=0, atol=1e-5,
                                       msg=lambda m: f"{layout} logits: {m}")
        assert set(grads) == set(ref_grads), layout
        for k in ref_grads:
            torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-4, atol=2e-6,
                                       msg=lambda m: f"{layout} grad {k}: {m}")


@pytest.fixture(scope="module")
def qwen2_run(tiny_qwen2, tmp_path_factory, torchrun):
    """One 4-rank launch: every layout, the NLL loss and every KL placement of the RL loss."""
    out = tmp_path_factory.mktemp("qwen2_layouts")
    torchrun(4, ["-m", "megatron_rl.experiments.parallel_check", "--hf", tiny_qwen2, "--out", str(out),
                 "--layouts", ",".join(LAYOUTS), "--rl-configs", "all", "--generate",
                 "--packed"],
             timeout=600)
    return str(out)


def test_qwen2_layouts_match_single_rank_and_transformers(qwen2_run, tiny_qwen2):
    _check(qwen2_run, tiny_qwen2)


@pytest.mark.parametrize("config", RL_CONFIGS)
def test_every_kl_placement_same_loss_and_grads_across_layouts(qwen2_run, config):
    """The trainer's RL loss (policy_loss through the vocab-parallel op, with the KL placed in the
    reward, the loss, both or nowhere) gives the TP=1 loss and gradients at TP2, PP2, TP2xPP2;
    so does the exact KL in reward+loss, whose reference model runs inside the step."""
    name = f"rl_{config.replace('+', '_')}.pt"
    ref = torch.load(os.path.join(qwen2_run, "1x1", name))
    assert any(float(g.abs().max()) > 1e-3 for g in ref["grads"].values())
    for layout in LAYOUTS[1:]:
        got = torch.load(os.path.join(qwen2_run, layout, name))
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7), layout
        for k, g in ref["grads"].items():
            torch.testing.assert_close(got["grads"][k], g, rtol=1e-4, atol=2e-6,
                                       msg=lambda m: f"{config} {layout} {k}: {m}")


@pytest.mark.parametrize("config", PACKED_CONFIGS)
def test_packed_fused_loss_equals_padded_logits_loss_at_every_layout(qwen2_run, config):
    """Sequences of unequal length packed two to a microbatch and scored from hidden states
    (fused LM head) give, at TP1, TP2, PP2 and TP2xPP2 (DP fills the four ranks), the loss and
    gradients of the same sequences right-padded and scored from logits at TP1, for every KL
    placement and the exact KL."""
    name = f"rl_{config.replace('+', '_')}"
    ref = torch.load(os.path.join(qwen2_run, "1x1", name + "_padded.pt"))
    assert any(float(g.abs().max()) > 1e-3 for g in ref["grads"].values())
    for layout in LAYOUTS:
        got = torch.load(os.path.join(qwen2_run, layout, name + "_packed.pt"))
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7), layout
        for k, g in ref["grads"].items():
            torch.testing.assert_close(got["grads"][k], g, rtol=1e-4, atol=2e-6,
                                       msg=lambda m: f"{config} {layout} {k}: {m}")


def test_local_engine_samples_the_same_at_every_layout(qwen2_run):
    """The in-process engine at TP2, PP2 and TP2xPP2 draws the TP1 samples (same seed) with the
    same log-probs: TP shards are gathered and PP stages receive the last stage's tokens."""
    ref = torch.load(os.path.join(qwen2_run, "1x1", "generate.pt"))
    assert sum(len(c[0]) for g in ref for c in g) > 0
    for layout in LAYOUTS[1:]:
        got = torch.load(os.path.join(qwen2_run, layout, "generate.pt"))
        for g_ref, g_got in zip(ref, got):
            for (t_ref, lp_ref, f_ref), (t_got, lp_got, f_got) in zip(g_ref, g_got):
                assert t_got == t_ref and f_got == f_ref, layout
                torch.testing.assert_close(torch.tensor(lp_got), torch.tensor(lp_ref),
                                           rtol=0, atol=1e-5)


def test_qwen3_layouts_match_transformers_and_sample_the_same(tiny_qwen3, tmp_path, torchrun):
    """Qwen3's q/k norms (one head_dim weight shared by the heads that TP splits across ranks):
    logits and gradients at every layout equal transformers', and the local engine (KV decoder
    at TP2, recompute at PP2) draws the TP1 samples."""
    out = tmp_path / "qwen3_layouts"
    torchrun(4, ["-m", "megatron_rl.experiments.parallel_check", "--hf", tiny_qwen3, "--out", str(out),
                 "--layouts", ",".join(LAYOUTS), "--generate"], timeout=600)
    _check(str(out), tiny_qwen3)
    test_local_engine_samples_the_same_at_every_layout(str(out))


def test_kl_placement_changes_the_gradient(qwen2_run):
    """Guard against a switch that does nothing: reward, loss and none differ, and the exact KL
    (reference model run inside the step, its activations carried through the pipeline) moves
    the gradient too."""
    g = {c: torch.load(os.path.join(qwen2_run, "1x1", f"rl_{c.replace('+', '_')}.pt"))["grads"]
         for c in ("k1:reward", "k1:loss", "k1:none", "k3:loss", "exact:reward+loss")}
    key = "decoder.layers.0.mlp.linear_fc1.weight"
    for a, b in (("k1:reward", "k1:none"), ("k1:loss", "k1:none"), ("k1:loss", "k3:loss"),
                 ("exact:reward+loss", "k1:none")):
        assert float((g[a][key] - g[b][key]).abs().max()) > 1e-5, (a, b)


def test_tp1_checkpoint_reshards_to_every_layout_tied_llama(tiny_llama_tied, tmp_path, torchrun):
    """Convert HF -> Megatron at TP1 (one process), then load it at TP2, PP2 and TP2xPP2."""
    import subprocess

    ckpt = tmp_path / "megatron"
    subprocess.run([sys.executable, "-m", "megatron_rl.convert", "hf-to-megatron", "--load",
                    tiny_llama_tied, "--save", str(ckpt)], check=True, capture_output=True,
                   env=dict(os.environ, OMP_NUM_THREADS="1"))
    torchrun(4, ["-m", "megatron_rl.experiments.parallel_check", "--load", str(ckpt),
                 "--out", str(tmp_path / "out"), "--layouts", ",".join(LAYOUTS)])
    _check(str(tmp_path / "out"), tiny_llama_tied)


def test_megatron_to_hf_from_sharded_layout_is_bit_exact(tiny_qwen2, tmp_path, torchrun):
    """HF -> Megatron (TP1) -> HF exported from a TP2xPP2 world reproduces every tensor."""
    import subprocess

    ckpt = tmp_path / "megatron"
    subprocess.run([sys.executable, "-m", "megatron_rl.convert", "hf-to-megatron", "--load",
                    tiny_qwen2, "--save", str(ckpt)], check=True, capture_output=True,
                   env=dict(os.environ, OMP_NUM_THREADS="1"))
    torchrun(4, ["-m", "megatron_rl.convert", "megatron-to-hf", "--load", str(ckpt), "--save",
                 str(tmp_path / "hf"), "--tensor-model-parallel-size", "2",
                 "--pipeline-model-parallel-size", "2"])
    a = hf_mapping.load_hf_state_dict(tiny_qwen2)
    b = hf_mapping.load_hf_state_dict(str(tmp_path / "hf"))
    assert set(a) == set(b)
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
