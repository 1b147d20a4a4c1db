"""The weight versions of a batch's tokens under --partial-rollouts: their metrics, and the samples
too stale to train on (--max-token-staleness).

A partial rollout's response may span weight versions: the engine interrupts it at a weight
update and continues it under the new weights (rollout/process.py), recording the version of
every token (Completion.token_versions -> Trajectory.token_versions). At step s the trainer
trains the policy of version s, so a policy token of version v lags it by s - v updates. Per
batch (summed over the data-parallel ranks):

    rollout/versions_per_sample    mean number of distinct versions among a sample's policy tokens
    rollout/token_version_lag      mean lag s - v over the policy tokens; _max its largest
    rollout/token_lag_<j>          share of the policy tokens that lag j updates
    rollout/stale_dropped          samples whose oldest policy token lags more than
                                   --max-token-staleness (their count; _fraction of the batch)

A dropped sample stays in the batch, its response mask zeroed: out of the loss and, having no
policy token, out of its group's advantage baseline (batch.pack_rollouts: in_baseline), as an
agent episode its environment broke; the group layout is unchanged.
"""

from __future__ import annotations

import collections
from typing import Sequence

from megatron_rl.batch import Trajectory


def drop_stale(groups: Sequence[Sequence[Trajectory]], step: int, generated_by: int,
               limit: int | None) -> collections.Counter:
    """Count the versions of the policy tokens of `groups`, trained at `step` (a trajectory
    without token_versions: all of version `generated_by`, the weights its rollout began
    with), and zero the response mask of each whose oldest policy token lags more than `limit`
    updates (None: no limit). The counts (`version_metrics` turns their sum over the ranks into
    metrics): samples, versions, dropped, lag_<j> (policy tokens lagging j updates)."""
    counts: collections.Counter = collections.Counter()
    for group in groups:
        for t in group:
            versions = t.token_versions or [generated_by] * len(t.response_ids)
            own = [v for v, m in zip(versions, t.response_mask) if m]
            counts["samples"] += 1
            counts["versions"] += len(set(own))
            for v in own:
                counts[f"lag_{step - v}"] += 1
            if limit is not None and own and step - min(own) > limit:
                t.response_mask = [0] * len(t.response_mask)
                counts["dropped"] += 1
    return counts


def version_metrics(counts: dict[str, float]) -> dict[str, float]:
    """The rollout/* metrics (module docstring) of `drop_stale`'s counts summed over ranks."""
    samples = max(counts.get("samples", 0.0), 1.0)
    lags = {int(k[4:]): c for k, c in counts.items() if k.startswith("lag_")}
    tokens = max(sum(lags.values()), 1.0)
    out = {"rollout/versions_per_sample": counts.get("versions", 0.0) / samples,
           "rollout/token_version_lag": sum(j * c for j, c in lags.items()) / tokens,
           "rollout/token_version_lag_max": float(max(lags, default=0)),
           "rollout/stale_dropped": counts.get("dropped", 0.0),
           "rollout/stale_fraction": counts.get("dropped", 0.0) / samples}
    out.update({f"rollout/token_lag_{j}": lags[j] / tokens for j in sorted(lags)})
    return out
