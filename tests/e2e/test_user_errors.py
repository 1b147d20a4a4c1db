"""A user's mistake (a flag, a config file, a data file, an unsafe convert destination) ends a
command with its message and exit status 2, the status argparse gives a bad flag, and no Python
traceback to read the message out of; the train, eval and convert commands alike, in each of
the forms they are started in (`python -m megatron_rl.train`, `megatron-rl <command>`,
tools/convert_checkpoint.py)."""
import os
import subprocess
import sys
from pathlib import Path

from conftest import train_args, train_env  # tests/e2e/conftest.py

from megatron_rl import cli
from megatron_rl.errors import EXIT_USAGE

ROOT = Path(__file__).resolve().parents[2]


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=train_env(), capture_output=True, text=True, timeout=300,
                          cwd=ROOT)


def test_a_configuration_error_prints_its_message_and_exits_2(tmp_path):
    proc = _run([sys.executable, "-m", "megatron_rl.train", "--save", str(tmp_path / "run"),
                 "--train-data", "train.jsonl"])
    assert proc.returncode == EXIT_USAGE == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "megatron-rl train: error: --hf-checkpoint is required"), proc.stderr[-3000:]


def test_an_unsafe_convert_destination_prints_its_message_and_exits_2(tmp_path):
    model = tmp_path / "hf"
    model.mkdir()
    (model / "config.json").write_text("{}")
    proc = _run([sys.executable, "tools/convert_checkpoint.py", "hf-to-megatron",
                 "--load", str(model), "--save", str(model)])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.startswith(f"megatron-rl convert: error: --save {model}: is the source "
                                  f"--load {model}"), proc.stderr[-3000:]
    assert sorted(os.listdir(model)) == ["config.json"]  # nothing written


def test_out_of_range_flags_of_train_and_eval_exit_2_before_a_model_is_built(tmp_path, capsys,
                                                                              monkeypatch):
    from megatron_rl.models import policy

    def built(*args, **kwargs):
        raise AssertionError("a model was built before the flags were checked")

    monkeypatch.setattr(policy, "Policy", built)
    for argv, message in (
            (["train", "--hf-checkpoint", "m", "--train-data", "d.jsonl", "--save",
              str(tmp_path / "run"), "--adam-beta2", "1.5"],
             "megatron-rl train: error: --adam-beta2 1.5: must be >= 0 and < 1"),
            (["eval", "--hf-checkpoint", "m", "--eval-data", "d.jsonl", "--temperature", "inf"],
             "megatron-rl eval: error: --temperature inf: must be a finite number >= 0")):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(message) and "Traceback" not in err, err


def test_a_data_error_prints_its_file_line_and_field_and_exits_2(tiny_char_model, tmp_path,
                                                                  capsys):
    """A malformed row stops the run before the model is built, at the file, line and field."""
    from megatron_rl.parallel import destroy_distributed

    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "Calculate 1+1.", "answer": "2", "task": "arithmetic"}\n'
                    '{"prompt": "Calculate 2+2.", "task": "arithmetic"}\n')
    try:
        status = cli.main(["train", *train_args(tiny_char_model, str(data), str(tmp_path / "run"),
                                                1)])
    finally:
        destroy_distributed()
    assert status == 2
    err = capsys.readouterr().err
    assert f"megatron-rl train: error: {data}:2: field 'answer': missing" in err, err
