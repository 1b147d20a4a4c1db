"""--dynamic-sampling's choice of the batch (dynamic_sampling.select_groups, refill_size),
its flags, and the advantages of a group without task-reward spread kept for its KL terms
(--dynamic-sampling-keep-kl). The rounds on a real engine: tests/e2e/test_dynamic_sampling.py."""
import pytest
import torch

from megatron_rl.batch import Trajectory
from megatron_rl.config import parse_config
from megatron_rl.kl import KLConfig
from megatron_rl.loss import LossConfig, build_advantages
from megatron_rl.dynamic_sampling import has_spread, refill_size, select_groups

BASE = ["--hf-checkpoint", "m", "--train-data", "d.jsonl"]
T, F = True, False


def _group(*rewards):
    return [Trajectory([1], [2], [1], [-0.5], "stop", r) for r in rewards]


def test_a_group_has_spread_when_its_task_rewards_differ():
    assert has_spread(_group(0.0, 1.0)) and has_spread(_group(0.05, 0.01, 0.05))
    assert not has_spread(_group(1.0, 1.0, 1.0)) and not has_spread(_group(0.0, 0.0))


def test_an_episode_its_environment_broke_gives_no_spread():
    """A trajectory without a token of the policy's (an env_error episode: reward 0, mask 0) is
    out of its group's baseline, so it cannot make the group informative: [failed 0, 1, 1, 1]
    has every advantage 0."""
    broken = Trajectory([1], [2, 3], [0, 0], [0.0, 0.0], "stop", 0.0)
    assert not has_spread([broken, *_group(1.0, 1.0, 1.0)])
    assert has_spread([broken, *_group(1.0, 0.0)])
    assert not has_spread([broken, *_group(1.0)])


def test_the_filter_keeps_exactly_the_first_target_groups_with_spread():
    assert select_groups([F, T, F, F], 2) is None  # not yet: another round
    s = select_groups([F, T, F, F, T, T, F, T], 2)
    # the prefix ends at the 2nd with spread; the groups after it go back to the data
    assert (s.consumed, s.kept, s.found) == (5, [1, 4], 2)
    s = select_groups([T, T, T, T], 4)
    assert (s.consumed, s.kept) == (4, [0, 1, 2, 3])


def test_keep_kl_keeps_the_whole_prefix_a_multiple_of_the_unit():
    # 2 with spread by group 4, but 5 groups do not split over a unit of 2: one more
    assert select_groups([F, T, F, F, T], 2, unit=2, keep_filtered=True) is None
    s = select_groups([F, T, F, F, T, F, T], 2, unit=2, keep_filtered=True)
    assert (s.consumed, s.kept, s.found) == (6, [0, 1, 2, 3, 4, 5], 2)


def test_on_the_last_round_the_batch_is_what_there_is():
    # the filter: all with spread, topped up with the first without spread, `target` groups
    s = select_groups([F, F, T, F, F, F], 4, last_round=True)
    assert (s.consumed, s.kept, s.found) == (4, [0, 1, 2, 3], 1)
    s = select_groups([F, F, F, F, T, F], 2, last_round=True)
    assert (s.consumed, s.kept, s.found) == (5, [0, 4], 1)
    # keep-kl: the longest prefix that splits over the unit
    s = select_groups([F, F, T, F, F, F, F], 4, unit=2, keep_filtered=True, last_round=True)
    assert (s.consumed, s.kept, s.found) == (6, list(range(6)), 1)


def test_a_refill_round_draws_what_the_rate_so_far_says_completes_the_batch():
    assert refill_size([T, F, F, F], 4) == 12  # 3 missing at 1 in 4
    assert refill_size([F] * 4, 4) == 4  # none with spread yet: a batch
    assert refill_size([T] + [F] * 99, 4) == 16  # at most 4 batches
    # keep-kl with the target found: up to the next multiple of the unit
    assert refill_size([T, T, F], 2, unit=4, keep_filtered=True) == 1


def test_flags_and_their_checks():
    cfg = parse_config(BASE)
    assert not cfg.algorithm.dynamic_sampling and not cfg.algorithm.keeps_filtered_groups()
    cfg = parse_config(BASE + ["--dynamic-sampling", "--dynamic-sampling-max-rounds", "2"])
    assert cfg.algorithm.keeps_filtered_groups() and cfg.algorithm.dynamic_sampling_max_rounds == 2
    # no KL term: nothing to keep the filtered groups for
    assert not parse_config(BASE + ["--dynamic-sampling", "--kl-placement", "none"]
                            ).algorithm.keeps_filtered_groups()
    with pytest.raises(ValueError, match="--dynamic-sampling with --advantage-estimator "
                                         "reinforce"):
        parse_config(BASE + ["--dynamic-sampling", "--advantage-estimator", "reinforce"])
    with pytest.raises(ValueError, match="--dynamic-sampling-max-rounds -1: must be >= 0"):
        parse_config(BASE + ["--dynamic-sampling-max-rounds", "-1"])


def test_a_group_without_spread_kept_for_its_kl_has_the_centred_kl_as_its_advantage():
    """K1 in the reward with RLOO: the task part of a group with equal rewards is 0 and what is
    left is -beta (K_i - mean_{j != i} K_j), the KL penalties centred by the others'. With the KL
    in the loss the advantage is 0 and the group's gradient is its loss-side KL alone."""
    torch.manual_seed(0)
    n, steps = 4, 5
    logprobs, ref = -torch.rand(2 * n, steps), -torch.rand(2 * n, steps)
    mask = torch.ones(2 * n, steps)
    rewards = torch.tensor([1.0] * n + [0.0, 1.0, 0.0, 0.0])  # group 0: no spread
    cfg = LossConfig(kl=KLConfig(placement="reward", coef=0.1))
    adv = build_advantages(rewards, logprobs, ref, mask, cfg, n)
    penalty = 0.1 * (logprobs - ref).sum(-1)[:n]
    centred = -(penalty - (penalty.sum() - penalty) / (n - 1))
    torch.testing.assert_close(adv[:n], centred)
    assert centred.abs().min() > 1e-3  # not 0: the group carries the KL's gradient
    task_only = build_advantages(rewards, logprobs, ref, mask,
                                 LossConfig(kl=KLConfig(placement="loss", coef=0.1)), n)
    assert task_only[:n].abs().max() < 1e-7 and task_only[n:].abs().max() > 0.1
