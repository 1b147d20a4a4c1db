"""skyrl-gym's environments (the `skyrl-gym` package, NovaSky-AI/SkyRL) as agent environments.

    --rollout-function agent --agent-environment megatron_rl.agent.envs.skyrl:SkyRLGymEnvironment

skyrl-gym's text environments (skyrl_gym.envs.BaseTextEnv) are step-wise and synchronous, as the
agent loop's are: `init(prompt messages) -> (messages, info)` at the start of an episode, then
`step(policy text) -> {observations: chat messages, reward, done, metadata}` after each policy
turn. SkyRLGymEnvironment makes one per episode with `skyrl_gym.make(env_class,
env_config=..., extras=...)`, as SkyRL's own trainer does from a data set row:

    env_class   the record's metadata["env_class"] (a column of skyrl-gym's data sets), else the
                class attribute `env_class` (GSM8k, GSM8kMultiTurn below set it)
    extras      the record's metadata (reward_spec, extra_info, max_turns, ...), with
                reward_spec {"method": "rule", "ground_truth": record.answer} where it has none
    env_config  the class attribute `env_config` (an OmegaConf DictConfig of it: the SQL and
                search environments read it so)

The observations are the chat messages the environment returns (user messages, for skyrl-gym's
built-in environments), rendered by the run's chat template between the policy's turns. Each
step's reward is the environment's for that turn (gsm8k_multi_turn scores every turn), kept in
Trajectory.turn_rewards; the trajectory's reward is their sum (agent/env.py). At done, the
environment's get_metrics() numbers are counted as rollout/agent/skyrl_<name>.

What is not carried over: an environment whose init() rewrites the prompt (the episode fails
with a message saying so: the prompt is the record's, rendered by the data pipeline), and
skyrl-gym's `postprocessed_action` (the policy's tokens are kept as sampled: token in, token
out). Which of skyrl-gym's environments run offline: gsm8k, gsm8k_multi_turn and aime score
the text alone; lcb runs the code's tests locally (in a subprocess, not in this project's
sandbox); text2sql needs the task's database files; search and searchcode call a retrieval
server over HTTP.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import skyrl_gym

from megatron_rl.agent.env import Environment, StepResult

if TYPE_CHECKING:
    from megatron_rl.data.prompts import PromptRecord


class SkyRLGymEnvironment(Environment):
    """One episode of a skyrl-gym environment (see the module docstring)."""

    env_class: ClassVar[str | None] = None
    env_config: ClassVar[dict[str, Any]] = {}

    def __init__(self):
        self.env: Any = None

    def reset(self, record: PromptRecord) -> str | None:
        meta = dict(record.metadata)
        env_class = meta.pop("env_class", None) or self.env_class
        if env_class is None:
            raise ValueError(f"record {record.uid}: no metadata env_class and "
                             f"{type(self).__name__}.env_class is unset: which skyrl-gym "
                             f"environment ({', '.join(skyrl_gym.registry)})? Give the data an "
                             "env_class column, or a class that names one "
                             "(megatron_rl.agent.envs.skyrl:GSM8k, :GSM8kMultiTurn)")
        meta.setdefault("reward_spec", {"method": "rule", "ground_truth": record.answer})
        meta.setdefault("extra_info", {})
        self.env = skyrl_gym.make(env_class, env_config=_config(self.env_config), extras=meta)
        prompt = [{"role": "user", "content": record.text}]
        start, _ = self.env.init(prompt)
        if list(start) != prompt:
            raise ValueError(f"the skyrl-gym environment {env_class!r} rewrites the prompt in "
                             "init(), which the agent loop does not take over")
        return None

    def step(self, turn: str) -> StepResult:
        out = self.env.step(turn)
        done = bool(out["done"])
        counts = {}
        if done:
            counts = {f"skyrl_{k}": float(v) for k, v in self.env.get_metrics().items()
                      if isinstance(v, (int, float)) and not isinstance(v, bool)}
        return StepResult(observation=list(out.get("observations") or []),
                          reward=float(out["reward"]), done=done, counts=counts,
                          info=dict(out.get("metadata") or {}))

    def close(self) -> None:
        if self.env is not None:
            self.env.close()


class GSM8k(SkyRLGymEnvironment):
    """skyrl-gym's "gsm8k": one turn, reward 1 where the turn's `#### <number>` is the answer."""

    env_class = "gsm8k"


class GSM8kMultiTurn(SkyRLGymEnvironment):
    """skyrl-gym's "gsm8k_multi_turn": up to max_turns (metadata, default 5) turns, each
    scored (1 for the right `#### <number>`, which ends the episode; 0.2 / max_turns for a
    well-formed wrong one), the environment asking for the answer again after a wrong one."""

    env_class = "gsm8k_multi_turn"


def _config(config: dict[str, Any]) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.create(config)
