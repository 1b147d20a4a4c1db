"""The prepared-data row and its JSONL file: ``{"prompt", "answer", "task", "metadata"}``.

``prompt`` is the raw problem text (no instruction, no chat template: prompts.py adds those at
training time), ``answer`` the gold answer as a string, ``task`` the reward to use (a name in
``megatron_rl.rewards.REWARDS``; any name where the rows are read with ``any_task``: an agent
environment of the user's gives the reward, runtime.load_data), ``metadata`` whatever the reward or prompt builder needs
(Countdown numbers, MMLU choices) plus provenance.
"""
from __future__ import annotations

import json
import re
import unicodedata
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from megatron_rl.errors import UserError

TASKS = ("math", "countdown", "mmlu", "gsm8k", "arithmetic")


class DataFormatError(UserError):
    """A malformed input file or row; the message names the file, the line (or row) and the
    field."""

    def __init__(self, path: str | Path, line: int | None, message: str, field: str | None = None):
        where = f"{path}:{line}" if line is not None else str(path)
        what = f" field {field!r}:" if field else ""
        super().__init__(f"{where}:{what} {message}")
        self.path, self.line, self.field = str(path), line, field


@dataclass
class TaskExample:
    prompt: str
    answer: str
    task: str
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)

    @classmethod
    def from_dict(cls, row: Any, path: str | Path = "<row>", line: int | None = None,
                  any_task: bool = False) -> "TaskExample":
        """Validate one parsed row; raises DataFormatError naming path, line and field.
        `any_task`: a `task` that no verifier knows (TASKS) is accepted (its rows get no task
        instruction and are scored by the environment; the metadata of a known task is still
        checked)."""
        if not isinstance(row, dict):
            raise DataFormatError(path, line, f"expected a JSON object, got {type(row).__name__}")
        for name in ("prompt", "answer", "task"):
            if name not in row:
                raise DataFormatError(path, line, "missing", field=name)
            if not isinstance(row[name], str):
                raise DataFormatError(path, line, f"expected a string, got {type(row[name]).__name__}", field=name)
        if not row["prompt"].strip():
            raise DataFormatError(path, line, "empty", field="prompt")
        if row["task"] not in TASKS and not (any_task and row["task"].strip()):
            free = "" if any_task else (" (any name with --agent-environment set to an "
                                        "environment of your own, which gives the reward)")
            raise DataFormatError(path, line, f"unknown task {row['task']!r}; valid: "
                                              f"{list(TASKS)}{free}", field="task")
        metadata = row.get("metadata", {})
        if metadata is None:
            metadata = {}
        if not isinstance(metadata, dict):
            raise DataFormatError(path, line, f"expected an object, got {type(metadata).__name__}", field="metadata")
        _check_task_metadata(row["task"], metadata, path, line)
        return cls(row["prompt"], row["answer"], row["task"], dict(metadata))


def _check_task_metadata(task: str, metadata: dict[str, Any], path, line) -> None:
    if task == "countdown":
        numbers = metadata.get("numbers")
        if not isinstance(numbers, list) or not all(isinstance(x, int) for x in numbers):
            raise DataFormatError(path, line, "countdown rows need metadata.numbers, a list of integers",
                                  field="metadata.numbers")
    if task == "mmlu":
        choices = metadata.get("choices")
        if not isinstance(choices, list) or not choices or not all(isinstance(x, str) for x in choices):
            raise DataFormatError(path, line, "mmlu rows need metadata.choices, a list of strings",
                                  field="metadata.choices")


_WS = re.compile(r"\s+")


def normalize_problem(text: str) -> str:
    """Key for overlap detection: NFKC, case-folded, all whitespace removed, trailing dots stripped."""
    return _WS.sub("", unicodedata.normalize("NFKC", text).casefold()).rstrip(".")


def write_jsonl(path: str | Path, examples: Iterable[TaskExample]) -> int:
    """Write rows to ``path`` (atomically: a temp file renamed at the end); returns the count."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    n = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for ex in examples:
            f.write(ex.to_json() + "\n")
            n += 1
    tmp.replace(path)
    return n


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed object) for each non-blank line; bad JSON or bytes that are not
    UTF-8 name the file and line, a file that cannot be opened names the file. A UTF-8
    byte-order mark at the start is skipped (editors on Windows write one); a UTF-16 file is
    named as one."""
    try:
        f = open(path, encoding="utf-8-sig")
    except OSError as e:
        raise DataFormatError(path, None, f"cannot be read ({e.strerror or e})") from None
    try:
        with f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataFormatError(path, lineno, f"invalid JSON ({e.msg} at column {e.colno})") from None
    except UnicodeDecodeError as e:
        raise not_utf8(path, e) from None


UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")


def not_utf8(path: str | Path, error: UnicodeDecodeError) -> DataFormatError:
    """The first line of `path` that is not UTF-8, as a DataFormatError (the decoder reports a
    position within its read buffer, not a line); a file that starts with a UTF-16 byte-order
    mark is named as UTF-16."""
    with open(path, "rb") as f:
        if f.read(2) in UTF16_BOMS:
            return DataFormatError(path, None, "UTF-16 (it starts with a UTF-16 byte-order "
                                               "mark); save the file as UTF-8")
        f.seek(0)
        for lineno, raw in enumerate(f, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return DataFormatError(path, lineno, f"not UTF-8: byte {raw[e.start]:#04x} at "
                                                     f"column {e.start + 1} ({e.reason}); save "
                                                     "the file as UTF-8")
    return DataFormatError(path, None, f"not UTF-8 ({error.reason})")


def iter_examples(path: str | Path, any_task: bool = False) -> Iterator[tuple[int, TaskExample]]:
    """(line number, row) for each row of a prepared JSONL file, validating every row
    (`any_task`: TaskExample.from_dict's)."""
    for lineno, row in iter_jsonl(path):
        yield lineno, TaskExample.from_dict(row, path, lineno, any_task)


def read_examples(path: str | Path) -> list[TaskExample]:
    """Load a prepared JSONL file (as written by tools/prepare_data.py), validating every row."""
    return [ex for _, ex in iter_examples(path)]
