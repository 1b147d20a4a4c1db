"""K1/K2/K3 estimators, their gradients, clamping, the registry and the placement helpers."""
import math

import pytest
import torch

from megatron_rl.kl import (ESTIMATORS, KLConfig, get_estimator, importance_weights, k1, k2, k3,
                            kl_loss_term, kl_reward_is_surrogate, kl_reward_penalty,
                            kl_reward_to_go_penalty, low_var_kl)

F64 = torch.float64


def t(values):
    return torch.tensor(values, dtype=F64)


def test_estimator_values_by_hand():
    # pi = 0.5, pi_ref = 0.25: log r = log 0.5; and logp = -1, ref = -0.5: log r = 0.5.
    logprobs = t([math.log(0.5), -1.0])
    ref = t([math.log(0.25), -0.5])
    assert torch.allclose(k1(logprobs, ref), t([math.log(2), -0.5]), atol=1e-15)
    assert torch.allclose(k2(logprobs, ref), t([0.5 * math.log(2) ** 2, 0.125]), atol=1e-15)
    assert torch.allclose(k3(logprobs, ref), t([0.5 - 1 + math.log(2), math.exp(0.5) - 1.5]), atol=1e-15)
    assert torch.allclose(low_var_kl(logprobs, ref), k3(logprobs, ref), atol=0)


def test_estimator_gradients_match_analytic():
    logprobs = t([-2.0, -0.3, -1.1, -2.0]).requires_grad_()  # inside the low_var_kl clamps
    ref = t([-0.5, -0.9, -1.1, -0.2])
    analytic = {
        "k1": torch.ones(4, dtype=F64),
        "k2": -(ref - logprobs.detach()),
        "k3": 1 - torch.exp(ref - logprobs.detach()),
        "low_var_kl": 1 - torch.exp(ref - logprobs.detach()),
    }
    for name, fn in ESTIMATORS.items():
        (grad,) = torch.autograd.grad(fn(logprobs, ref).sum(), logprobs)
        assert torch.allclose(grad, analytic[name], atol=1e-14), name


def test_clamping_only_in_low_var_kl():
    logprobs = t([-30.0, 0.0, -1.0]).requires_grad_()
    ref = t([0.0, -30.0, -1.5])  # log r = 30 (both clamps), -30 (k3 = 29 > 10), -0.5 (inside)
    raw = k3(logprobs, ref)
    assert raw[0].item() == pytest.approx(math.exp(30) - 31, rel=1e-12)
    assert raw[1].item() == pytest.approx(29.0 + math.exp(-30), rel=1e-12)
    clamped = low_var_kl(logprobs, ref)
    assert clamped[0].item() == 10.0 and clamped[1].item() == 10.0
    assert clamped[2].item() == pytest.approx(raw[2].item(), abs=1e-15)
    (grad,) = torch.autograd.grad(clamped.sum(), logprobs)
    assert grad[0].item() == 0.0 and grad[1].item() == 0.0  # the clamp zeroes the gradient
    assert grad[2].item() == pytest.approx(1 - math.exp(-0.5), abs=1e-14)
    (raw_grad,) = torch.autograd.grad(raw.sum(), logprobs)
    assert raw_grad[1].item() == pytest.approx(1 - math.exp(-30), abs=1e-14)
    for name in ("k1", "k2"):  # no clamp: values grow without bound
        assert abs(ESTIMATORS[name](logprobs, ref)[0].item()) >= 30.0


def test_unknown_names_list_valid_ones(tmp_path):
    from megatron_rl.config import parse_config

    with pytest.raises(ValueError, match=r"k1.*k2.*k3.*low_var_kl"):
        get_estimator("k4")
    path = tmp_path / "cfg.yaml"  # YAML values bypass argparse's choices: TrainConfig.validate
    for key, value, valid in (("kl_placement", "advantage", r"reward, loss, reward\+loss, none"),
                              ("kl_off_policy_correction", "tis", "none, seq-is, token-is"),
                              ("kl_estimator", "kl", "k1, k2, k3, low_var_kl, exact")):
        path.write_text(f"{key}: {value}\n")
        flag = "--" + key.replace("_", "-")
        with pytest.raises(ValueError, match=f"{flag} '{value}'; valid: {valid}"):
            parse_config(["--config", str(path), "--hf-checkpoint", "m", "--train-data", "d"])
    with pytest.raises(ValueError, match="--kl-coef -1.0: must be >= 0"):
        parse_config(["--kl-coef", "-1", "--hf-checkpoint", "m", "--train-data", "d"])
    with pytest.raises(ValueError, match="--kl-is-truncation 0.0: must be > 0"):
        KLConfig(is_truncation=0.0).validate()


def test_reward_penalty_sums_and_is_detached():
    logprobs = t([[-1.0, -2.0, -0.5], [-0.1, -0.2, -9.0]]).requires_grad_()
    ref = t([[-1.5, -1.0, -0.5], [-0.3, -0.2, -0.1]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    cfg = KLConfig("k1", "reward", coef=0.1)
    penalty = kl_reward_penalty(logprobs, ref, mask, cfg)
    assert not penalty.requires_grad
    assert torch.allclose(penalty, t([0.1 * (0.5 - 1.0 + 0.0), 0.1 * (0.2 + 0.0)]), atol=1e-15)
    to_go = kl_reward_to_go_penalty(logprobs, ref, mask, cfg)
    assert torch.allclose(to_go, t([[-0.05, -0.1, 0.0], [0.02, 0.0, 0.0]]), atol=1e-15)
    assert torch.allclose(to_go[:, 0], penalty, atol=1e-15)


def test_importance_weights_token_and_prefix():
    logprobs = t([[-1.0, -1.0, -1.0]])
    old = t([[-1.5, -0.5, -2.0]])
    mask = t([[1, 1, 1]])
    token = importance_weights(logprobs, old, mask, "token")
    assert torch.allclose(token, t([[math.exp(0.5), math.exp(-0.5), math.exp(1.0)]]), atol=1e-14)
    prefix = importance_weights(logprobs, old, mask, "prefix")
    assert torch.allclose(prefix, t([[math.exp(0.5), 1.0, math.exp(1.0)]]), atol=1e-14)
    truncated = importance_weights(logprobs, old, mask, "prefix", truncation=2.0)
    assert torch.allclose(truncated, t([[math.exp(0.5), 1.0, 2.0]]), atol=1e-14)
    with pytest.raises(ValueError, match="token.*prefix"):
        importance_weights(logprobs, old, mask, "sequence")


def test_kl_loss_term_weights_and_gradients():
    logprobs = t([[-1.0, -0.4]]).requires_grad_()
    ref = t([[-0.6, -1.0]])
    old = t([[-1.2, -0.1]])
    mask = t([[1, 1]])
    dk3 = 1 - torch.exp(ref - logprobs.detach())
    omega = torch.exp(logprobs.detach() - old)

    plain = kl_loss_term(logprobs, ref, mask, KLConfig("k3", "loss", coef=0.5))
    (grad,) = torch.autograd.grad(plain.sum(), logprobs)
    assert torch.allclose(grad, 0.5 * dk3, atol=1e-14)

    cfg = KLConfig("k3", "loss", coef=0.5, off_policy_correction="token-is")
    (grad,) = torch.autograd.grad(kl_loss_term(logprobs, ref, mask, cfg, old).sum(), logprobs)
    assert torch.allclose(grad, 0.5 * omega * dk3, atol=1e-14)

    cfg = KLConfig("k3", "loss", coef=0.5, off_policy_correction="token-is", is_weight_grad=True)
    (grad,) = torch.autograd.grad(kl_loss_term(logprobs, ref, mask, cfg, old).sum(), logprobs)
    k3_val = k3(logprobs.detach(), ref)
    assert torch.allclose(grad, 0.5 * omega * (k3_val + dk3), atol=1e-14)

    cfg = KLConfig("k3", "loss", coef=0.5, off_policy_correction="seq-is")
    (grad,) = torch.autograd.grad(kl_loss_term(logprobs, ref, mask, cfg, old).sum(), logprobs)
    assert torch.allclose(grad, 0.5 * torch.cumprod(omega, -1) * dk3, atol=1e-14)
    with pytest.raises(ValueError, match="old_logprobs"):
        kl_loss_term(logprobs, ref, mask, cfg)


def test_reward_is_surrogate_gradient():
    logprobs = t([[-1.0, -0.4, -2.0]]).requires_grad_()
    ref = t([[-0.6, -1.0, -0.3]])
    old = t([[-1.2, -0.1, -2.5]])
    mask = t([[1, 1, 0]])  # the last token is padding
    kl_sum = (logprobs.detach() - ref)[:, :2].sum()
    w = math.exp((logprobs.detach() - old)[:, :2].sum().item())
    cfg = KLConfig("k1", "reward", coef=0.3, off_policy_correction="seq-is")
    (grad,) = torch.autograd.grad(kl_reward_is_surrogate(logprobs, ref, old, mask, cfg).sum(), logprobs)
    assert torch.allclose(grad, 0.3 * w * kl_sum * mask, atol=1e-14)
    # Reward-to-go with per-decision weights: token t gets sum_{s>=t} w_{<=s} K_s.
    cfg = KLConfig("k1", "reward", coef=0.3, off_policy_correction="seq-is", reward_to_go=True)
    (grad,) = torch.autograd.grad(kl_reward_is_surrogate(logprobs, ref, old, mask, cfg).sum(), logprobs)
    kl = (logprobs.detach() - ref)[0]
    prefix = torch.cumprod(torch.exp(logprobs.detach() - old)[0], 0)
    expected = 0.3 * t([prefix[0] * kl[0] + prefix[1] * kl[1], prefix[1] * kl[1], 0.0])
    assert torch.allclose(grad[0], expected, atol=1e-14)


def test_placement_flags():
    assert KLConfig(placement="reward").reward_in_advantage
    assert not KLConfig(placement="reward", off_policy_correction="seq-is").reward_in_advantage
    assert KLConfig(placement="reward+loss").in_loss and not KLConfig(placement="none").in_reward
