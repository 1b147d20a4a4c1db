"""Host/device mixing in the RL step, caught on a machine without a GPU.

On a GPU the batch, the logits, the losses and every tensor handed to a collective must live on
the device; a host tensor meeting a device tensor raises there, at the first step. These tests
run the step's pieces with the trainer's device set to a stand-in accelerator and fail on the
same mixing.

The stand-in is the `meta` device, not torch's FakeTensorMode with device="cuda": on a CPU-only
build of torch (2.13.0+cpu, checked) FakeTensorMode creates "cuda" tensors and raises
FakeTensorDeviceMismatchError on mixing, but Python indexing (`x[:, :-1]`, `x[idx]`) of such a
tensor raises "PyTorch is not linked with support for cuda devices", and the autograd engine
aborts the process on them. `meta` tensors index, differentiate and raise "Tensor on device cpu
is not on the expected device meta!" on the same mixing; like CUDA they accept 0-dim host
scalars and host index tensors. Neither carries values, so reading a number back (`float()`,
`.tolist()`) is the host boundary these pieces stop at.
"""
import functools
import types

import pytest
import torch

import megatron_rl.parallel as parallel
import megatron_rl.rollout.local as local_engine
import megatron_rl.update as update
from megatron_rl import metrics as global_metrics
from megatron_rl.batch import pack_rollouts
from megatron_rl.kl import KLConfig
from megatron_rl.loss import LossConfig, build_advantages
from megatron_rl.rollout.base import Completion, SamplingParams
from megatron_rl.rollout.single_turn import single_turn_groups

DEV = torch.device("meta")
PLACEMENTS = [("k1", "reward"), ("k1", "loss"), ("k3", "loss"), ("k3", "reward+loss"),
              ("k2", "reward"), ("low_var_kl", "loss"), ("k1", "none")]


@pytest.fixture
def on_accelerator(monkeypatch):
    """The trainer's device decision answers the stand-in accelerator."""
    for module in (parallel, update, local_engine):
        monkeypatch.setattr(module, "device", lambda: DEV)
    return DEV


def _host_batch():
    """Two prompts x two samples, as the engine returns them (token ids and log-probs on the host)."""
    groups = [[Completion([5, 6, 7], [-0.5, -0.7, -0.1], "stop"), Completion([8], [-0.2], "length")],
              [Completion([9, 2], [-1.0, -0.3], "stop"), Completion([3, 4, 5, 6], [-0.4] * 4, "stop")]]
    return pack_rollouts(single_turn_groups([[1, 2, 3], [4]], groups, [1.0, 0.0, 0.0, 1.0]),
                         pad_token_id=0)


def _loss_cfg(estimator="k1", placement="reward", aggregation="token-sum-over-batch-tokens"):
    return LossConfig(aggregation=aggregation, kl=KLConfig(estimator=estimator, placement=placement))


def test_the_stand_in_catches_mixing():
    """The premise: a host tensor meeting a stand-in device tensor raises, as on a GPU."""
    with pytest.raises(RuntimeError, match="device"):
        torch.ones(2, device=DEV) - torch.ones(2)


def test_batch_moves_to_the_device_at_one_boundary():
    batch = _host_batch()
    batch.old_logprobs = batch.rollout_logprobs.clone()
    moved = batch.to(DEV)
    for name in ("tokens", "loss_mask", "rollout_logprobs", "rewards", "old_logprobs"):
        assert getattr(moved, name).device == DEV, name
    sub = moved.select([0, 3])  # a PPO minibatch: index tensors follow the batch
    assert sub.tokens.device == DEV and sub.tokens.shape[0] == 2
    assert moved.response_lengths == batch.response_lengths  # host metadata untouched


@pytest.mark.parametrize("estimator,placement", PLACEMENTS)
@pytest.mark.parametrize("advantage", ["rloo", "grpo"])
def test_advantages_on_the_device(estimator, placement, advantage):
    batch = _host_batch().to(DEV)
    cfg = _loss_cfg(estimator, placement)
    cfg.advantage_estimator = advantage
    old = torch.zeros_like(batch.loss_mask)
    adv = build_advantages(batch.rewards, old, old.clone(), batch.loss_mask, cfg, batch.group_size)
    assert adv.device == DEV


@pytest.mark.parametrize("estimator,placement", PLACEMENTS)
@pytest.mark.parametrize("aggregation", ["token-sum-over-batch-tokens", "seq-mean-token-mean"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded-logits", "packed-fused"])
def test_rl_loss_function_forward_and_backward(on_accelerator, estimator, placement, aggregation,
                                               packed):
    """The loss function handed to the pipeline schedule, on the trainer's microbatch dict:
    right-padded rows scored from logits, and packed rows scored from hidden states (the
    fused LM head, its weight on the device)."""
    from megatron_rl.models.policy import Policy
    from megatron_rl.packing import Layout

    cfg = _loss_cfg(estimator, placement, aggregation)
    batch = _host_batch().to(DEV)
    batch.old_logprobs = batch.rollout_logprobs.clone()
    ref = torch.zeros_like(batch.old_logprobs)
    adv = build_advantages(batch.rewards, batch.old_logprobs, ref, batch.loss_mask, cfg,
                           batch.group_size)
    lay = Layout(packed=packed, micro_batch_size=2)
    (m,) = lay.microbatches(batch.tokens, batch.seq_lengths, [1, 2])
    mb = update.loss_microbatch(batch, adv, ref, m)
    weight = torch.randn(16, 8, device=DEV, requires_grad=True)
    policy = types.SimpleNamespace(tp_group=None, vocab_start=0, fused_lm_head=packed,
                                   output_weight=lambda: weight)
    policy.score = functools.partial(Policy.score, policy)
    out = torch.randn(*m.inputs["tokens"].shape, 8 if packed else 16, device=DEV,
                      requires_grad=True)
    loss_fn = update.make_rl_loss_fn(policy, cfg, num_global_tokens=7.0, num_global_seqs=4.0)
    loss, metrics = loss_fn(mb, out)
    loss.backward()
    assert loss.device == DEV and out.grad.device == DEV
    if packed:
        assert weight.grad.device == DEV
    assert all(v.device == DEV for v in metrics.values()), metrics
    # the step's metric reduction stays on the device until its single host copy
    keys = [k for k in global_metrics.LOSS_METRICS if k in metrics]  # this loss's (loss_metrics')
    means = global_metrics.weighted_mean_tensor([metrics, metrics], keys)
    assert means.device == DEV


def test_nan_guard_flag_on_the_device(on_accelerator):
    """The NaN/inf guard builds its flag from device losses and gradients, for a device collective."""
    p = torch.nn.Parameter(torch.zeros(3, device=DEV))
    p.main_grad = torch.zeros(3, device=DEV)
    flag = update.nonfinite_flag([{"loss": torch.zeros((), device=DEV)}], [p])
    assert flag.device == DEV and flag.shape == (1,)


def test_collectives_get_device_tensors(on_accelerator):
    """Numbers and host tensors handed to a collective are moved to the device first."""
    assert parallel.all_reduce([1.0, 2.0]).device == DEV
    assert parallel.all_reduce(torch.ones(2)).device == DEV


def test_forward_kl_metric_on_the_device():
    batch = _host_batch().to(DEV)
    lp = torch.zeros_like(batch.loss_mask)
    lr_ = lp - lp
    assert global_metrics.token_mean_sums(lr_.exp() * lr_, batch.loss_mask).device == DEV


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9), (0.0, 1.0)])
def test_local_engine_samples_on_the_device(temperature, top_p):
    """Sampling (temperature, top-p, greedy) runs where the logits are: no host copy of [B, V]."""
    logits = torch.randn(4, 32, device=DEV)
    params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=1)
    nxt, lp = local_engine.sample_tokens(logits, params, gen=None)
    assert nxt.device == DEV and lp.device == DEV and nxt.shape == (4,)
