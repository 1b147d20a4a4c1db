"""The toy's trajectory study: environment tokens (a tool's output) between the policy's tokens.

The trajectory law P_theta has the policy's factors at its tokens and a fixed environment kernel's
at the others; the KL regularizer is KL(P_theta || P_ref) with the same kernel in both. Checked by
exact enumeration through the production loss: with loss_mask = the policy's tokens the unbiased
configurations are those of the single-turn study; charging the environment's tokens, or putting
their ratios into the seq-is weights, is biased."""
import json

import pytest
import torch

from megatron_rl.experiments.toy import (DEFAULT_ENV, DEFAULT_PARAMS, ENV_LAYOUTS, MODELS,
                                         BinaryARPolicy, _fold_env_ratios, all_sequences,
                                         exact_gradient_moments, main, policy_token_mask,
                                         prefix_features, three_distribution_configs,
                                         three_distribution_kl, trajectory_gradient_moments,
                                         trajectory_kl, trajectory_kl_gradient,
                                         trajectory_kl_gradient_score, trajectory_logprobs,
                                         true_gradient)
from megatron_rl.kl import importance_weights

SEQ_LEN = 6
THETA, REF, OLD = DEFAULT_PARAMS["count"]
ENV = DEFAULT_ENV["count"]
UNBIASED = 1e-20  # bias^2: |E[grad] - g*| below 1e-10
# Unbiased in the single-turn study, on-policy and off-policy under seq-is.
UNBIASED_CONFIGS = ("k1/reward", "k1/reward rtg", "k1/reward+loss", "k3/reward+loss",
                    "exact/reward+loss", "exact/reward+loss later")


def _moments(name, mask_mode="masked", correction="none", off_policy=False, layout="call",
             env=ENV):
    kl = three_distribution_kl(name, correction, "behaviour")
    return trajectory_gradient_moments(THETA, REF, env, SEQ_LEN, kl, mask_mode,
                                       OLD if off_policy else None, layout=layout)


def _sq_bias(grad, layout="call", env=ENV):
    g_star = trajectory_kl_gradient(THETA, REF, env, SEQ_LEN, layout=layout)
    return (grad - g_star).square().sum().item()


def test_layouts_say_which_tokens_are_the_policys():
    y = torch.tensor([[1.0, 0.0, 0.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    # call: a policy 1 is followed by one environment token, then the policy again.
    assert policy_token_mask(y, "call")[0].tolist() == [1, 0, 1, 1, 0, 1]
    assert policy_token_mask(y, "alternate")[0].tolist() == [1, 0, 1, 0, 1, 0]
    with pytest.raises(ValueError, match="environment layout"):
        policy_token_mask(y, "every")


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("layout", ENV_LAYOUTS)
def test_trajectory_law_is_a_distribution(model, layout):
    y = all_sequences(SEQ_LEN)
    mask = policy_token_mask(y, layout)
    policy, env = BinaryARPolicy(*THETA, model=model), BinaryARPolicy(*ENV, model=model)
    with torch.no_grad():
        total = trajectory_logprobs(policy, env, y, mask).sum(-1).exp().sum().item()
    assert total == pytest.approx(1.0, abs=1e-14)
    counts = set(mask.sum(-1)[0].tolist())
    assert counts == ({3.0} if layout == "alternate" else {3.0, 4.0, 5.0, 6.0})


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("layout", ENV_LAYOUTS)
def test_true_gradient_two_ways(model, layout):
    """Autograd of the enumerated KL(P_theta || P_ref) (environment factors kept in both laws)
    equals the score-function sum over the policy's tokens computed without autograd; the KL
    equals E_theta[sum over the policy's tokens of KL_t]."""
    g_auto = trajectory_kl_gradient(THETA, REF, ENV, SEQ_LEN, model, layout)
    g_score = trajectory_kl_gradient_score(THETA, REF, ENV, SEQ_LEN, model, layout)
    assert torch.allclose(g_auto, g_score, atol=1e-12, rtol=0)
    assert g_auto.norm() > 0.1
    kl = trajectory_kl(THETA, REF, ENV, SEQ_LEN, model, layout)
    assert kl == pytest.approx(trajectory_kl(THETA, REF, ENV, SEQ_LEN, model, layout, True),
                               abs=1e-14)


@pytest.mark.parametrize("layout", ENV_LAYOUTS)
@pytest.mark.parametrize("name", UNBIASED_CONFIGS)
def test_masked_environment_tokens_keep_the_unbiased_configurations(name, layout):
    """loss_mask = the policy's tokens: E[grad] = grad KL(P_theta || P_ref) to ~1e-10, on-policy
    and off-policy under seq-is (weights over the policy's tokens)."""
    assert _sq_bias(_moments(name, layout=layout)[0], layout) < UNBIASED
    off = _moments(name, correction="seq-is", off_policy=True, layout=layout)[0]
    assert _sq_bias(off, layout) < UNBIASED


def test_masked_verdicts_are_the_single_turn_ones():
    """Every configuration and regime: unbiased with masked environment tokens exactly when the
    single-turn study (no environment tokens) is unbiased."""
    g_single = true_gradient(THETA, REF, SEQ_LEN)
    for name in three_distribution_configs():
        for off_policy, correction in ((False, "none"), (True, "none"), (True, "token-is"),
                                       (True, "seq-is")):
            kl = three_distribution_kl(name, correction, "behaviour")
            single, _ = exact_gradient_moments(THETA, REF, SEQ_LEN, kl, OLD if off_policy else None)
            single_bias = (single - g_single).square().sum().item()
            masked_bias = _sq_bias(_moments(name, correction=correction, off_policy=off_policy)[0])
            assert (masked_bias < UNBIASED) == (single_bias < UNBIASED), (name, correction)
            assert masked_bias < UNBIASED or masked_bias > 1e-9, (name, correction)


@pytest.mark.parametrize("name", UNBIASED_CONFIGS)
def test_charged_environment_tokens_are_biased(name):
    """loss_mask = every token (environment tokens scored as if the policy had sampled them)."""
    assert _sq_bias(_moments(name, "charged")[0]) > 1e-2
    for correction in ("none", "token-is", "seq-is"):
        assert _sq_bias(_moments(name, "charged", correction, off_policy=True)[0]) > 1e-2


@pytest.mark.parametrize("name", UNBIASED_CONFIGS)
def test_environment_ratios_in_the_seq_is_weights_are_biased(name):
    got = _moments(name, "env-in-weights", "seq-is", off_policy=True)[0]
    assert _sq_bias(got) > 1e-3
    # On-policy every ratio is 1: the weights change nothing.
    on = _moments(name, "env-in-weights")[0]
    assert torch.equal(on, _moments(name)[0])


@pytest.mark.parametrize("layout", ENV_LAYOUTS)
def test_charging_is_the_single_turn_estimator_of_the_all_token_kl(layout):
    """What charged configurations estimate: KL(A_theta || B) over all T tokens, the policy writing
    the environment's tokens too. When the environment is the policy (kernel = A_theta) they are
    the single-turn study's estimators exactly, so the unbiased ones give that KL's gradient."""
    g_all = true_gradient(THETA, REF, SEQ_LEN)
    for name in three_distribution_configs():
        kl = three_distribution_kl(name, "none", "behaviour")
        charged = _moments(name, "charged", layout=layout, env=THETA)
        single = exact_gradient_moments(THETA, REF, SEQ_LEN, kl)
        assert torch.allclose(charged[0], single[0], atol=1e-12, rtol=0), name
        assert charged[1] == pytest.approx(single[1], rel=1e-12)
        if name in UNBIASED_CONFIGS:
            assert (charged[0] - g_all).square().sum().item() < UNBIASED


def test_charged_k1_loss_pushes_the_policy_away_from_the_environment():
    """K1 in the loss, charged: E[grad] = E_theta[sum over environment tokens of
    grad log A_theta(x_t | h_t)] = E_theta[sum_env (q_t - p_t) (1, c_{t-1})] (q_t the kernel's
    probability of a 1): minus the gradient of KL(q || A_theta) at fixed histories, so a descent
    step lowers the policy's probability of the tool outputs it observed. Masked: zero."""
    y = all_sequences(SEQ_LEN)
    mask = policy_token_mask(y, "call")
    policy, env = BinaryARPolicy(*THETA), BinaryARPolicy(*ENV)
    with torch.no_grad():
        prob = trajectory_logprobs(policy, env, y, mask).sum(-1).exp()[0]
        diff = ((torch.sigmoid(env.logits(y)) - torch.sigmoid(policy.logits(y))) * (1 - mask))[0]
        expected = prob @ torch.stack([diff.sum(-1), (diff * prefix_features(y, "count")[0]).sum(-1)],
                                      dim=-1)
    assert torch.allclose(_moments("k1/loss", "charged")[0], expected, atol=1e-12, rtol=0)
    assert expected.norm() > 0.05
    assert _moments("k1/loss")[0].abs().max().item() < 1e-15


def test_folded_ratios_enter_the_production_prefix_weights():
    """`_fold_env_ratios`: the production prefix weight at a policy token t, with the policy-token
    loss_mask, becomes the product of pi_theta/pi_old over every token before and at t."""
    y = torch.tensor([[1.0, 1.0, 0.0, 1.0, 1.0, 0.0]], dtype=torch.float64)  # call: env at 1, 4
    mask = policy_token_mask(y, "call")
    assert mask[0].tolist() == [1, 0, 1, 1, 0, 1]
    logprobs = torch.tensor([[-0.1, -0.7, -0.3, -1.2, -0.4, -0.9]], dtype=torch.float64)
    old = torch.tensor([[-0.2, -0.5, -0.6, -1.0, -0.8, -0.3]], dtype=torch.float64)
    weights = importance_weights(logprobs, _fold_env_ratios(logprobs, old, mask), mask, "prefix")
    every_token = (logprobs - old).cumsum(-1).exp()
    assert torch.allclose(weights, every_token * mask, atol=1e-15, rtol=0)
    masked = importance_weights(logprobs, old, mask, "prefix")
    assert not torch.allclose(masked, weights)


def test_study_and_cli(tmp_path, capsys):
    argv = ["--out", str(tmp_path), "--seq-len", "4", "--num-trials", "0", "--no-plot",
            "--env-tokens", "alternate", "--env", "0.7", "-0.2"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "Trajectories (--env-tokens alternate)" in table and "| off seq-is: env in weights |" in table
    assert "in exactly the regimes where the single-turn study finds it unbiased" in table
    result = json.loads((tmp_path / "results.json").read_text())
    traj = result["trajectory"]
    assert traj["layout"] == "alternate" and traj["env"] == [0.7, -0.2] and traj["seq_len"] == 4
    rows = {(r["config"], r["sampling"], r["correction"], r["mask"]): r for r in traj["rows"]}
    assert rows["k1/reward", "on-policy", "none", "masked"]["biased"] is False
    assert rows["k1/reward", "on-policy", "none", "charged"]["biased"] is True
    # The single-turn rows are those of a run without the option.
    plain = tmp_path / "plain"
    assert main(["--out", str(plain), "--seq-len", "4", "--num-trials", "0", "--no-plot",
                 "--json"]) == 0
    plain_result = json.loads((plain / "results.json").read_text())
    assert "trajectory" not in plain_result and result["rows"] == plain_result["rows"]
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--env", "0.7", "-0.2"])  # --env needs --env-tokens
