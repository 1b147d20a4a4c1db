"""Groups of their own sizes (a rollout function declaring RolloutNeeds(variable_groups=True)):
the check of a function's groups, the batch's group sizes, each group's advantages over its own
members, the PPO minibatches (whole groups, no row left out) and the configuration refusal."""
import pytest
import torch

from megatron_rl.advantages import ADVANTAGE_ESTIMATORS, compute_advantages
from megatron_rl.batch import Trajectory, pack_rollouts
from megatron_rl.config import parse_config
from megatron_rl.rollout.functions import check_groups
from megatron_rl.rollout.needs import declare_needs, needs_of
from megatron_rl.update import minibatch_rows

SIZES = [2, 3, 5]


def _trajectory(reward: float, n: int = 2) -> Trajectory:
    return Trajectory([1, 2], [3] * n, [1] * n, [-0.5] * n, "stop", reward)


def test_the_declaration_allows_groups_of_at_least_group_size():
    @declare_needs(variable_groups=True)
    def tree_search(ctx, records):
        return []

    assert needs_of(tree_search).variable_groups
    groups = [[_trajectory(1.0)] * n for n in SIZES]
    check_groups(groups, 3, 2, "tree:search", variable_groups=True)
    with pytest.raises(ValueError, match="prompt 1: 3 trajectories, --group-size is 2"):
        check_groups(groups, 3, 2, "tree:search")  # undeclared: exactly --group-size
    with pytest.raises(ValueError, match="prompt 0: 2 trajectories, --group-size is at least 3"):
        check_groups(groups, 3, 3, "tree:search", variable_groups=True)


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
@pytest.mark.parametrize("per_token", [False, True])
def test_each_group_gets_the_advantages_it_gets_alone(name, per_token):
    gen = torch.Generator().manual_seed(0)
    B, T = sum(SIZES), 4
    returns = torch.randn(B, T, generator=gen, dtype=torch.float64) if per_token else \
        torch.randn(B, generator=gen, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=gen) > 0.3).double() if per_token else None
    in_baseline = torch.ones(B, dtype=torch.float64)
    in_baseline[6] = 0.0  # a broken episode in the group of 5: out of its baseline
    got = compute_advantages(name, returns, 2, mask, in_baseline, group_sizes=SIZES)
    start = 0
    for n in SIZES:
        rows = slice(start, start + n)
        alone = compute_advantages(name, returns[rows], n,
                                   None if mask is None else mask[rows], in_baseline[rows])
        torch.testing.assert_close(got[rows], alone, rtol=0, atol=1e-12)
        start += n
    # equal sizes are the fixed-size layout
    equal = compute_advantages(name, returns[:6], 3, None if mask is None else mask[:6])
    torch.testing.assert_close(compute_advantages(
        name, returns[:6], 3, None if mask is None else mask[:6], group_sizes=[3, 3]), equal)


def test_the_batch_carries_each_groups_size_and_minibatches_take_whole_groups():
    groups = [[_trajectory(float(j)) for j in range(n)] for n in [2, 3, 5, 2]]
    batch = pack_rollouts(groups, pad_token_id=0)
    assert batch.group_sizes == [2, 3, 5, 2] and batch.num_sequences == 12
    assert batch.group_rows()[1] == [2, 3, 4]
    minibatches = minibatch_rows(batch, 2)
    assert minibatches == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11]]  # no row left out
    assert batch.select(minibatches[1]).group_sizes == [5, 2]
    fixed = pack_rollouts([[_trajectory(1.0)] * 2] * 3, pad_token_id=0)
    assert fixed.group_sizes is None and fixed.group_size == 2
    assert minibatch_rows(fixed, 3) == [[0, 1], [2, 3], [4, 5]]


def test_pipeline_parallelism_without_packing_refuses_variable_groups(tmp_path):
    (tmp_path / "tree.py").write_text(
        "from megatron_rl.rollout.needs import declare_needs\n"
        "@declare_needs(variable_groups=True)\n"
        "def search(ctx, records):\n    return []\n")
    import sys
    sys.path.insert(0, str(tmp_path))
    try:
        base = ["--hf-checkpoint", "x", "--train-data", "x.jsonl", "--rollout-function",
                "tree:search", "--pipeline-model-parallel-size", "2"]
        with pytest.raises(ValueError, match="--no-sequence-packing needs every microbatch"):
            parse_config(base + ["--no-sequence-packing"])
        assert parse_config(base).rollout.rollout_function == "tree:search"
    finally:
        sys.path.remove(str(tmp_path))
