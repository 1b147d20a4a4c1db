"""An agent environment given to the trainer by import path (--agent-environment
failing_env:BrokenStep, with this directory on PYTHONPATH) whose every step raises: a broken
environment, which must stop the run naming itself and its error."""
from megatron_rl.agent.env import Environment


class BrokenStep(Environment):
    def step(self, turn):
        raise KeyError("no such board")
