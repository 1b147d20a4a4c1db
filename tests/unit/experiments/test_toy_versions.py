"""The versions study of the toy (`megatron-rl toy --versions`): samples whose tokens came from two
weight versions (a prefix from the older, the rest from the newer), enumerated exactly through the
production loss. What a user of partial rollouts relies on: seq-is against each token's own
version (its rollout_logprobs) gives the unbiased gradient of the sequence-level reverse KL for the
placements unbiased on-policy; one version's mu for the whole sequence, token-level weights and
the policy-gradient rollout corrections do not; a switch at 0 or T is the single-mu study."""
import json

import pytest
import torch

from megatron_rl.correction import RolloutCorrectionConfig, rollout_correction_weights
from megatron_rl.experiments.toy import (DEFAULT_PARAMS, PG_CONFIGS, VERSION_COLUMNS,
                                         BinaryARPolicy, all_sequences, exact_gradient_moments,
                                         main, mixed_version_logprobs, mixed_version_moments,
                                         pg_corrections, switch_branches,
                                         three_distribution_configs, three_distribution_kl,
                                         true_gradient)

SEQ_LEN = 6
THETA, REF, OLD = DEFAULT_PARAMS["count"]
OLDER, NEWER = (1.3, -0.05), (1.1, -0.1)  # two versions before pi_old = OLD, on the way to THETA
UNBIASED = 1e-20
SWITCHES = ("random", "3", "ones:2")
SEQ_IS_UNBIASED = ("k1/reward", "k1/reward rtg", "k1/reward+loss", "k3/reward+loss",
                   "exact/reward+loss", "exact/reward+loss later")


def _mixed(kl, switch, record="own", pg=None, old=OLD):
    return mixed_version_moments(THETA, REF, old, OLDER, NEWER, SEQ_LEN, kl, switch,
                                 record=record, pg_correction=pg)


def _sq_bias(grad):
    return (grad - true_gradient(THETA, REF, SEQ_LEN)).square().sum().item()


@pytest.mark.parametrize("switch", SWITCHES)
def test_switch_laws_are_predictable_and_sum_to_one(switch):
    """Whether token t is the older version's depends on y_<t only, and the mixed sampler
    q(y, v) = P(v | y) prod_t mu_v(t)(y_t | y_<t) is a distribution over (sequence, outcome)."""
    y = all_sequences(SEQ_LEN)[0]
    branches = switch_branches(y, switch)
    total = 0.0
    for prob, older in branches:
        for t in range(SEQ_LEN):
            # sequences sharing y_<t share the version of token t
            prefix = y[:, :t] @ (2.0 ** torch.arange(t, dtype=y.dtype))
            for key in prefix.unique():
                assert older[prefix == key, t].unique().numel() == 1
        own, _ = mixed_version_logprobs(OLDER, NEWER, y[None], older[None])
        total += (prob * own[0].sum(-1).exp()).sum().item()
    assert total == pytest.approx(1.0, abs=1e-13)
    if switch == "ones:2":  # 0 1 1 0 ...: the older version up to and including the second one
        assert branches[0][1][y.tolist().index([0, 1, 1, 0, 0, 0])].tolist() == [1, 1, 1, 0, 0, 0]


@pytest.mark.parametrize("switch", SWITCHES)
@pytest.mark.parametrize("name", SEQ_IS_UNBIASED)
def test_seq_is_against_each_tokens_own_version_is_unbiased_and_one_mu_is_not(name, switch):
    kl = three_distribution_kl(name, "seq-is", "rollout")
    assert _sq_bias(_mixed(kl, switch)[0]) < UNBIASED
    assert _sq_bias(_mixed(kl, switch, record="last")[0]) > 1e-4


@pytest.mark.parametrize("name", three_distribution_configs())
def test_token_level_weights_and_no_correction_are_biased(name):
    for correction, proposal in (("none", "behaviour"), ("token-is", "rollout"),
                                 ("seq-is", "behaviour")):
        assert _sq_bias(_mixed(three_distribution_kl(name, correction, proposal), "random")[0]) > 1e-3


@pytest.mark.parametrize("name", PG_CONFIGS)
def test_policy_gradient_corrections_on_each_tokens_version_leave_the_advantage_kl_biased(name):
    kl = three_distribution_kl(name, "none", "behaviour")
    for pg in pg_corrections(2.0).values():
        assert _sq_bias(_mixed(kl, "random", pg=pg)[0]) > 1e-2


def test_one_mu_bias_is_the_older_tokens_ratio():
    """Switch S fixed, sequence weight A_theta / prod_t mu_B: E_q[(A_theta/mu_B)(y) R S] =
    E_theta[(q/mu_B)(y) R S] with q/mu_B = prod_{t<=S} (mu_A/mu_B)(y_t | y_<t), the older
    tokens' ratio left in (K1 in the reward, R = sum_t K1_t, S = the score)."""
    switch = 3
    y = all_sequences(SEQ_LEN).transpose(0, 1)
    policy = BinaryARPolicy(*THETA, num_copies=y.shape[0])
    seq_lp = policy(y).sum((-1, -2))
    score = torch.stack(torch.autograd.grad(seq_lp.sum(), [policy.a, policy.b]), dim=-1)
    with torch.no_grad():
        lp_ref = BinaryARPolicy(*REF)(y).sum((-1, -2))
        lp_a, lp_b = (BinaryARPolicy(*p)(y)[..., :switch].sum((-1, -2)) for p in (OLDER, NEWER))
    seq_lp = seq_lp.detach()
    expected = (seq_lp.exp() * (lp_a - lp_b).exp() * (seq_lp - lp_ref)) @ score
    got = _mixed(three_distribution_kl("k1/reward", "seq-is", "rollout"), str(switch), "last")[0]
    assert torch.allclose(got, expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("name", three_distribution_configs())
def test_a_switch_at_zero_or_at_t_is_the_single_mu_study(name):
    """S = 0: every token from the newer version; S = T: from the older; each column equals the
    three-distribution study (`--rollout`) with that version as mu."""
    for switch, mu in (("0", NEWER), (str(SEQ_LEN), OLDER)):
        for correction, proposal, record in VERSION_COLUMNS:
            if record == "last" and mu != NEWER:
                continue
            kl = three_distribution_kl(name, correction, proposal)
            got = _mixed(kl, switch, record)
            single = exact_gradient_moments(THETA, REF, SEQ_LEN, kl, OLD, rollout=mu)
            assert torch.allclose(got[0], single[0], atol=1e-12, rtol=0)
            assert got[1] == pytest.approx(single[1], rel=1e-12)
    pg = pg_corrections(2.0)["seq-mis [0.5, 2]"]
    kl = three_distribution_kl("k1/reward", "none", "behaviour")
    got = _mixed(kl, "0", pg=pg)[0]
    assert torch.allclose(got, exact_gradient_moments(THETA, REF, SEQ_LEN, kl, OLD, rollout=NEWER,
                                                      pg_correction=pg)[0], atol=1e-12, rtol=0)


@pytest.mark.parametrize("name", SEQ_IS_UNBIASED)
def test_engine_logprobs_as_pi_old_make_the_default_proposal_the_own_version(name):
    """--old-logprobs rollout: pi_old per token is the version that sampled it, so seq-is against
    pi_old (--kl-is-proposal behaviour) is seq-is against each token's own version."""
    got = _mixed(three_distribution_kl(name, "seq-is", "behaviour"), "random", old=None)[0]
    assert torch.allclose(got, _mixed(three_distribution_kl(name, "seq-is", "rollout"), "random")[0],
                          atol=1e-12, rtol=0)


def test_rollout_correction_weighs_each_token_by_its_own_version():
    """correction.py takes per-token rollout_logprobs: on a mixed record its token weight is
    pi_old/mu_v(t) at token t and seq-mis's rho the product over the tokens' own versions."""
    y = all_sequences(SEQ_LEN)[0]
    (_, older), = switch_branches(y, "2")
    own = mixed_version_logprobs(OLDER, NEWER, y[None], older[None])[0][0]
    old = BinaryARPolicy(*OLD)(y[None])[0]
    mask = torch.ones_like(y)
    tis, _ = rollout_correction_weights(old, own, mask, RolloutCorrectionConfig("tis", 0.0, 1e30))
    mu = torch.where(older > 0, BinaryARPolicy(*OLDER)(y[None])[0], BinaryARPolicy(*NEWER)(y[None])[0])
    assert torch.allclose(tis.double(), (old - mu).exp(), rtol=1e-6, atol=0)
    mis, _ = rollout_correction_weights(old, own, mask,
                                        RolloutCorrectionConfig("seq-mis", 0.0, 1e30))
    assert torch.allclose(mis[:, 0].double(), (old - mu).sum(-1).exp(), rtol=1e-5, atol=0)


def test_main_with_versions_prints_the_versions_study(tmp_path, capsys):
    argv = ["--out", str(tmp_path), "--seq-len", "5", "--num-trials", "0", "--no-plot",
            "--versions", *map(str, OLDER + NEWER), "--switch", "ones:1"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "Mixed versions" in table and "| seq-is / mu_t |" in table
    study = json.loads((tmp_path / "results.json").read_text())["versions"]
    assert (study["older"], study["newer"], study["switch"]) == (list(OLDER), list(NEWER), "ones:1")
    rows = {(r["table"], r["config"], r["correction"], r["proposal"], r["record"],
             r["pg_correction"]): r for r in study["rows"]}
    for name in SEQ_IS_UNBIASED:
        assert rows["kl", name, "seq-is", "rollout", "own", "none"]["biased"] is False
        assert rows["kl", name, "seq-is", "rollout", "last", "none"]["biased"] is True
    assert study["weights"]["own"]["mean"] == pytest.approx(1.0, abs=1e-13)
    assert [e["switch"] for e in study["by_switch"]] == list(range(6))
    assert study["by_switch"][0]["weights"]["last"]["mean"] == pytest.approx(1.0, abs=1e-13)
    for bad in (["--switch", "6"], ["--switch", "ones:0"], ["--switch", "later"]):
        with pytest.raises(SystemExit):
            main(argv + bad)
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--switch", "2"])  # needs --versions
