"""The trajectories --save-rollouts writes (megatron_rl.rollout.trajectory_log): the JSONL rows of
a multi-turn batch give back each trajectory exactly, with its record and its metadata; a failed
write warns and returns; a 64-trajectory step is written in milliseconds; `megatron-rl rollouts`
prints a trajectory and lists a file. The rows of a real agent-loop episode:
tests/unit/agent/test_agent_rollout_rows.py; the training loop writing them at the right steps:
tests/e2e/test_save_rollouts.py."""
import json
import os
import subprocess
import sys
import time

import pytest
from transformers import AutoTokenizer

from megatron_rl.batch import Trajectory
from megatron_rl.data.prompts import Codec, PromptRecord
from megatron_rl.errors import UserError
from megatron_rl.experiments.tiny_model import make_char_tokenizer
from megatron_rl.rollout import trajectory_log as tl


@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    tok = AutoTokenizer.from_pretrained(make_char_tokenizer(str(tmp_path_factory.mktemp("tok"))))
    return Codec.from_tokenizer(tok, chat_template=False)


def _ids(codec, text):
    return codec.tokenizer(text, add_special_tokens=False)["input_ids"]


def _episode(codec, turns, reward=1.0, **kw) -> Trajectory:
    """A trajectory of alternating policy / environment `turns` (texts), the policy's first;
    the policy's token i of each turn has log-prob -(i + 1) / 10."""
    ids, mask, lps = [], [], []
    for k, text in enumerate(turns):
        t = _ids(codec, text)
        policy = k % 2 == 0
        ids += t
        mask += [int(policy)] * len(t)
        lps += [-(i + 1) / 10 if policy else 0.0 for i in range(len(t))]
    return Trajectory(codec.encode("Q: 2+3="), ids, mask, lps, kw.pop("finish", "stop"), reward,
                      **kw)


def _record(i):
    return PromptRecord(f"train:{i}", "Q: 2+3=", "arithmetic", "5",
                        metadata={"source": "data.jsonl", "row": i})


def test_rows_give_back_each_trajectory_of_a_multi_turn_batch(codec):
    """Two groups of two: each row's segments concatenate to the response ids, their sources
    to the mask, the policy segments' log-probs are the engine's; the texts decode the ids with
    special tokens kept; record, group, index, reward, ends, metadata and per-turn rewards are
    the trajectory's; the row survives JSON."""
    calls = ["<tool_call>add(2,3)</tool_call>", "\n<tool_response>5</tool_response>\n",
             "It is 5.<eos>"]
    first = _episode(codec, calls, metadata={
        "counts": {"agent/turns": 2, "agent/tool_calls": 1}, "end": "answer",
        "env_info": {"calls": [["add", 5]]}})
    first.turn_rewards = [0.0, 1.0]  # per-turn rewards, where a rollout function gives them
    truncated = _episode(codec, ["It is"], reward=0.0, reward_error="no_answer", finish="length")
    environment_first = _episode(codec, ["", "<|env|>", "5<eos>"])
    groups = [[first, truncated], [environment_first, truncated]]
    rows = tl.trajectory_rows(groups, [_record(7), _record(9)], tl.kept_special_tokens(codec),
                              step=10, kind="train")
    assert [(r["group"], r["index"], r["uid"]) for r in rows] == [
        (0, 0, "train:7"), (0, 1, "train:7"), (1, 0, "train:9"), (1, 1, "train:9")]
    for row, t in zip(rows, [first, truncated, environment_first, truncated]):
        row = json.loads(json.dumps(row))
        assert tl.response_of(row) == (t.response_ids, t.response_mask, t.rollout_logprobs)
        assert row["prompt_ids"] == t.prompt_ids and row["prompt"] == "Q: 2+3="
        assert (row["reward"], row["reward_error"], row["finish_reason"]) == (
            t.reward, t.reward_error, t.finish_reason)
        assert row["policy_tokens"] == sum(t.response_mask)
        assert row["policy_tokens"] + row["environment_tokens"] == len(t.response_ids)
        assert (row["step"], row["kind"], row["task"], row["answer"]) == (
            10, "train", "arithmetic", "5")
        assert row["source"] == "data.jsonl" and row["row"] in (7, 9)
    r0 = rows[0]
    assert [(s["source"], s["text"]) for s in r0["segments"]] == [
        ("policy", calls[0]), ("environment", calls[1]), ("policy", calls[2])]
    assert r0["segments"][2]["logprobs"] == [-(i + 1) / 10 for i in range(len(calls[2]) - 4)]
    assert "logprobs" not in r0["segments"][1]
    assert r0["segments"][2]["ids"][-1] == codec.tokenizer.eos_token_id  # kept, shown
    assert (r0["end"], r0["env_info"], r0["counts"], r0["turn_rewards"]) == (
        "answer", {"calls": [["add", 5]]}, {"agent/turns": 2, "agent/tool_calls": 1}, [0.0, 1.0])
    assert (rows[1]["end"], rows[1]["env_info"], rows[1]["counts"]) == (None, {}, {})
    assert "turn_rewards" not in rows[1]
    assert [s["source"] for s in rows[2]["segments"]] == ["environment", "policy"]


def test_saves_every_nth_step_and_every_evaluation():
    assert [s for s in range(1, 9) if tl.saves_rollouts(3, s, "train")] == [3, 6]
    assert all(tl.saves_rollouts(3, s, "eval") for s in (1, 2, 5))
    assert not any(tl.saves_rollouts(0, s, k) for s in (1, 2) for k in tl.KINDS)
    assert tl.rollouts_path("run", 10, "train") == os.path.join("run", "rollouts",
                                                                "step_000010.jsonl")
    assert tl.rollouts_path("run", 4, "eval") == os.path.join("run", "rollouts",
                                                              "eval_step_000004.jsonl")


def _log(codec, save, every=1):
    """Where write_rollouts writes, on one rank."""
    return tl.RolloutLog(every, save, codec)


def test_a_failed_write_warns_and_training_goes_on(codec, tmp_path):
    """A run directory whose rollouts/ cannot be made (a file in its place): a warning names
    the file and the error, nothing raises, no temporary file is left."""
    save = tmp_path / "run"
    save.mkdir()
    (save / "rollouts").write_text("not a directory")
    log = _log(codec, str(save))
    with pytest.warns(UserWarning, match=r"step_000002\.jsonl: writing 1 trajectories failed"):
        tl.write_rollouts(log, 2, "train", [_record(0)], [[_episode(codec, ["5<eos>"])]])
    assert sorted(os.listdir(save)) == ["rollouts"]
    path = save / "ok.jsonl"
    assert tl.write_rows(str(path), [{"a": 1}]) and sorted(os.listdir(save)) == ["ok.jsonl", "rollouts"]


def test_a_64_trajectory_step_is_written_in_milliseconds(codec, tmp_path):
    """16 prompts x 4 samples of 3 turns, 1000 response tokens each (the tiny character
    tokenizer): rows built and written in well under a second (printed: the measurement)."""
    turns = ["x" * 400, "y" * 200, "z" * 400]
    groups = [[_episode(codec, turns) for _ in range(4)] for _ in range(16)]
    log = _log(codec, str(tmp_path))
    start = time.perf_counter()
    tl.write_rollouts(log, 1, "train", [_record(i) for i in range(16)], groups)
    seconds = time.perf_counter() - start
    path = tl.rollouts_path(str(tmp_path), 1, "train")
    print(f"64 trajectories x 1000 tokens: {seconds * 1000:.1f} ms, "
          f"{os.path.getsize(path) / 1e6:.2f} MB")
    assert len(tl.read_rows(path)) == 64
    assert seconds < 0.5


def _write_file(codec, save):
    groups = [[_episode(codec, ["<tool_call>1</tool_call>", "\n<r>2</r>\n", "2<eos>"],
                        metadata={"end": "answer"}),
               _episode(codec, ["3"], reward=0.0, reward_error="no_answer", finish="length")]]
    log = _log(codec, save, every=2)
    tl.write_rollouts(log, 1, "train", [_record(3)], groups)  # not a saved step
    tl.write_rollouts(log, 2, "train", [_record(3)], groups)
    tl.write_rollouts(log, 2, "eval", [_record(3)], groups)
    return tl.rollouts_path(save, 2, "train")


def test_the_command_prints_a_trajectory_and_lists_a_file(codec, tmp_path, capsys):
    save = str(tmp_path / "run")
    path = _write_file(codec, save)
    assert sorted(os.listdir(os.path.join(save, "rollouts"))) == [
        "eval_step_000002.jsonl", "step_000002.jsonl"]
    tl.main([path, "--index", "0"])
    out = capsys.readouterr().out
    assert out.startswith("step 2 (train)  group 0 sample 0  uid train:3  task arithmetic  "
                          "source data.jsonl row 3\n")
    assert "reward 1  finish stop  end answer  policy tokens 26  environment tokens 10" in out
    assert "=== prompt (7 tokens) ===\nQ: 2+3=\n" in out
    lp = sum(-(i + 1) / 10 for i in range(24)) / 24
    assert f"=== 1. policy (24 tokens, mean log-prob {lp:.3f}) ===\n<tool_call>1</tool_call>\n" in out
    assert "=== 2. environment (10 tokens) ===\n\n<r>2</r>\n\n" in out
    assert "=== 3. policy (2 tokens, mean log-prob -0.150) ===\n2<eos>\n" in out
    tl.main([save, "--uid", "train:3", "--sample", "1"])  # a run directory: its last step
    out = capsys.readouterr().out
    assert "sample 1" in out and "reward 0 (no_answer)  finish length  end -" in out
    tl.main([save, "--eval", "--list"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("eval_step_000002.jsonl: 2 trajectories") and len(lines) == 4
    assert lines[1].split() == ["#", "group", "uid", "reward", "finish", "end", "policy", "env",
                                "segs"]
    assert lines[3].split() == ["1", "0/1", "train:3", "0", "length", "-", "1", "0", "1"]
    tl.main([os.path.join(save, "rollouts"), "--list"])  # the rollouts/ directory itself
    assert capsys.readouterr().out.startswith(f"{path}: 2 trajectories")


def test_the_command_names_what_it_cannot_find(codec, tmp_path):
    save = str(tmp_path / "run")
    path = _write_file(codec, save)
    with pytest.raises(UserError, match="no train trajectories of step 4; saved steps: 2"):
        tl.main([save, "--step", "4"])
    with pytest.raises(UserError, match=r"--index 5: .* holds 2 trajectories"):
        tl.main([path, "--index", "5"])
    with pytest.raises(UserError, match="no trajectory of uid 'x'"):
        tl.main([path, "--uid", "x"])
    with pytest.raises(UserError, match="a run writes them with --save-rollouts"):
        tl.main([str(tmp_path)])


def test_megatron_rl_rollouts_is_a_registered_command(codec, tmp_path):
    """`megatron-rl rollouts FILE` as a user types it (the entry point setup.py declares)."""
    path = _write_file(codec, str(tmp_path / "run"))
    out = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "rollouts", path],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.startswith("step 2 (train)") and "=== 2. environment (10 tokens) ===" in out


def test_a_listing_cut_short_by_its_reader_ends_quietly(codec, tmp_path):
    """`megatron-rl rollouts RUN --list | head -1`: the reader goes away after one line; the
    command ends with the status a tool SIGPIPE killed gets (141), no traceback."""
    save = str(tmp_path / "run")
    groups = [[_episode(codec, ["3"], reward=0.0, finish="length") for _ in range(4)]
              for _ in range(1000)]  # ~90 kB of listing: more than a pipe holds
    tl.write_rollouts(_log(codec, save), 1, "train", [_record(i) for i in range(1000)], groups)
    with subprocess.Popen([sys.executable, "-m", "megatron_rl.cli", "rollouts", save, "--list"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.readline().startswith(b"/")  # the file's line
        proc.stdout.close()
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_a_row_keeps_turn_ends_versions_and_says_when_nothing_was_trained(codec):
    t = _episode(codec, ["7", "\nno\n", "8<eos>"], reward=1.5, turn_rewards=[0.5, 1.0])
    n = len(t.response_ids)
    t.turn_ends, t.token_versions = [1, n], [3] + [0] * (n - 3) + [4, 4]
    row = tl.trajectory_row(t, _record(0), codec.decode, step=1, kind="train", group=0, index=0)
    assert row["turn_ends"] == [1, n] and row["turn_rewards"] == [0.5, 1.0]
    assert row["token_versions"] == t.token_versions
    assert "not trained" not in tl.format_row(row)
    broken = _episode(codec, ["7"], reward=0.0, metadata={"end": "env_error"})
    broken.response_mask = [0] * len(broken.response_ids)
    row = tl.trajectory_row(broken, _record(1), codec.decode, step=1, kind="train", group=0,
                            index=1)
    assert "not trained: its environment failed" in tl.format_row(row)
