"""The typed contract between rollout and training: the trajectory a rollout function returns
(`Trajectory`) and the RL batch of sampled responses it becomes (`RolloutBatch`, `pack_rollouts`).

Glossary (used everywhere): `rollout_logprobs` (from the engine), `old_logprobs` (behaviour
policy, recomputed by the trainer), `ref_logprobs` (reference policy), `logprobs` (current
policy, with grad), `loss_mask` (1 on the response tokens the policy sampled), `advantages`.

Placement: `pack_rollouts` builds the batch on the host from the rollout function's
trajectories (rollout/functions.py); `RolloutBatch.to(device)` moves every tensor to the
trainer's device in one place (rollout_queue.py, right after packing). From there on,
everything that meets the model stays on the device.

Shapes: B sequences = num_prompts * group_size, grouped contiguously (the samples of one prompt
are adjacent, as RLOO/GRPO expect); with groups of their own sizes (a rollout function that
declares RolloutNeeds(variable_groups=True)) B is the sum of `group_sizes`. Sequences are prompt + response, right-padded to L tokens;
per-token tensors are [B, L-1] and position t scores token t+1 given tokens[:, :t+1].
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Sequence

import torch

from megatron_rl.parallel import to_device


@dataclasses.dataclass
class Trajectory:
    """One sampled sequence and its reward: what a rollout function returns
    (rollout/functions.py) and pack_rollouts makes a row of.

    prompt_ids: the prompt's P tokens (never trained on).
    response_ids: the T tokens after the prompt: the policy's and, in a multi-turn rollout,
        the environment's between them.
    response_mask: T values, 1 where the policy sampled the token (trained on, its loss_mask),
        0 where it came from elsewhere.
    rollout_logprobs: T values, log pi_rollout(token | prefix) from the engine where the mask is
        1 (ignored where it is 0: write 0).
    finish_reason: how it ended: "stop" or "length" (counted as truncated), or the rollout
        function's own reason.
    reward: the scalar reward of the whole trajectory: with turn_rewards, their sum.
    reward_error: why the reward is 0 when the scorer counts a cause (rewards.types.REASONS:
        timeout, error, too_long, no_answer), logged as reward_errors/<reason>; None otherwise.
    routed_experts: the engine's experts for every token it forwarded, [P + T - 1, M, k]
        (Completion.routed_experts), for routing replay; None without a record.
    metadata: anything else the rollout function keeps; not used in training. Its "counts"
        ({name: number}, e.g. the agent loop's agent/turns) are averaged over the batch's
        trajectories and logged as rollout/<name>.
    turn_rewards: a multi-turn trajectory's reward for each policy turn, in order (the agent
        loop's: each environment step's reward, the verifier's on the last turn where the
        environment gave none there); None for a single-turn one. `reward` is their sum (the
        return the advantage is taken of, docs/results.md "Per-turn rewards" derives why the
        KL placements stay unbiased with it); check_groups refuses another reward.
    turn_ends: with turn_rewards, where each policy turn ends in response_ids (one past its
        last token), in order: --turn-credit to-go credits a token with the rewards of its turn
        and the later ones (None: every turn reward at the last token, as the sum rule).
    token_versions: T values, the weight version that sampled each token where the mask is 1
        (Completion.token_versions, --partial-rollouts: rollout/versions.py); None: all of the
        weights the rollout began with.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    rollout_logprobs: list[float]
    finish_reason: str
    reward: float
    reward_error: str | None = None
    routed_experts: torch.Tensor | None = None
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    turn_rewards: list[float] | None = None
    turn_ends: list[int] | None = None
    token_versions: list[int] | None = None

    @property
    def tokens(self) -> list[int]:
        """prompt_ids + response_ids."""
        return [*self.prompt_ids, *self.response_ids]


def next_token_targets(tokens: torch.Tensor) -> torch.Tensor:
    """[b, L] targets aligned with the model's [b, L, V] logits: position t is scored on token
    t+1; the last position gets a dummy target (its result is dropped with `[:, :-1]`).

    Scoring the full, contiguous logits this way and slicing the [b, L] result avoids the copy
    of the [b, L-1, V] logits that slicing `logits[:, :-1]` (non-contiguous) would force.
    """
    return torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1)


@dataclasses.dataclass
class RolloutBatch:
    tokens: torch.Tensor            # [B, L] int64, right-padded
    loss_mask: torch.Tensor         # [B, L-1] float, 1 where the target token is a response
    #                                 token the policy sampled (response_mask), else 0
    rollout_logprobs: torch.Tensor  # [B, L-1] float, engine log-probs where loss_mask is 1, else 0
    rewards: torch.Tensor           # [B] task rewards
    group_size: int
    prompt_lengths: list[int]
    response_lengths: list[int]
    finish_reasons: list[str]
    old_logprobs: torch.Tensor | None = None  # [B, L-1] behaviour policy, filled by the trainer
    # [B, L, M, k] int16: the experts the engine routed each token to, for routing replay
    # (models.routing); None without a record. It stays on the host (M * k * 2 bytes a token:
    # 768 for Qwen3-30B-A3B, far more than the rest of the batch); each microbatch's share
    # goes to the device when it runs.
    routed_experts: torch.Tensor | None = None
    # [B] float: 1 for a trajectory with a token of the policy's (response_mask 1), 0 for one
    # with none (an agent episode its environment broke): such a row stays out of its group's
    # advantage baseline (advantages.py). Taken from the rollout's masks, not from loss_mask,
    # which --overlong-filtering zeroes for rows whose reward still enters the baseline.
    # None: every row.
    in_baseline: torch.Tensor | None = None
    # [B, L-1] float: each policy turn's reward (Trajectory.turn_rewards) at the position that
    # scores the turn's last token, for --turn-credit to-go (loss.turn_rewards_to_go); None
    # when no trajectory has turn rewards. A row sums to its reward.
    token_rewards: torch.Tensor | None = None
    # each group's own size, in order (summing to B), where the groups differ in size (a
    # rollout function declaring RolloutNeeds(variable_groups=True)); None: every group has
    # group_size rows. The advantages take each group's baseline over its own rows.
    group_sizes: list[int] | None = None

    def group_rows(self) -> list[list[int]]:
        """The rows of each group, in order."""
        sizes = (self.group_sizes if self.group_sizes is not None
                 else [self.group_size] * (self.num_sequences // self.group_size))
        starts = itertools.accumulate(sizes, initial=0)
        return [list(range(a, a + n)) for a, n in zip(starts, sizes)]

    @property
    def seq_lengths(self) -> list[int]:
        """Tokens of each sequence (prompt + response), without the padding."""
        return [p + r for p, r in zip(self.prompt_lengths, self.response_lengths)]

    @property
    def num_sequences(self) -> int:
        return self.tokens.shape[0]

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def to(self, device: torch.device | str) -> "RolloutBatch":
        """This batch with every tensor on `device` (host lists and routed_experts stay on the
        host)."""
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return dataclasses.replace(self, tokens=move(self.tokens), loss_mask=move(self.loss_mask),
                                   rollout_logprobs=move(self.rollout_logprobs),
                                   rewards=move(self.rewards),
                                   old_logprobs=move(self.old_logprobs),
                                   in_baseline=move(self.in_baseline),
                                   token_rewards=move(self.token_rewards))

    def select(self, idx: Sequence[int]) -> "RolloutBatch":
        """Rows `idx` (e.g. a PPO minibatch), keeping the padding length; with group_sizes,
        those of the selected rows' groups (each run of rows of one group)."""
        idx_t = to_device(list(idx), self.device, torch.long)
        pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
        sizes = None
        if self.group_sizes is not None:
            group_of = [g for g, n in enumerate(self.group_sizes) for _ in range(n)]
            sizes = []
            for k, i in enumerate(idx):
                if k and group_of[i] == group_of[idx[k - 1]]:
                    sizes[-1] += 1
                else:
                    sizes.append(1)
        return RolloutBatch(self.tokens[idx_t], self.loss_mask[idx_t],
                            self.rollout_logprobs[idx_t], self.rewards[idx_t], self.group_size,
                            pick(self.prompt_lengths), pick(self.response_lengths),
                            pick(self.finish_reasons),
                            None if self.old_logprobs is None else self.old_logprobs[idx_t],
                            None if self.routed_experts is None
                            else self.routed_experts[idx_t.to(self.routed_experts.device)],
                            None if self.in_baseline is None else self.in_baseline[idx_t],
                            None if self.token_rewards is None else self.token_rewards[idx_t],
                            sizes)


def fill_routes(per_sequence: list[torch.Tensor | None], length: int, num_layers: int,
                topk: int) -> torch.Tensor:
    """[B, length, M, k] int16 routes of a batch from each sequence's [n_i, M, k] record (None:
    no record): row i holds its record from position 0, experts 0..k-1 elsewhere."""
    out = torch.arange(topk, dtype=torch.int16).expand(len(per_sequence), length, num_layers,
                                                      topk).clone()
    for i, r in enumerate(per_sequence):
        if r is not None:
            n = min(r.shape[0], length)
            out[i, :n] = r[:n].to(torch.int16)
    return out


def pack_rollouts(groups: Sequence[Sequence[Trajectory]], pad_token_id: int,
                  pad_to_multiple: int = 8) -> RolloutBatch:
    """Assemble a RolloutBatch from groups of trajectories (one group per prompt, the rollout
    function's output): row b is trajectory b's prompt + response tokens; loss_mask and
    rollout_logprobs carry its response_mask and the engine's log-probs at the positions that
    score its response tokens (position t scores token t+1), 0 elsewhere -- a response token
    from the environment (mask 0) is context, not trained on. A trajectory with no token of the
    policy's gets in_baseline 0 (out of its group's baseline). Turn rewards go to
    token_rewards, each at the position scoring its turn's last token (a trajectory without
    turn_ends: all at its last response token; without turn rewards: its reward there).
    Groups of different sizes set group_sizes (group_size: the largest)."""
    sizes = [len(g) for g in groups]
    if min(sizes, default=1) < 1:
        raise ValueError("every prompt needs at least one trajectory")
    group_size = max(sizes)
    group_sizes = None if all(n == group_size for n in sizes) else sizes
    trajectories = [t for group in groups for t in group]
    rows = [t.tokens for t in trajectories]
    plens = [len(t.prompt_ids) for t in trajectories]
    rlens = [len(t.response_ids) for t in trajectories]
    for t in trajectories:
        if not len(t.response_mask) == len(t.rollout_logprobs) == len(t.response_ids):
            raise ValueError(f"a trajectory of {len(t.response_ids)} response tokens has "
                             f"{len(t.response_mask)} mask values and {len(t.rollout_logprobs)} "
                             "log-probs (one each)")
    L = max(len(r) for r in rows)
    L = -(-L // pad_to_multiple) * pad_to_multiple
    B = len(rows)
    tokens = torch.full((B, L), pad_token_id, dtype=torch.long)
    loss_mask = torch.zeros(B, L - 1)
    rollout_lp = torch.zeros(B, L - 1)
    for i, (r, t) in enumerate(zip(rows, trajectories)):
        tokens[i, :len(r)] = torch.tensor(r)
        start, n = plens[i] - 1, rlens[i]  # position t predicts token t+1
        mask = torch.tensor(t.response_mask, dtype=torch.float32)
        loss_mask[i, start:start + n] = mask
        rollout_lp[i, start:start + n] = torch.where(
            mask > 0, torch.tensor(t.rollout_logprobs, dtype=torch.float32), 0.0)
    token_rewards = None
    if any(t.turn_rewards is not None for t in trajectories):
        token_rewards = torch.zeros(B, L - 1)
        for i, t in enumerate(trajectories):
            n = rlens[i]
            rewards = t.turn_rewards if t.turn_rewards is not None else [t.reward]
            ends = t.turn_ends if t.turn_ends is not None else [n] * len(rewards)
            for r, end in zip(rewards, ends):  # the position scoring response token end - 1
                token_rewards[i, min(plens[i] - 1 + max(min(end, n) - 1, 0), L - 2)] += r
    routes = None
    records = [t.routed_experts for t in trajectories]
    if any(r is not None for r in records):
        if any(r is None for r in records):
            raise ValueError("some trajectories carry routed experts and some do not")
        _, M, k = records[0].shape
        routes = fill_routes(records, L, M, k)
    return RolloutBatch(tokens, loss_mask, rollout_lp,
                        torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
                        group_size, plens, rlens, [t.finish_reason for t in trajectories],
                        routed_experts=routes,
                        in_baseline=torch.tensor([float(1 in t.response_mask)
                                                  for t in trajectories]),
                        token_rewards=token_rewards, group_sizes=group_sizes)
