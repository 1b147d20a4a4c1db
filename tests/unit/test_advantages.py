"""RLOO, GRPO, Dr. GRPO and REINFORCE advantages against hand computation."""
import math

import pytest
import torch

from megatron_rl.advantages import ADVANTAGE_ESTIMATORS, compute_advantages

F64 = torch.float64


def t(values):
    return torch.tensor(values, dtype=F64)


RETURNS = t([1.0, 0.0, 0.0, 1.0, 2.0, 4.0, 6.0, 9.0])


def test_rloo_by_hand():
    adv = compute_advantages("rloo", RETURNS, group_size=4)
    expected = t([1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3,
                  2 - 19 / 3, 4 - 17 / 3, 6 - 15 / 3, 9 - 12 / 3])
    assert torch.allclose(adv, expected, atol=1e-14)


def test_grpo_by_hand():
    adv = compute_advantages("grpo", RETURNS, group_size=4)
    std1 = math.sqrt((0.25 * 4) / 3)  # Bessel-corrected std of [1, 0, 0, 1]
    mean2 = 21 / 4
    std2 = math.sqrt(sum((x - mean2) ** 2 for x in (2, 4, 6, 9)) / 3)
    expected = t([0.5 / std1, -0.5 / std1, -0.5 / std1, 0.5 / std1]
                 + [(x - mean2) / std2 for x in (2, 4, 6, 9)])
    assert torch.allclose(adv, expected, atol=1e-5)  # eps = 1e-6 in the denominator


def test_dr_grpo_and_rloo_relation():
    dr = compute_advantages("dr_grpo", RETURNS, group_size=4)
    assert torch.allclose(dr, t([0.5, -0.5, -0.5, 0.5, -3.25, -1.25, 0.75, 3.75]), atol=1e-14)
    # RLOO = n / (n - 1) * (R - group mean).
    assert torch.allclose(compute_advantages("rloo", RETURNS, 4), dr * 4 / 3, atol=1e-14)
    assert torch.equal(compute_advantages("reinforce", RETURNS, 1), RETURNS)


def test_constant_group_gives_zero_grpo():
    adv = compute_advantages("grpo", t([3.0, 3.0, 3.0]), group_size=3)
    assert torch.equal(adv, torch.zeros(3, dtype=F64))


def test_per_token_rloo_with_mask():
    returns = t([[1.0, 2.0, 3.0], [5.0, 4.0, 0.0], [0.0, 1.0, 7.0]])
    mask = t([[1, 1, 1], [1, 1, 0], [1, 1, 1]])
    adv = compute_advantages("rloo", returns, group_size=3, loss_mask=mask)
    expected = t([[1 - 2.5, 2 - 2.5, 3 - 7.0],
                  [5 - 0.5, 4 - 1.5, 0.0],
                  [0 - 3.0, 1 - 3.0, 7 - 3.0]])
    assert torch.allclose(adv, expected, atol=1e-14)
    dr = compute_advantages("dr_grpo", returns, group_size=3, loss_mask=mask)
    assert torch.allclose(dr[:, 2], t([3 - 5.0, 0.0, 7 - 5.0]), atol=1e-14)


def test_bad_group_sizes_and_names():
    with pytest.raises(ValueError, match="multiple of group_size"):
        compute_advantages("rloo", RETURNS, group_size=3)
    for name in ("rloo", "grpo", "dr_grpo"):
        with pytest.raises(ValueError, match="group_size >= 2"):
            compute_advantages(name, RETURNS, group_size=1)
    with pytest.raises(ValueError, match="positive int"):
        compute_advantages("rloo", RETURNS, group_size=0)
    with pytest.raises(ValueError, match=r"dr_grpo.*grpo.*reinforce.*rloo"):
        compute_advantages("ppo", RETURNS, group_size=4)
    assert set(ADVANTAGE_ESTIMATORS) == {"rloo", "grpo", "dr_grpo", "reinforce"}


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_a_row_out_of_the_baseline_leaves_its_siblings_as_a_smaller_group(name):
    """A failed episode (in_baseline 0, reward 0) in a group of 4: the 3 others get the
    advantages of the group of 3 without it, it gets 0; the other group is untouched."""
    returns = t([2.0, 0.0, 4.0, 9.0, 1.0, 0.0, 0.0, 1.0])
    keep = t([1, 0, 1, 1, 1, 1, 1, 1])
    adv = compute_advantages(name, returns, 4, in_baseline=keep)
    three = compute_advantages(name, t([2.0, 4.0, 9.0]), 3)
    assert torch.allclose(adv[[0, 2, 3]], three, atol=1e-12) and adv[1] == 0
    assert torch.allclose(adv[4:], compute_advantages(name, returns[4:], 4), atol=1e-12)
    # per-token returns: the same, at every position of the rows
    mask = torch.ones(8, 3, dtype=F64)
    mask[1] = 0  # a failed episode has no loss token
    per_token = compute_advantages(name, returns.unsqueeze(-1) * mask, 4, mask, keep)
    assert torch.allclose(per_token, adv.unsqueeze(-1) * mask, atol=1e-12)
