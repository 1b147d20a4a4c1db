"""rollout/versions.py: the weight versions of a partial rollout's tokens. A sample whose oldest
policy token lags the trained policy by more than --max-token-staleness updates is masked out of
the loss and out of its group's baseline, the group layout kept; the metrics count versions per
sample, the lag of the tokens and the samples dropped."""
import pytest

from megatron_rl.batch import pack_rollouts
from megatron_rl.rollout.base import Completion
from megatron_rl.rollout.single_turn import single_turn_trajectory
from megatron_rl.rollout.versions import drop_stale, version_metrics


def _sample(versions):
    c = Completion([10 + i for i in range(len(versions))], [-0.5] * len(versions), "length",
                   token_versions=versions)
    return single_turn_trajectory([1, 2], c, 1.0)


def test_too_stale_sample_is_masked_out_of_loss_and_baseline_and_counted():
    # trained at step 6: versions 4, 5, 6 lag 2, 1, 0 updates
    fresh, mixed, stale = _sample([5, 5, 6]), _sample([6, 6]), _sample([4, 5, 6, 6])
    groups = [[fresh, stale], [mixed, _sample([5])]]
    counts = drop_stale(groups, step=6, generated_by=5, limit=1)
    assert stale.response_mask == [0, 0, 0, 0] and fresh.response_mask == [1, 1, 1]
    batch = pack_rollouts(groups, pad_token_id=0)
    assert batch.in_baseline is not None and batch.in_baseline.tolist() == [1, 0, 1, 1]
    assert batch.loss_mask[1].sum() == 0 and batch.loss_mask[0].sum() == 3
    assert batch.rewards.tolist() == [1.0] * 4  # the layout and rewards stay
    m = version_metrics(dict(counts))
    assert m["rollout/stale_dropped"] == 1.0 and m["rollout/stale_fraction"] == 0.25
    assert m["rollout/versions_per_sample"] == (2 + 3 + 1 + 1) / 4
    # tokens: lag 0 x 5, lag 1 x 4, lag 2 x 1
    assert m["rollout/token_version_lag"] == pytest.approx((4 + 2) / 10)
    assert m["rollout/token_version_lag_max"] == 2.0
    assert m["rollout/token_lag_0"] == 0.5 and m["rollout/token_lag_2"] == 0.1


def test_without_versions_every_token_is_the_rollouts_and_no_limit_drops_nothing():
    plain = single_turn_trajectory([1], Completion([3, 4], [-0.1, -0.2], "stop"), 0.0)
    counts = drop_stale([[plain, _sample([1, 2])]], step=3, generated_by=1, limit=None)
    m = version_metrics(dict(counts))
    assert plain.response_mask == [1, 1] and m["rollout/stale_dropped"] == 0.0
    assert m["rollout/token_version_lag_max"] == 2.0 and m["rollout/versions_per_sample"] == 1.5
