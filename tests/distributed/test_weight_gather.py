"""The full state dict gathered to one rank (Policy.full_state_dict / full_grads, models.weights):
at TP2, PP2 (also with tied embeddings), DP2 and EP2 on two gloo ranks, the rank `dst` gets the
checkpoint's tensors exactly, under the names and in the order of hf_mapping.gather_shards, and
every other rank gets None; with dst=None every rank gets it. The gradients gather the same way
to either rank. The bytes gathered are those models.weights.gather_memory counts.

This file is also the torchrun worker: `python -m torch.distributed.run ... this_file --out DIR
--ckpt LAYOUT=DIR ...`.
"""
import argparse
import os

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_rl.models import ModelArgs, hf_mapping  # noqa: E402

pytestmark = pytest.mark.distributed

LAYOUTS = {"tp2": (2, 1, 1), "pp2": (1, 2, 1), "dp2": (1, 1, 1), "pp2_tied": (1, 2, 1),
           "ep2": (1, 1, 2)}  # (TP, PP, EP) on two ranks


# a model of 46e6 parameters (184 MiB in fp32), for host memory measurements: its largest tensors
# are the embedding and the output layer, 32 MiB each
BIG = dict(architecture="Qwen2ForCausalLM", vocab_size=8192, hidden_size=1024,
           intermediate_size=4096, num_hidden_layers=2, num_attention_heads=8,
           num_key_value_heads=4, head_dim=128)
MEMORY_LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2)}


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _host_growth(policy, dst: int) -> int:
    """Bytes by which this process's resident memory peaked above its level before one
    full_state_dict(dst) (the peak counter reset through /proc/self/clear_refs)."""
    before = _kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    full = policy.full_state_dict(dst=dst)
    grown = (_kib("VmHWM") - before) * 1024
    del full
    return grown


def _memory_worker(out: str) -> None:
    """Under torchrun (2 ranks): a frozen BIG Policy at each of MEMORY_LAYOUTS; each rank saves
    its host memory growth during full_state_dict to dst 0 and to dst 1."""
    import ctypes

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_rl.models.policy import Policy
    from megatron_rl.parallel import ParallelConfig, init_distributed

    # glibc: allocations from 1 MiB on straight from mmap, back to the system when freed (no
    # threshold that rises with the sizes freed), so resident memory follows the live tensors
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    for layout, (tp, pp) in MEMORY_LAYOUTS.items():
        cfg = ParallelConfig(tp, pp)
        init_distributed(cfg)
        policy = Policy(ModelArgs(**BIG), trainable=False, parallel=cfg)
        policy.full_state_dict(dst=0)  # once before: process groups' connections, buffers
        growth = {dst: _host_growth(policy, dst) for dst in (0, 1)}
        torch.save(growth, os.path.join(out, f"memory_{layout}_rank{dist.get_rank()}.pt"))
        del policy
        ps.destroy_model_parallel()


def _worker(out: str, ckpts: dict[str, str]) -> None:
    """Under torchrun (2 ranks): for each layout, a trainable Policy loads its checkpoint, runs
    one forward/backward, and each rank saves what full_state_dict and full_grads return to it
    for dst 0, 1 and None."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_rl.models.policy import Policy
    from megatron_rl.parallel import ParallelConfig, destroy_distributed, init_distributed

    torch.set_num_threads(1)
    _memory_worker(out)
    for layout, path in ckpts.items():
        tp, pp, ep = LAYOUTS[layout]
        cfg = ParallelConfig(tp, pp, expert_model_parallel_size=ep)
        init_distributed(cfg)
        policy = Policy(ModelArgs.from_pretrained(path), parallel=cfg)
        policy.load_hf(path)
        tokens = torch.randint(0, policy.args.vocab_size, (2, 16),
                               generator=torch.Generator().manual_seed(dist.get_rank()))
        policy.forward_backward([{"tokens": tokens}],
                                lambda batch, logits: (logits.float().square().mean(), {}))
        got = {f"state_{d}": policy.full_state_dict(dst=d) for d in (0, 1, None)}
        got.update({f"grads_{d}": policy.full_grads(dst=d) for d in (0, 1)})
        torch.save(got, os.path.join(out, f"{layout}_rank{dist.get_rank()}.pt"))
        ps.destroy_model_parallel()
    destroy_distributed()


@pytest.fixture(scope="module")
def gathered(tiny_qwen2, tiny_llama_tied, tmp_path_factory, torchrun):
    """{layout: [what rank 0 got, what rank 1 got]}, from one two-rank launch."""
    from megatron_rl.experiments.tiny_model import make_tiny_hf_checkpoint

    moe = make_tiny_hf_checkpoint(str(tmp_path_factory.mktemp("moe")), "qwen3_moe", seed=3)
    ckpts = {"tp2": tiny_qwen2, "pp2": tiny_qwen2, "dp2": tiny_qwen2,
             "pp2_tied": tiny_llama_tied, "ep2": moe}
    out = tmp_path_factory.mktemp("gathered")
    torchrun(2, [os.path.abspath(__file__), "--out", str(out),
                 *[f"--ckpt={k}={v}" for k, v in ckpts.items()]], timeout=300)
    got = {layout: (path, [torch.load(os.path.join(out, f"{layout}_rank{r}.pt"))
                           for r in range(2)]) for layout, path in ckpts.items()}
    got["memory"] = {layout: [torch.load(os.path.join(out, f"memory_{layout}_rank{r}.pt"))
                              for r in range(2)] for layout in MEMORY_LAYOUTS}
    return got


def _reference(path: str, layout: str) -> dict[str, torch.Tensor]:
    """The checkpoint as a full megatron state dict, in the order gather_shards puts the
    layout's shards (each sorted by name) back together."""
    from megatron_rl.models.hf_mapping import gather_shards, shard_for_rank

    tp, pp, ep = LAYOUTS[layout]
    args = ModelArgs.from_pretrained(path)
    full = hf_mapping.hf_to_megatron(hf_mapping.load_hf_state_dict(path), args)
    shards = {(t, p, *((e,) if ep > 1 else ())): dict(sorted(shard_for_rank(
        full, args, tp_size=tp, tp_rank=t, pp_size=pp, pp_rank=p, ep_size=ep,
        ep_rank=e).items())) for t in range(tp) for p in range(pp) for e in range(ep)}
    return gather_shards(shards, args, tp, pp, ep)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_full_state_dict_reaches_dst_only(gathered, layout):
    from megatron_rl.models.weights import gather_memory

    path, ranks = gathered[layout]
    ref = _reference(path, layout)
    for dst in (0, 1):
        for rank, got in enumerate(ranks):
            state = got[f"state_{dst}"]
            if rank != dst:
                assert state is None, (dst, rank)
                continue
            assert list(state) == list(ref), (dst, rank)
            for k, t in ref.items():
                assert state[k].dtype == t.dtype and torch.equal(state[k], t), (dst, k)
            nbytes = sum(t.numel() * t.element_size() for t in state.values())
            tp, pp, ep = LAYOUTS[layout]
            assert nbytes == gather_memory(ModelArgs.from_pretrained(path), tp, pp, ep,
                                           bytes_per_element=4).full
    for rank, got in enumerate(ranks):  # dst None: every rank
        assert list(got["state_None"]) == list(ref), rank
        assert all(torch.equal(got["state_None"][k], t) for k, t in ref.items()), rank


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_full_gradients_reach_either_rank(gathered, layout):
    path, ranks = gathered[layout]
    to0, to1 = ranks[0]["grads_0"], ranks[1]["grads_1"]
    assert ranks[1]["grads_0"] is None and ranks[0]["grads_1"] is None
    assert list(to0) == list(to1) == list(_reference(path, layout))
    assert all(torch.equal(to0[k], to1[k]) for k in to0)
    assert any(float(g.abs().max()) > 0 for g in to0.values())


@pytest.mark.parametrize("layout", list(MEMORY_LAYOUTS))
def test_only_dst_holds_the_model_on_the_host(gathered, layout):
    """Resident memory during the gather of a 184 MiB model: dst grows by the model and at most
    one tensor in flight; the other rank, which sends its own shard, by at most one tensor in
    flight (its TP shards and their merge: twice the largest tensor), not by the model."""
    from megatron_rl.models.weights import gather_memory

    tp, pp = MEMORY_LAYOUTS[layout]
    m = gather_memory(ModelArgs(**BIG), tp, pp, bytes_per_element=4)
    slack = 16 << 20  # the allocator's and the interpreter's own
    for dst in (0, 1):
        for rank, growth in enumerate(gathered["memory"][layout]):
            bound = (m.full if rank == dst else 0) + 2 * m.largest + slack
            assert growth[dst] <= bound, (dst, rank, growth[dst] >> 20, bound >> 20)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--ckpt", action="append", required=True, help="LAYOUT=DIR, in launch order")
    a = p.parse_args()
    _worker(a.out, dict(c.split("=", 1) for c in a.ckpt))
    from megatron_rl.processes import skip_exit_collection

    skip_exit_collection()  # the heap is the imports': no shutdown collection over it
