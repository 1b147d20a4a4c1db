"""Group-relative advantage estimators: RLOO, GRPO, Dr. GRPO, and plain REINFORCE.

Pure PyTorch. The batch holds B = num_groups * group_size sequences, the samples of each prompt
contiguous (rows [g * group_size, (g + 1) * group_size) form group g). Input returns are either
- [B]: one return per sequence (the paper's setting: task reward minus beta * sum_t K_t), or
- [B, T] with loss_mask [B, T]: per-token returns (reward-to-go). The baseline of token t is then
  taken over the group members that have a valid token at position t.
Output has the shape of the input. Every estimator is registered by name in ADVANTAGE_ESTIMATORS.

Bias: a baseline computed from the *other* samples of the group (RLOO) is independent of the
sample it is subtracted from, so the policy gradient stays unbiased on-policy. GRPO and Dr. GRPO
include the sample itself in the group mean, which scales the gradient by (1 - 1/group_size) in
expectation; GRPO's division by the group std further reweights prompts (Dr. GRPO drops it).
"""
import torch

GRPO_EPS = 1e-6


def _group(returns: torch.Tensor, loss_mask: torch.Tensor | None, group_size: int):
    """[B] or [B, T] -> ([G, n, T] values, [G, n, T] float mask), validating the group layout."""
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
    shape = (batch // group_size, group_size, values.shape[-1])
    return (values * mask).reshape(shape), mask.reshape(shape)


def _need_baseline_group(name: str, group_size: int):
    if group_size < 2:
        raise ValueError(f"{name} needs group_size >= 2 (a baseline from the group), got {group_size}")


def reinforce(returns, group_size: int, loss_mask=None) -> torch.Tensor:
    """Advantages = returns (no baseline). Unbiased, highest variance; any group_size."""
    values, mask = _group(returns, loss_mask, group_size)
    return (values * mask).reshape(returns.shape)


def rloo(returns, group_size: int, loss_mask=None) -> torch.Tensor:
    """REINFORCE leave-one-out: A_i = R_i - mean_{j != i} R_j within the group.

    Per token: the mean over the other members valid at that position (0 if there are none).
    """
    values, mask = _group(returns, loss_mask, group_size)
    _need_baseline_group("rloo", group_size)
    others = (mask.sum(1, keepdim=True) - mask).clamp(min=1)
    baseline = (values.sum(1, keepdim=True) - values) / others
    return ((values - baseline) * mask).reshape(returns.shape)


def _group_mean(values, mask):
    return values.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)


def grpo(returns, group_size: int, loss_mask=None, eps: float = GRPO_EPS) -> torch.Tensor:
    """GRPO: A_i = (R_i - mean_group R) / (std_group R + eps), std with Bessel's correction (n-1)."""
    values, mask = _group(returns, loss_mask, group_size)
    _need_baseline_group("grpo", group_size)
    mean = _group_mean(values, mask)
    centered = (values - mean) * mask
    var = centered.square().sum(1, keepdim=True) / (mask.sum(1, keepdim=True) - 1).clamp(min=1)
    return (centered / (var.sqrt() + eps)).reshape(returns.shape)


def dr_grpo(returns, group_size: int, loss_mask=None) -> torch.Tensor:
    """Dr. GRPO: A_i = R_i - mean_group R (no std normalization)."""
    values, mask = _group(returns, loss_mask, group_size)
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
                       loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Advantages [B] or [B, T] (shape of `returns`) by the estimator `name`; detached."""
    with torch.no_grad():
        return get_advantage_estimator(name)(returns, group_size, loss_mask)
