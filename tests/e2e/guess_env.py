"""A user's environment given to the trainer by import path (--agent-environment
guess_env:GuessNumber, with this directory on PYTHONPATH), with settings (--agent-env-args) and
a reward for every policy turn, that ends its episodes itself: test_user_plugins.py trains with
it and recomputes what it answered from the saved trajectories."""
import re

from megatron_rl.agent.env import Environment, StepResult


class GuessNumber(Environment):
    """Guess the row's secret (metadata "secret"), in [lo, hi]. A guess is the last number in
    the turn's text. Each turn's reward: 1 for the secret, `shaping` for a guess inside the
    interval still possible (it narrows that interval), else 0. Hints say "higher"/"lower"
    (hint_style "direction") or "off by N" ("distance"); the episode ends at the secret or
    after `max_guesses` turns (end "out_of_guesses")."""

    def __init__(self, lo: int = 0, hi: int = 9, hint_style: str = "direction",
                 shaping: float = 0.1, max_guesses: int = 3):
        if hint_style not in ("direction", "distance"):
            raise ValueError(f"hint_style: 'direction' or 'distance', not {hint_style!r}")
        self.lo, self.hi, self.hint_style = lo, hi, hint_style
        self.shaping, self.max_guesses = shaping, max_guesses

    def reset(self, record):
        self.secret = int(record.metadata["secret"])
        self.low, self.high, self.guesses = self.lo, self.hi, 0
        return None

    def step(self, turn):
        self.guesses += 1
        numbers = re.findall(r"\d+", turn)
        guess = int(numbers[-1]) if numbers else None
        if guess == self.secret:
            return StepResult(reward=1.0, done=True, end="answer")
        reward = 0.0
        if guess is not None and self.low <= guess <= self.high:
            reward = self.shaping
            self.low, self.high = ((self.low, guess - 1) if guess > self.secret
                                   else (guess + 1, self.high))
        if self.guesses >= self.max_guesses:
            return StepResult(reward=reward, done=True, end="out_of_guesses")
        if guess is None:
            return StepResult(f"a number from {self.lo} to {self.hi}, please", reward=reward)
        if self.hint_style == "distance":
            return StepResult(f"off by {abs(guess - self.secret)}", reward=reward)
        return StepResult("lower" if guess > self.secret else "higher", reward=reward)
