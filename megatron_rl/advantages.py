"""Group-relative advantage estimators: RLOO, GRPO, Dr. GRPO, and plain REINFORCE.

Pure PyTorch. The batch holds B = num_groups * group_size sequences, the samples of each prompt
contiguous (rows [g * group_size, (g + 1) * group_size) form group g). Input returns are either
- [B]: one return per sequence (the paper's setting: task reward minus beta * sum_t K_t), or
- [B, T] with loss_mask [B, T]: per-token returns (reward-to-go). The baseline of token t is then
  taken over the group members that have a valid token at position t.
Output has the shape of the input. Every estimator is registered by name in ADVANTAGE_ESTIMATORS.

Rows out of the baseline: `in_baseline` [B] (1 or 0; None: every row) leaves a row's return out
of its group's baseline and gives it advantage 0. A trajectory with no token of the policy's (an
agent episode its environment broke: reward 0, every mask 0, RolloutBatch.in_baseline) is not a
sample of the policy's return: counting it would pull the baseline towards 0 and inflate its
siblings' advantages. The baseline of the others is then that of the group without it (a group
of 4 with one such row: the 3 others get the advantages of a group of 3); a row left alone
in its group gets RLOO's advantage R_i (no other to take a baseline from: 0) and GRPO's and Dr.
GRPO's 0 (the group mean is its own return). Leaving out a
sibling by its own outcome keeps RLOO unbiased: the baseline still does not depend on the row
it is subtracted from.

Groups of their own sizes (`group_sizes`, RolloutBatch.group_sizes: a rollout function that
declares RolloutNeeds(variable_groups=True)): compute_advantages pads each group to the largest
with rows out of the baseline (in_baseline 0, return 0), runs the estimator at that size and
drops the padding, so every group's baseline is over its own n_g members: RLOO's
A_i = R_i - sum_{j != i} R_j / (n_g - 1), GRPO's mean and std and Dr. GRPO's mean over the n_g.

Bias: a baseline computed from the *other* samples of the group (RLOO) is independent of the
sample it is subtracted from, so the policy gradient stays unbiased on-policy. GRPO and Dr. GRPO
include the sample itself in the group mean, which scales the gradient by (1 - 1/group_size) in
expectation; GRPO's division by the group std further reweights prompts (Dr. GRPO drops it).
"""
import torch

GRPO_EPS = 1e-6


def _group(returns: torch.Tensor, loss_mask: torch.Tensor | None, group_size: int,
           in_baseline: torch.Tensor | None = None):
    """[B] or [B, T] -> ([G, n, T] values, [G, n, T] float mask), validating the group layout;
    the rows out of the baseline (`in_baseline` 0) have mask 0."""
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    batch = returns.shape[0]
    if batch % group_size != 0:
        raise ValueError(f"batch size {batch} is not a multiple of group_size {group_size}")
    values = returns if returns.dim() == 2 else returns.unsqueeze(-1)
    if loss_mask is None:
        mask = torch.ones_like(values)
    else:
        mask = loss_mask.to(values.dtype).reshape(values.shape)
    if in_baseline is not None:
        if in_baseline.shape != (batch,):
            raise ValueError(f"in_baseline has shape {tuple(in_baseline.shape)}, not ({batch},)")
        mask = mask * in_baseline.to(values.dtype).unsqueeze(-1)
    shape = (batch // group_size, group_size, values.shape[-1])
    return (values * mask).reshape(shape), mask.reshape(shape)


def _need_baseline_group(name: str, group_size: int):
    if group_size < 2:
        raise ValueError(f"{name} needs group_size >= 2 (a baseline from the group), got {group_size}")


def reinforce(returns, group_size: int, loss_mask=None, in_baseline=None) -> torch.Tensor:
    """Advantages = returns (no baseline). Unbiased, highest variance; any group_size."""
    values, mask = _group(returns, loss_mask, group_size, in_baseline)
    return (values * mask).reshape(returns.shape)


def rloo(returns, group_size: int, loss_mask=None, in_baseline=None) -> torch.Tensor:
    """REINFORCE leave-one-out: A_i = R_i - mean_{j != i} R_j within the group.

    Per token: the mean over the other members valid at that position (0 if there are none).
    """
    values, mask = _group(returns, loss_mask, group_size, in_baseline)
    _need_baseline_group("rloo", group_size)
    others = (mask.sum(1, keepdim=True) - mask).clamp(min=1)
    baseline = (values.sum(1, keepdim=True) - values) / others
    return ((values - baseline) * mask).reshape(returns.shape)


def _group_mean(values, mask):
    return values.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)


def grpo(returns, group_size: int, loss_mask=None, in_baseline=None,
         eps: float = GRPO_EPS) -> torch.Tensor:
    """GRPO: A_i = (R_i - mean_group R) / (std_group R + eps), std with Bessel's correction (n-1)."""
    values, mask = _group(returns, loss_mask, group_size, in_baseline)
    _need_baseline_group("grpo", group_size)
    mean = _group_mean(values, mask)
    centered = (values - mean) * mask
    var = centered.square().sum(1, keepdim=True) / (mask.sum(1, keepdim=True) - 1).clamp(min=1)
    return (centered / (var.sqrt() + eps)).reshape(returns.shape)


def dr_grpo(returns, group_size: int, loss_mask=None, in_baseline=None) -> torch.Tensor:
    """Dr. GRPO: A_i = R_i - mean_group R (no std normalization)."""
    values, mask = _group(returns, loss_mask, group_size, in_baseline)
    _need_baseline_group("dr_grpo", group_size)
    return ((values - _group_mean(values, mask)) * mask).reshape(returns.shape)


ADVANTAGE_ESTIMATORS = {"rloo": rloo, "grpo": grpo, "dr_grpo": dr_grpo, "reinforce": reinforce}
# the estimators whose baseline is taken from the group: they need group_size >= 2
GROUP_BASELINE_ESTIMATORS = frozenset({"rloo", "grpo", "dr_grpo"})


def get_advantage_estimator(name: str):
    """The estimator registered under `name`; ValueError listing valid names otherwise."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; valid: {sorted(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[name]


def compute_advantages(name: str, returns: torch.Tensor, group_size: int,
                       loss_mask: torch.Tensor | None = None,
                       in_baseline: torch.Tensor | None = None,
                       group_sizes: list[int] | None = None) -> torch.Tensor:
    """Advantages [B] or [B, T] (shape of `returns`) by the estimator `name`; detached. Rows
    with `in_baseline` 0 stay out of their group's baseline (advantage 0). `group_sizes`: the
    contiguous groups' own sizes (summing to B; None: every group has `group_size` rows), each
    group padded to the largest with rows out of the baseline (module docstring)."""
    estimator = get_advantage_estimator(name)
    with torch.no_grad():
        if group_sizes is None:
            return estimator(returns, group_size, loss_mask, in_baseline)
        batch = returns.shape[0]
        if sum(group_sizes) != batch or min(group_sizes, default=1) < 1:
            raise ValueError(f"group sizes {group_sizes} do not split a batch of {batch} rows")
        width = max(group_sizes)
        # row b of the batch sits at padded row rows[b]: group g's members at g * width + k
        rows = torch.tensor([g * width + k for g, n in enumerate(group_sizes) for k in range(n)],
                            device=returns.device)

        def pad(x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
            out = x.new_full((len(group_sizes) * width, *x.shape[1:]), fill)
            out[rows] = x
            return out

        keep = torch.ones(batch, device=returns.device) if in_baseline is None else in_baseline
        adv = estimator(pad(returns), width, None if loss_mask is None else pad(loss_mask),
                        pad(keep))
        return adv[rows]
