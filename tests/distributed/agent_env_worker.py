"""Worker for test_agent_env.py (two ranks under torchrun, gloo, TP2: one model-parallel group,
the agent loop running on both as with the in-process engine): an environment whose answers
differ by rank is made and stepped on the group's first rank alone, and both ranks build the
same trajectories; with fewer failures allowed than the "bad" record's, every rank raises
EnvironmentFailed with the same message (none waits for the other). Prints `RESULT {json}` per
rank."""
import json
import tempfile

import torch.distributed as dist
from transformers import AutoTokenizer

from megatron_rl.agent.env import Environment, EnvironmentFailed, StepResult
from megatron_rl.agent.loop import agent_rollout
from megatron_rl.agent.settings import AgentConfig
from megatron_rl.data.prompts import Codec, PromptRecord
from megatron_rl.experiments.tiny_model import make_char_tokenizer
from megatron_rl.parallel import ParallelConfig, init_distributed
from megatron_rl.rewards import RewardScorer
from megatron_rl.rollout.base import Completion, SamplingParams
from megatron_rl.rollout.functions import RolloutContext

MADE: list[int] = []


class RankEnv(Environment):
    """Says which rank answers; done, reward 1 at the second step; raises on record "bad"."""

    def __init__(self):
        MADE.append(dist.get_rank())

    def reset(self, record):
        if record.uid == "bad":
            raise ValueError("no such game")
        self.steps = 0

    def step(self, turn):
        self.steps += 1
        if self.steps == 2:
            return StepResult(reward=1.0, done=True)
        return StepResult(f"rank {dist.get_rank()} says go on")


class Engine:
    """The same text for every context ("7<eos>"), log-prob -0.5 per token."""

    client_rank = None

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def generate(self, contexts, n, params):
        ids = self.tokenizer("7<eos>", add_special_tokens=False)["input_ids"]
        return [[Completion(ids, [-0.5] * len(ids), "stop") for _ in range(n)] for _ in contexts]


def main() -> None:
    init_distributed(ParallelConfig(tensor_model_parallel_size=2))
    tok = AutoTokenizer.from_pretrained(make_char_tokenizer(tempfile.mkdtemp()))
    codec = Codec.from_tokenizer(tok, chat_template=False)
    records = [PromptRecord("good", "Go:", "arithmetic", "7"),
               PromptRecord("bad", "Go:", "arithmetic", "7")]

    def rollout(scorer, max_failures):
        config = AgentConfig(agent_environment=f"{__name__}:RankEnv",
                             agent_max_env_failures=max_failures)
        ctx = RolloutContext(Engine(tok), SamplingParams(max_new_tokens=20, seed=1,
                                                         stop_token_ids=codec.stop_ids),
                             2, codec, scorer, agent=config)
        return agent_rollout(ctx, records)

    with RewardScorer(num_workers=1) as scorer:
        groups = rollout(scorer, 0.5)  # 2 of 4 episodes fail: not more than half
        made = list(MADE)
        try:
            rollout(scorer, 0.25)
            stopped = None
        except EnvironmentFailed as e:
            stopped = str(e)
    rows = [[tok.decode(t.response_ids), t.response_mask, t.reward, t.metadata["end"]]
            for g in groups for t in g]
    print("RESULT " + json.dumps({"rank": dist.get_rank(), "made": made, "rows": rows,
                                  "stopped": stopped}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from megatron_rl.processes import skip_exit_collection

    skip_exit_collection()  # the heap is the imports': no shutdown collection over it
