"""Prompts from prepared rows, and the trainer's prompt iterator with a resumable position.

A prompt is the task instruction around the raw problem (``\\boxed{}`` for math, ``<answer>``
tags for Countdown, a single letter for MMLU), then either the tokenizer's chat template
(``transformers.AutoTokenizer`` loaded from a local directory holding tokenizer.json /
tokenizer_config.json) or a plain template string with ``{prompt}`` (for base models).
``Codec`` is the tokenizer as rollouts use it: text <-> token ids, the pad and stop ids.

``PromptDataset`` walks the rows in a seed-determined order per epoch in which each row's place
depends on its content alone; its position (the epoch, and the last row taken) is all the state
there is, so ``state_dict()`` / ``load_state_dict()`` resume exactly, also on a data set fixed
by removing or adding rows, and the same seed gives the same order on every rank and every
restart.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import os
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from megatron_rl.data.records import TASKS, TaskExample, iter_examples

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
class Codec:
    """Text <-> token ids with the run's tokenizer, and the ids generation needs: `pad_id` (for
    padded batches) and `stop_ids` (where sampling stops, on every engine)."""

    tokenizer: Any
    add_special_tokens: bool
    pad_id: int
    stop_ids: tuple[int, ...]

    @classmethod
    def from_tokenizer(cls, tokenizer, chat_template: bool, checkpoint: str | None = None
                       ) -> "Codec":
        """A chat-templated prompt already holds the special tokens it needs. The stop ids are
        the tokenizer's EOS and, where the `checkpoint` directory (default: the one the
        tokenizer was loaded from) has a generation_config.json, each id of its eos_token_id,
        as transformers' generate stops: Llama 3.1's lists <|eom_id|>, which ends a tool-call
        turn, beside <|eot_id|>, its tokenizer's only EOS."""
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        stop = _ids(tokenizer.eos_token_id)
        directory = checkpoint if checkpoint is not None else getattr(tokenizer, "name_or_path", "")
        path = os.path.join(directory, "generation_config.json") if directory else ""
        if path and os.path.isfile(path):
            with open(path) as f:
                stop |= _ids(json.load(f).get("eos_token_id"))
        return cls(tokenizer, add_special_tokens=not chat_template, pad_id=pad,
                   stop_ids=tuple(sorted(stop)))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=self.add_special_tokens)["input_ids"]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """encode() of each of `texts`, in one call of the tokenizer."""
        return self.tokenizer(texts, add_special_tokens=self.add_special_tokens)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def _ids(value: int | list[int] | None) -> set[int]:
    """An eos_token_id setting (one id, a list, or none) as a set of ids."""
    return {value} if isinstance(value, int) else set(value or [])


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
    # tool schemas (OpenAI function convention) the chat template puts in the system prompt
    # (--rollout-function agent); the plain template has no place for them
    tools: list[dict] | None = None

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
        """The problem, with its task's answer-format instruction (--task-instruction) where
        the task has one (a task of an environment's own, outside TASKS, has none)."""
        if not self.task_instruction or example.task not in TASKS:
            return example.prompt.strip()
        return task_instruction_text(example, self.countdown_require_all)

    def __call__(self, example: TaskExample) -> str:
        user = self.user_message(example)
        if self.chat:
            messages = []
            if self.system_prompt:
                messages.append({"role": "system", "content": self.system_prompt})
            messages.append({"role": "user", "content": user})
            return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                      add_generation_prompt=True)
        return self.template.format(prompt=user, system=self.system_prompt or "")


@dataclass(frozen=True)
class PromptRecord:
    """One prompt for a rollout: what the engine reads and what the reward needs."""

    uid: str  # id of the row: "<dataset>:<row index among the data set's rows>"
    text: str  # the rendered prompt
    task: str
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)
    epoch: int = 0
    index: int = 0  # position within the epoch's order


# metadata that says where a row was prepared from, not what it is: left out of its key
PROVENANCE_KEYS = ("source", "row")


def row_keys(examples: Sequence[TaskExample]) -> list[tuple[str, int]]:
    """A key per row that its content alone decides: (a hash of its task, prompt, answer and
    metadata other than PROVENANCE_KEYS, k) for the k-th row (from 0, in file order) of that
    content."""
    keys, seen = [], Counter()
    for ex in examples:
        meta = {k: v for k, v in ex.metadata.items() if k not in PROVENANCE_KEYS}
        text = json.dumps([ex.task, ex.prompt, ex.answer, meta], sort_keys=True,
                          ensure_ascii=False, default=str)
        content = hashlib.blake2b(text.encode("utf-8"), digest_size=16).hexdigest()
        keys.append((content, seen[content]))
        seen[content] += 1
    return keys


class PromptDataset:
    """Deterministic, resumable iteration over prompt records in seed-shuffled epochs.

    Order. Epoch ``e`` takes the rows sorted by ``(h, content, k)``, where ``(content, k)`` is
    the row's key (``row_keys``: a hash of what the row says, and which repeat of that content
    it is) and ``h`` a 64-bit hash of ``(seed, e, content)`` and, for k > 0, ``k``; with ``shuffle=False`` (an
    evaluation set), file order. A row's place thus depends on the row alone: removing or
    adding rows leaves the relative order of the others unchanged. The repeat index is hashed
    too, so the copies of a repeated row (data sets such as DAPO-Math-17k hold each problem
    ~100 times) fall at independent places, as in a uniform shuffle, not next to each other.

    Position. ``(epoch, index)``: the epoch and how many rows of its order were taken;
    ``next_batch(n)`` may cross into the next epoch. ``state_dict()`` keeps the epoch and the
    key of the last row taken (``after``, None at an epoch's start); ``load_state_dict``
    resumes at the first row of the epoch's order that sorts after that key, whether or not
    the row is still there. So a run may resume on a data set changed by removing or adding
    rows (a row fixed or dropped by hand, --filter-overlong-prompts): each row not yet taken
    in the epoch is taken once in it, none already taken is taken again, and a row added
    where the epoch has passed comes in the next epoch. The seed must be the checkpoint's.

    A position ``{"epoch", "index", "num_examples"}`` (the index into a ``random.Random(
    f"{seed}:{epoch}")`` permutation of that many rows) is resumed exactly when the data set
    has that many rows: the rest of that epoch follows that permutation, later epochs the
    order above. An unshuffled data set keeps such a position, an index into file order.
    """

    def __init__(self, examples: Sequence[TaskExample], builder: PromptBuilder | None = None, *,
                 seed: int = 0, shuffle: bool = True, name: str = "data",
                 locations: Sequence[str] | None = None, prompt_tokens: Sequence[int] = ()):
        """locations: where each row is, for messages ("path:line"; default "<name> row i");
        prompt_tokens: the token counts of the first rows' rendered prompts, where counted
        (data/lengths.py)."""
        if not examples:
            raise ValueError(f"{name}: no examples")
        self.examples = list(examples)
        self.builder = builder or PromptBuilder()
        self.seed, self.shuffle, self.name = seed, shuffle, name
        self.locations = (list(locations) if locations is not None
                          else [f"{name} row {i + 1}" for i in range(len(self.examples))])
        assert len(self.locations) == len(self.examples), "one location per row"
        self.prompt_tokens = list(prompt_tokens)
        assert len(self.prompt_tokens) <= len(self.examples), "token counts of rows that exist"
        self.epoch, self.index = 0, 0
        self._keys: list[tuple[str, int]] | None = None
        self._index_epoch: int | None = None  # an epoch resumed from an index: its permutation
        self._order_epoch: int | None = None
        self._order: list[int] = []
        self._ranks: list[tuple[int, str, int]] = []  # the sort keys of _order, ascending

    @classmethod
    def from_jsonl(cls, paths: str | Path | Sequence[str | Path], builder: PromptBuilder | None = None,
                   any_task: bool = False, **kwargs) -> "PromptDataset":
        """The rows of the JSONL files `paths`, each checked (records.TaskExample.from_dict;
        `any_task`: a task no verifier knows is accepted, for an environment that gives the
        reward)."""
        paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
        examples, locations = [], []
        for p in paths:
            for line, ex in iter_examples(p, any_task):
                examples.append(ex)
                locations.append(f"{p}:{line}")
        kwargs.setdefault("name", "+".join(Path(p).stem for p in paths))
        return cls(examples, builder, locations=locations, **kwargs)

    def subset(self, rows: Sequence[int], prompt_tokens: Sequence[int] = ()) -> "PromptDataset":
        """A data set of the rows `rows` (ascending indices) of this one, at its start, with
        the same builder, seed, order rule and name; `prompt_tokens`: the counts of its first
        rows."""
        return PromptDataset([self.examples[i] for i in rows], self.builder, seed=self.seed,
                             shuffle=self.shuffle, name=self.name,
                             locations=[self.locations[i] for i in rows],
                             prompt_tokens=prompt_tokens)

    def __len__(self) -> int:
        return len(self.examples)

    def max_prompt_tokens(self, encode=None, first: int = 0) -> int:
        """The longest rendered prompt of the data set (of its `first` rows in file order; 0:
        all) in tokens: the counted ones (prompt_tokens) where they cover those rows, else
        counted here with `encode` (text -> ids)."""
        n = min(first, len(self.examples)) if first else len(self.examples)
        if len(self.prompt_tokens) >= n:
            return max(self.prompt_tokens[:n])
        assert encode is not None, "prompts not counted yet need an encoder"
        return max(len(encode(self.builder(ex))) for ex in self.examples[:n])

    @property
    def keys(self) -> list[tuple[str, int]]:
        """Each row's key (row_keys)."""
        if self._keys is None:
            self._keys = row_keys(self.examples)
        return self._keys

    def _rank(self, epoch: int, key: tuple[str, int]) -> tuple[int, str, int]:
        """Where the row of `key` sorts in epoch `epoch`."""
        content, k = key
        # a first occurrence hashes (seed, epoch, content): the order of a data set without
        # repeats, and the positions its checkpoints keep, do not depend on the repeat rule
        text = f"{self.seed}:{epoch}:{content}" + (f":{k}" if k else "")
        h = hashlib.blake2b(text.encode(), digest_size=8).digest()
        return int.from_bytes(h, "big"), content, k

    def order(self, epoch: int) -> list[int]:
        """The row indices of epoch `epoch`, in the order they are taken."""
        if self._order_epoch != epoch:
            n = len(self.examples)
            order, ranks = list(range(n)), []
            if self.shuffle and epoch == self._index_epoch:
                random.Random(f"{self.seed}:{epoch}").shuffle(order)
            elif self.shuffle:
                by_row = [self._rank(epoch, key) for key in self.keys]
                order.sort(key=by_row.__getitem__)
                ranks = [by_row[i] for i in order]
            self._order, self._ranks, self._order_epoch = order, ranks, epoch
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

    def state_dict(self) -> dict[str, Any]:
        """The position (see the class docstring): {"epoch", "after", "seed"}; for an
        unshuffled data set, or within an epoch resumed from one, {"epoch", "index", "seed",
        "num_examples"}."""
        if not self.shuffle or self.epoch == self._index_epoch:
            return {"epoch": self.epoch, "index": self.index, "seed": self.seed,
                    "num_examples": len(self.examples)}
        after = None
        if self.index:
            content, k = self.keys[self.order(self.epoch)[self.index - 1]]
            after = f"{content}:{k}"
        return {"epoch": self.epoch, "after": after, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(f"{self.name}: checkpoint seed {state['seed']} != data seed {self.seed}")
        epoch, n = int(state["epoch"]), len(self.examples)
        self._index_epoch, self._order_epoch = None, None
        if "after" in state:
            if not self.shuffle:
                raise ValueError(f"{self.name}: the checkpoint's position is in a shuffled "
                                 "order; this data set is read in file order")
            self.order(epoch)
            if state["after"] is None:
                index = 0
            else:
                content, _, k = str(state["after"]).rpartition(":")
                index = bisect.bisect_right(self._ranks, self._rank(epoch, (content, int(k))))
        else:
            if state.get("num_examples", n) != n:
                raise ValueError(
                    f"{self.name}: the checkpoint's position (epoch {epoch}, row "
                    f"{state['index']}) is an index into the order of the {state['num_examples']} "
                    f"rows it was taken over; this data set has {n}: resume on those rows")
            self._index_epoch = epoch if self.shuffle else None
            index = int(state["index"])
        self.epoch, self.index = epoch, index
