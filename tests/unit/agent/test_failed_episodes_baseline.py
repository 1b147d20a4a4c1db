"""An agent episode its environment broke leaves its group's advantage baseline, from the
rollout through the batch to the advantages: its siblings get the advantages of the group
without it (an episode counted with reward 0 would lower their baseline and inflate them).

The policy is test_agent_loop's scripted engine; the environment, the loop, pack_rollouts and
the estimators are real."""
import threading
from collections import Counter

import pytest
import torch
from test_env import _run

from megatron_rl.advantages import GROUP_BASELINE_ESTIMATORS, compute_advantages
from megatron_rl.agent.env import Environment, StepResult
from megatron_rl.agent.settings import AgentConfig
from megatron_rl.batch import pack_rollouts
from megatron_rl.loss import LossConfig, build_advantages
from megatron_rl.data.prompts import PromptRecord

HERE = __name__
_made: Counter = Counter()
_lock = threading.Lock()


class FirstOfEachRecordFails(Environment):
    """The k-th environment made for a record (in the order they are reset) answers the first
    turn with reward k + metadata["base"], the first (k = 0) raises instead."""

    def reset(self, record):
        with _lock:
            self.k = _made[record.uid]
            _made[record.uid] += 1
        self.base = record.metadata["base"]

    def step(self, turn):
        if self.k == 0:
            raise ConnectionError("the game server went away")
        return StepResult(reward=float(self.k + self.base), done=True)


@pytest.mark.parametrize("name", sorted(GROUP_BASELINE_ESTIMATORS))
def test_a_failed_episode_leaves_its_groups_baseline(tokenizer, scorer, name):
    _made.clear()
    records = [PromptRecord(f"game:{i}", "Play:", "arithmetic", "0", {"base": base})
               for i, base in enumerate((0.0, 5.0))]
    config = AgentConfig(agent_environment=f"{HERE}:FirstOfEachRecordFails")
    groups, _, _ = _run(tokenizer, scorer, lambda _, __: "1<eos>", records, config,
                        group_size=4)
    batch = pack_rollouts(groups, pad_token_id=0)
    # as the trainer takes them (update.train_on_batch); the policy is the reference: no KL
    logprobs = torch.zeros_like(batch.loss_mask)
    adv = build_advantages(batch.rewards, logprobs, logprobs, batch.loss_mask,
                           LossConfig(advantage_estimator=name), 4,
                           in_baseline=batch.in_baseline).double()
    for g, group in enumerate(groups):
        rows = [4 * g + j for j in range(4)]
        failed = [r for r, t in zip(rows, group) if t.metadata["end"] == "env_error"]
        assert len(failed) == 1 and batch.in_baseline[failed[0]] == 0
        kept = [r for r in rows if r not in failed]
        assert sorted(batch.rewards[kept].tolist()) == [1 + 5 * g, 2 + 5 * g, 3 + 5 * g]
        alone = compute_advantages(name, batch.rewards[kept].double(), 3)
        assert torch.allclose(adv[kept], alone, atol=1e-6) and adv[failed[0]] == 0
