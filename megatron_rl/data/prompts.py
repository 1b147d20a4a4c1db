"""Prompts from prepared rows, and the trainer's prompt iterator with a resumable position.

A prompt is the task instruction around the raw problem (``\\boxed{}`` for math, ``<answer>``
tags for Countdown, a single letter for MMLU), then either the tokenizer's chat template
(``transformers.AutoTokenizer`` loaded from a local directory holding tokenizer.json /
tokenizer_config.json) or a plain template string with ``{prompt}`` (for base models).

``PromptDataset`` walks the rows in a seed-determined order per epoch; its position
``(epoch, index)`` is all the state there is, so ``state_dict()`` / ``load_state_dict()`` resume
exactly, and the same seed gives the same order on every rank and every restart.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from megatron_rl.data.records import TaskExample, read_examples

CHOICE_LETTERS = "ABCDEFGHIJ"

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
COUNTDOWN_INSTRUCTION = (
    "You may use +, -, * and / and parentheses; each given number can be used at most once, and "
    "not every number has to be used. Show your reasoning, then give the final equation (an "
    "expression without '=') in <answer> </answer> tags, for example <answer>(1 + 2) / 3</answer>."
)
COUNTDOWN_INSTRUCTION_ALL = COUNTDOWN_INSTRUCTION.replace(
    "each given number can be used at most once, and not every number has to be used",
    "use every given number exactly once")
MMLU_INSTRUCTION = ("Think step by step, then finish with a line of the form \"Answer: X\" where X is the "
                    "single letter of the correct choice ({letters}).")
NUMBER_INSTRUCTION = "Please reason step by step, and end your response with the final numerical answer."


def format_choices(choices: Sequence[str]) -> str:
    """``A. first\\nB. second ...``"""
    if len(choices) > len(CHOICE_LETTERS):
        raise ValueError(f"at most {len(CHOICE_LETTERS)} choices, got {len(choices)}")
    return "\n".join(f"{CHOICE_LETTERS[i]}. {c}" for i, c in enumerate(choices))


def task_instruction_text(example: TaskExample, countdown_require_all: bool = False) -> str:
    """The user message: the problem and the answer-format instruction of its task."""
    p = example.prompt.strip()
    if example.task == "math":
        return f"{p}\n\n{MATH_INSTRUCTION}"
    if example.task == "countdown":
        rules = COUNTDOWN_INSTRUCTION_ALL if countdown_require_all else COUNTDOWN_INSTRUCTION
        return f"{p}\n{rules}"
    if example.task == "mmlu":
        choices = example.metadata["choices"]
        letters = ", ".join(CHOICE_LETTERS[: len(choices)])
        return f"{p}\n\n{format_choices(choices)}\n\n{MMLU_INSTRUCTION.format(letters=letters)}"
    if example.task in ("gsm8k", "arithmetic"):
        return f"{p}\n\n{NUMBER_INSTRUCTION}"
    raise ValueError(f"no prompt format for task {example.task!r}")


def load_tokenizer(path: str | Path):
    """A Hugging Face tokenizer from a local directory (no hub access)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


@dataclass
class PromptBuilder:
    """Renders a TaskExample into the text handed to the rollout engine.

    With ``tokenizer`` (an object with ``apply_chat_template``, or a local directory path) the
    chat template is used, with an optional system message. Without one, ``template`` is
    formatted with ``prompt`` (the user message) and ``system`` (``system_prompt`` or "").
    ``use_chat_template=False`` forces the plain template even when a tokenizer is given.
    """

    tokenizer: Any = None
    template: str = "{prompt}"
    system_prompt: str | None = None
    use_chat_template: bool = True
    countdown_require_all: bool = False
    task_instruction: bool = True  # False: the bare problem text (e.g. for tiny demo models)

    def __post_init__(self):
        if isinstance(self.tokenizer, (str, Path)):
            self.tokenizer = load_tokenizer(self.tokenizer)
        if "{prompt}" not in self.template:
            raise ValueError("template must contain '{prompt}'")

    @property
    def chat(self) -> bool:
        return (self.use_chat_template and self.tokenizer is not None
                and getattr(self.tokenizer, "chat_template", None) is not None)

    def user_message(self, example: TaskExample) -> str:
        if not self.task_instruction:
            return example.prompt.strip()
        return task_instruction_text(example, self.countdown_require_all)

    def __call__(self, example: TaskExample) -> str:
        user = self.user_message(example)
        if self.chat:
            messages = []
            if self.system_prompt:
                messages.append({"role": "system", "content": self.system_prompt})
            messages.append({"role": "user", "content": user})
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.template.format(prompt=user, system=self.system_prompt or "")


@dataclass(frozen=True)
class PromptRecord:
    """One prompt for a rollout: what the engine reads and what the reward needs."""

    uid: str  # stable id of the row: "<dataset>:<row index>"
    text: str  # the rendered prompt
    task: str
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)
    epoch: int = 0
    index: int = 0  # position within the epoch's order


class PromptDataset:
    """Deterministic, resumable iteration over prompt records in seed-shuffled epochs.

    The order of epoch ``e`` is a permutation from ``random.Random(f"{seed}:{e}")`` (or the file
    order when ``shuffle=False``). ``next_batch(n)`` may cross an epoch boundary; the position
    after it is ``(epoch, index)``, saved by ``state_dict()``.
    """

    def __init__(self, examples: Sequence[TaskExample], builder: PromptBuilder | None = None, *,
                 seed: int = 0, shuffle: bool = True, name: str = "data"):
        if not examples:
            raise ValueError(f"{name}: no examples")
        self.examples = list(examples)
        self.builder = builder or PromptBuilder()
        self.seed, self.shuffle, self.name = seed, shuffle, name
        self.epoch, self.index = 0, 0
        self._order_epoch: int | None = None
        self._order: list[int] = []

    @classmethod
    def from_jsonl(cls, paths: str | Path | Sequence[str | Path], builder: PromptBuilder | None = None,
                   **kwargs) -> "PromptDataset":
        paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
        examples = [ex for p in paths for ex in read_examples(p)]
        kwargs.setdefault("name", "+".join(Path(p).stem for p in paths))
        return cls(examples, builder, **kwargs)

    def __len__(self) -> int:
        return len(self.examples)

    def max_prompt_tokens(self, encode, first: int = 0) -> int:
        """The longest rendered prompt of the data set (of its `first` rows in file order; 0:
        all), in tokens of `encode` (text -> ids)."""
        rows = self.examples[:first] if first else self.examples
        return max(len(encode(self.builder(ex))) for ex in rows)

    def order(self, epoch: int) -> list[int]:
        if self._order_epoch != epoch:
            order = list(range(len(self.examples)))
            if self.shuffle:
                random.Random(f"{self.seed}:{epoch}").shuffle(order)
            self._order, self._order_epoch = order, epoch
        return self._order

    def record(self, epoch: int, index: int) -> PromptRecord:
        row = self.order(epoch)[index]
        ex = self.examples[row]
        return PromptRecord(uid=f"{self.name}:{row}", text=self.builder(ex), task=ex.task, answer=ex.answer,
                            metadata=ex.metadata, epoch=epoch, index=index)

    def next_batch(self, batch_size: int) -> list[PromptRecord]:
        out = []
        for _ in range(batch_size):
            if self.index >= len(self.examples):
                self.epoch, self.index = self.epoch + 1, 0
            out.append(self.record(self.epoch, self.index))
            self.index += 1
        return out

    def __iter__(self) -> Iterator[PromptRecord]:
        """Endless: one record at a time from the current position."""
        while True:
            yield self.next_batch(1)[0]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "num_examples": len(self.examples)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("num_examples", len(self.examples)) != len(self.examples):
            raise ValueError(f"{self.name}: checkpoint was taken over {state['num_examples']} examples, "
                             f"this data set has {len(self.examples)}")
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(f"{self.name}: checkpoint seed {state['seed']} != data seed {self.seed}")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
