"""The sweep specification, the instability/collapse criteria and the aggregation (pure)."""
import math

import pytest

from megatron_rl.config import parse_config
from megatron_rl.experiments.sweep import (CONFIGS, POLICY_LOSS_CLIPS, SLICES, TRAINER_CLIPS,
                                     CollapseCriteria, RunSpec, StabilityCriteria, aggregate,
                                     build_sweep, detect_collapse, detect_instability,
                                     format_mean_std, is_complete, markdown_table, mean_curve,
                                     mean_std, moving_average, regime_flags, summarize_run,
                                     verdict)


def _rows(n=20, **series):
    """n steady rows; series maps a key to {step: value} overrides or a callable of the step."""
    rows = []
    for step in range(1, n + 1):
        r = {"step": step, "reward/mean": 0.5, "grad_norm": 1.0, "kl_k1": 0.05, "loss": 0.1,
             "skipped_update": 0.0, "entropy": 1.0, "response/length_mean": 4.0}
        for key, val in series.items():
            if callable(val):
                r[key] = val(step)
            elif step in val:
                r[key] = val[step]
        rows.append(r)
    return rows


# -------------------------------------------------------------------------------- specification
def test_full_sweep_size_and_none_once_per_seed_and_regime():
    specs = build_sweep(seeds=(1, 2, 3), regimes=("on", "off"))
    # 6 KL configs x 4 betas + none, per seed and regime
    assert len(specs) == (6 * 4 + 1) * 3 * 2
    assert len(set(s.run_id for s in specs)) == len(specs)
    nones = [s for s in specs if s.config == "none"]
    assert len(nones) == 6 and all(s.beta == 0.0 for s in nones)
    assert [s.seed for s in specs[:25]] == [1] * 25  # seed-major


def test_exact_slice():
    """The issue-14 slice: exact in reward and reward+loss beside K1 in reward, K3 in loss and no
    KL; the
    default sweep (the paper's grid) does not include the exact configs."""
    assert set(SLICES["grid"]) | set(SLICES["exact"]) <= set(CONFIGS)
    assert not any(s.config.startswith("exact") for s in build_sweep(betas=(1.0,), seeds=(1,)))
    specs = build_sweep(SLICES["exact"], betas=(1.0,), seeds=(1, 2, 3), regimes=("on", "off"))
    assert len(specs) == 5 * 3 * 2
    assert [s.run_id for s in specs[:5]] == ["none_s1_on", "k1-reward_b1_s1_on", "k3-loss_b1_s1_on",
                                             "exact-reward_b1_s1_on", "exact-reward_loss_b1_s1_on"]
    flags = specs[4].train_flags()
    assert flags[flags.index("--kl-estimator") + 1] == "exact"
    assert flags[flags.index("--kl-placement") + 1] == "reward+loss"
    off = [s for s in specs if s.regime == "off"][0].train_flags()
    assert off[off.index("--ppo-minibatches") + 1] == "4"


def test_reproduce_slice_options():
    """tools/reproduce.py --slice exact: the slice's configs, no toy, no async, its own markers
    and figure names; the default stays the grid (markers unchanged)."""
    import importlib
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools"))
    reproduce = importlib.import_module("reproduce")

    a = reproduce.parse_args(["--slice", "exact", "--betas", "1", "--steps", "40"])
    assert a.configs == list(SLICES["exact"]) and a.async_levels == [] and a.skip_toy
    assert a.figure_prefix == "exact_"
    assert reproduce.markers("exact")[0] != reproduce.BEGIN
    g = reproduce.parse_args([])
    assert g.configs == list(SLICES["grid"]) and g.async_levels == [2] and not g.skip_toy
    assert reproduce.markers("grid") == (reproduce.BEGIN, reproduce.END) and g.figure_prefix == ""
    assert g.policy_losses == ["ppo-clip"] and not g.by_loss and not a.by_loss
    losses = reproduce.parse_args(["--slice", "losses", "--betas", "1", "--regimes", "on"])
    assert losses.configs == ["k1:reward", "k3:loss"] and losses.async_levels == []
    assert losses.policy_losses == ["ppo-clip", "gspo", "cispo"] and losses.by_loss
    assert losses.figure_prefix == "losses_" and reproduce.markers("losses")[0].endswith(
        "--slice losses) -->")


def test_losses_slice_crosses_policy_losses_with_their_clips():
    """--slice losses: K1 in reward and K3 in loss x (ppo-clip, gspo, cispo); the default loss
    keeps its run ids and flags, the others carry the loss in the id and their clip range."""
    specs = build_sweep(SLICES["losses"], betas=(1.0,), seeds=(1, 2, 3), regimes=("on",),
                        policy_losses=("ppo-clip", "gspo", "cispo"))
    assert len(specs) == 2 * 3 * 3 and len({s.run_id for s in specs}) == len(specs)
    assert [s.run_id for s in specs[:6]] == [
        "k1-reward_b1_s1_on", "k3-loss_b1_s1_on", "gspo_k1-reward_b1_s1_on",
        "gspo_k3-loss_b1_s1_on", "cispo_k1-reward_b1_s1_on", "cispo_k3-loss_b1_s1_on"]
    assert [s.seed for s in specs[:6]] == [1] * 6  # seed-major
    ppo, gspo, cispo = specs[1], specs[3], specs[5]
    assert ppo.train_flags() == RunSpec("k3:loss", 1.0, 1).train_flags()
    assert not any(f.startswith(("--policy-loss", "--clip")) for f in ppo.train_flags())
    for spec, low, high in ((ppo, *TRAINER_CLIPS), (gspo, 3e-4, 4e-4), (cispo, 1.0, 0.28)):
        cfg = parse_config(["--hf-checkpoint", "x", "--train-data", "t.jsonl", "--save", "s",
                            "--num-prompts-per-step", "32", *spec.train_flags()])
        assert (cfg.loss.policy_loss, cfg.loss.clip_low, cfg.loss.clip_high) == (
            spec.policy_loss, low, high)
        assert (cfg.loss.kl.estimator, cfg.loss.kl.placement) == CONFIGS[spec.config]
    # the trainer's own defaults are what TRAINER_CLIPS says ppo-clip trains with
    cfg = parse_config(["--hf-checkpoint", "x", "--train-data", "t.jsonl", "--save", "s"])
    assert (cfg.loss.policy_loss, cfg.loss.clip_low, cfg.loss.clip_high) == ("ppo-clip", *TRAINER_CLIPS)
    # the default sweep is the trainer's loss only, ids unchanged
    assert {s.policy_loss for s in build_sweep(seeds=(1,))} == {"ppo-clip"}
    with pytest.raises(ValueError, match="--policy-loss 'reinforce'"):
        RunSpec("k1:reward", 1.0, 1, policy_loss="reinforce")


@pytest.mark.parametrize("loss", list(POLICY_LOSS_CLIPS))
def test_every_policy_loss_flag_parses_in_the_trainer(loss):
    flags = RunSpec("k1:reward", 1.0, 1, policy_loss=loss).train_flags()
    cfg = parse_config(["--hf-checkpoint", "x", "--train-data", "t.jsonl", "--save", "s", *flags])
    assert cfg.loss.policy_loss == loss


def test_aggregate_and_table_by_policy_loss():
    """Seeds are grouped per (loss, config); the loss table names each loss's clip range and the
    final training reward; the default table is unchanged by the loss field."""
    summaries = []
    for loss, reward in (("cispo", 0.3), ("ppo-clip", 0.5), ("gspo", 0.4)):
        for seed in (1, 2):
            rows = _rows(n=10, **{"eval/mean_at_k": {10: 0.2}, "reward/mean": lambda s: reward})
            summaries.append(summarize_run(RunSpec("k3:loss", 1.0, seed, policy_loss=loss), rows,
                                           ood_mean_at_k=0.05))
    table = aggregate(summaries)
    assert [(r["policy_loss"], r["num_seeds"]) for r in table] == [
        ("ppo-clip", 2), ("gspo", 2), ("cispo", 2)]
    md = markdown_table(table, k=4, base={"eval": 0.16, "ood": 0.05}, policy_losses=True)
    lines = md.splitlines()
    assert all(line.count("|") == 11 for line in lines)
    assert ("| on | gspo (0.0003/0.0004) | k3:loss | 1 | 2 | 0.400 ± 0.000 | 0.200 ± 0.000 | "
            "0.050 ± 0.000 |") in md
    assert "| on | cispo (1/0.28) | k3:loss |" in md and "| on | ppo-clip (0.2/0.2) |" in md
    plain = markdown_table(table[:1], k=4)
    assert plain.splitlines()[:2] == [
        "| regime | config | beta | seeds | in-domain mean@4 | OOD mean@4 | final KL (k1/token) "
        "| verdict |", "|---|---|---|---|---|---|---|---|"]


def test_async_slice():
    specs = build_sweep(configs=(), seeds=(1,), regimes=(), async_levels=(2,), async_betas=(0.1,))
    assert [s.run_id for s in specs] == ["none_s1_async2", "k1-reward_b0.1_s1_async2",
                                         "k3-loss_b0.1_s1_async2", "k1-reward_seq-is_b0.1_s1_async2"]
    flags = specs[-1].train_flags()
    assert flags[flags.index("--kl-off-policy-correction") + 1] == "seq-is"
    assert flags[flags.index("--async-level") + 1] == "2"


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("regime", ["on", "off", "async1"])
def test_flags_parse_in_the_trainer(config, regime, tmp_path):
    if regime.startswith("async") and config not in ("none", "k1:reward", "k3:loss"):
        pytest.skip("not part of the async slice")
    spec = RunSpec(config, 0.0 if config == "none" else 0.3, 2, regime)
    cfg = parse_config(["--hf-checkpoint", "x", "--train-data", "t.jsonl", "--save",
                        str(tmp_path), "--num-prompts-per-step", "32", *spec.train_flags()])
    est, placement = CONFIGS[config]
    assert (cfg.loss.kl.estimator, cfg.loss.kl.placement, cfg.seed) == (est, placement, 2)
    assert cfg.algorithm.ppo_minibatches == regime_flags(regime)["ppo_minibatches"]
    assert cfg.algorithm.async_level == regime_flags(regime)["async_level"]


def test_bad_names_raise():
    with pytest.raises(ValueError, match="valid"):
        RunSpec("k2:reward", 0.1, 1)
    with pytest.raises(ValueError, match="valid"):
        RunSpec("k1:reward", 0.1, 1, "async0")
    with pytest.raises(ValueError, match="valid"):
        RunSpec("k1:reward+seq-is", 0.1, 1, "on")


# -------------------------------------------------------------------------------- instability
def test_steady_run_is_stable():
    rows = _rows()
    assert detect_instability(rows) == [] and detect_collapse(rows) == []
    assert verdict([], []) == "stable"


def test_moving_average():
    assert moving_average([1, 2, 3, 4], 2) == [1, 1.5, 2.5, 3.5]


def test_aborted_and_nonfinite():
    rows = _rows(skipped_update={7: 1.0})
    assert detect_instability(rows) == ["nonfinite@7"]
    rows = _rows(grad_norm={9: float("nan")})
    assert detect_instability(rows, returncode=1) == ["aborted(rc=1)", "nonfinite@9"]


def test_grad_spike_threshold():
    c = StabilityCriteria(window=5, grad_spike_factor=10.0)
    assert detect_instability(_rows(grad_norm={12: 9.9}), criteria=c) == []
    assert detect_instability(_rows(grad_norm={12: 10.5}), criteria=c) == ["grad_spike@12"]
    # within the first window there is no history to compare to
    assert detect_instability(_rows(grad_norm={3: 100.0}), criteria=c) == []


def test_grad_spike_in_one_ppo_minibatch_is_seen_through_grad_norm_max():
    """One of a step's minibatches spikes to 40: the step's mean grad norm (9.0) stays under 10x
    the preceding median (1.0), the max over its minibatches (40 vs 1.2) does not."""
    c = StabilityCriteria(window=5, grad_spike_factor=10.0)
    rows = _rows(grad_norm={12: 9.0}, grad_norm_max=lambda step: 40.0 if step == 12 else 1.2)
    assert detect_instability(rows, criteria=c) == ["grad_spike@12"]
    # the mean alone would not have fired
    assert detect_instability([{k: v for k, v in r.items() if k != "grad_norm_max"}
                               for r in rows], criteria=c) == []


def test_kl_blowup_uses_moving_average():
    c = StabilityCriteria(window=5, kl_max=1.0)
    assert detect_instability(_rows(kl_k1={10: 3.0}), criteria=c) == []  # one step: avg 0.64
    rising = _rows(kl_k1=lambda s: 0.1 * s)
    assert detect_instability(rising, criteria=c) == ["kl_blowup@13"]  # avg of 0.9..1.3 = 1.1


# -------------------------------------------------------------------------------- collapse
def test_reward_collapse():
    c = CollapseCriteria(window=5, frac=0.5)
    falling = _rows(**{"reward/mean": lambda s: 0.6 if s <= 10 else 0.1})
    assert detect_collapse(falling, criteria=c)[0].startswith("reward_collapse")
    # a reward that never rose above min_best cannot collapse
    assert detect_collapse(_rows(**{"reward/mean": lambda s: 0.04 if s < 5 else 0.0}),
                           criteria=c) == []


def test_eval_collapse_counts_the_base_model():
    rows = _rows(**{"eval/mean_at_k": {10: 0.12, 20: 0.08}})
    assert detect_collapse(rows) == []
    assert detect_collapse(rows, base_eval=0.2)[0].startswith("eval_collapse")


def test_length_and_entropy_collapse():
    rows = _rows(**{"response/length_mean": lambda s: 4.0 if s < 10 else 1.0,
                    "entropy": lambda s: 1.0 if s < 10 else 0.05})
    names = [r.split("(")[0] for r in detect_collapse(rows)]
    assert names == ["length_collapse", "entropy_collapse"]
    assert verdict(["grad_spike@3"], ["length_collapse"]) == "unstable+collapsed"


# -------------------------------------------------------------------------------- aggregation
def test_is_complete():
    rows = _rows(n=10, **{"eval/mean_at_k": {10: 0.3}})
    assert is_complete(rows, 10, {"mean_at_k": 0.1})
    assert not is_complete(rows, 10, None)
    assert is_complete(rows, 10, None, need_ood=False)
    assert not is_complete(rows[:-1], 10, {"mean_at_k": 0.1})
    assert not is_complete([], 10, {})


def test_mean_std():
    assert mean_std([1.0, 3.0, None]) == (2.0, math.sqrt(2.0), 2)
    assert mean_std([0.5]) == (0.5, None, 1)
    assert mean_std([None]) == (None, None, 0)
    assert format_mean_std((0.5, None, 1)) == "0.500"
    assert format_mean_std((0.5, 0.1, 2)) == "0.500 ± 0.100"


def test_aggregate_groups_seeds_and_orders_rows():
    summaries = []
    for config, beta in (("k3:loss", 0.1), ("none", 0.0), ("k1:reward", 0.1)):
        for seed, acc in ((1, 0.2), (2, 0.4)):
            rows = _rows(n=10, **{"eval/mean_at_k": {10: acc}})
            if config == "k3:loss" and seed == 2:
                rows[4]["skipped_update"] = 1.0
            summaries.append(summarize_run(RunSpec(config, beta, seed), rows, ood_mean_at_k=acc / 2))
    table = aggregate(summaries)
    assert [r["config"] for r in table] == ["none", "k1:reward", "k3:loss"]
    k3 = table[2]
    assert k3["num_seeds"] == 2 and k3["num_unstable"] == 1 and k3["reasons"] == ["nonfinite"]
    assert k3["eval_mean_at_k"][0] == pytest.approx(0.3)
    assert k3["ood_mean_at_k"][0] == pytest.approx(0.15)
    md = markdown_table(table, k=4, base={"eval": 0.16, "ood": 0.05})
    assert "| on | k3:loss | 0.1 | 2 | 0.300 ± 0.141 | 0.150 ± 0.071 |" in md
    assert "unstable 1/2 [nonfinite]" in md and "| on | none | - |" in md


def test_mean_curve():
    a = [{"step": 1, "x": 1.0}, {"step": 2, "x": 3.0}]
    b = [{"step": 1, "x": 3.0}]
    assert mean_curve([a, b], "x") == [(1, 2.0)]
    assert mean_curve([a, []], "x") == [(1, 1.0), (2, 3.0)]
