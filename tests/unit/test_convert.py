"""`megatron-rl convert` never destroys: a --save that is the source, holds it, is a training
run's directory or holds anything else is refused before any work; --overwrite replaces only an
earlier conversion's own output, and the output appears by rename, complete."""
import os
import re
import shutil

import pytest
import torch

from megatron_rl.convert import MARKER, main


def _tree(root) -> dict[str, bytes]:
    """{relative path: contents} of every file under `root`."""
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = fh.read()
    return out


def _fake_run(root) -> None:
    """What a training run's --save holds: checkpoints, `latest`, metrics, its config."""
    os.makedirs(os.path.join(root, "iter_0000002"))
    with open(os.path.join(root, "iter_0000002", "extra_rank0.pt"), "wb") as f:
        f.write(b"weights")
    for name, text in (("latest", "iter_0000002\n"), ("metrics.jsonl", '{"step": 1}\n'),
                       ("config.json", "{}\n")):
        with open(os.path.join(root, name), "w") as f:
            f.write(text)


@pytest.mark.parametrize("direction", ["hf-to-megatron", "megatron-to-hf"])
def test_a_save_that_is_or_holds_the_source_is_refused(tmp_path, direction):
    run = tmp_path / "run"
    _fake_run(run)
    link = tmp_path / "link"
    os.symlink(run, link)
    before = _tree(run)
    for load, save in ((run, run), (run, link), (run / "iter_0000002", run),
                       (run / "iter_0000002", tmp_path / "run" / ".." / "run")):
        for overwrite in ([], ["--overwrite"]):
            with pytest.raises(ValueError, match=f"--save {re.escape(str(save))}: (is|holds) the source"):
                main([direction, "--load", str(load), "--save", str(save), *overwrite])
    rel = os.path.relpath(run)  # a relative path to the same directory
    with pytest.raises(ValueError, match="is the source"):
        main([direction, "--load", str(run), "--save", rel])
    assert _tree(run) == before


@pytest.mark.parametrize("direction", ["hf-to-megatron", "megatron-to-hf"])
def test_a_runs_directory_or_other_files_are_never_replaced(tiny_qwen2, tmp_path, direction):
    """hf-to-megatron --save <a run> would rewrite its `latest`; megatron-to-hf --save <a run or
    any directory> would delete it: both refused, even with --overwrite, and nothing changes."""
    load = tiny_qwen2 if direction == "hf-to-megatron" else str(tmp_path / "ckpt")
    run = tmp_path / "run"
    _fake_run(run)
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("mine")
    for overwrite in ([], ["--overwrite"]):
        with pytest.raises(ValueError, match=f"--save {re.escape(str(run))}: a training run's directory"):
            main([direction, "--load", load, "--save", str(run), *overwrite])
        with pytest.raises(ValueError, match=f"--save {re.escape(str(other))}: not empty and not written by "
                                             "megatron-rl convert"):
            main([direction, "--load", load, "--save", str(other), *overwrite])
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        main([direction, "--load", load, "--save", str(tmp_path / "file")])
    assert (other / "todo.txt").read_text() == "mine"
    assert (run / "latest").read_text() == "iter_0000002\n"
    assert sorted(os.listdir(tmp_path)) == ["file", "notes", "run"]


def test_overwrite_replaces_only_an_earlier_conversion(tiny_qwen2, tmp_path):
    """Both directions end to end (in this process, a one-process world each): the output
    carries the marker and no temporaries are left beside it; a second conversion to the same
    --save needs --overwrite, which replaces the earlier output but refuses once anything else
    was put there."""
    from megatron_rl.models import hf_mapping

    torch.set_num_threads(1)
    mg, hf = tmp_path / "megatron", tmp_path / "hf"
    main(["hf-to-megatron", "--load", tiny_qwen2, "--save", str(mg)])
    assert {"latest", "iter_0000000", MARKER} <= set(os.listdir(mg))
    with pytest.raises(ValueError, match="pass --overwrite to replace it"):
        main(["hf-to-megatron", "--load", tiny_qwen2, "--save", str(mg)])
    run, notes = tmp_path / "run", tmp_path / "notes"
    _fake_run(run)
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    for save, message in ((run, "a training run's directory"), (notes, "not empty"),
                          (mg, "is the source")):
        with pytest.raises(ValueError, match=message):
            main(["megatron-to-hf", "--load", str(mg), "--save", str(save), "--overwrite"])
    assert (notes / "todo.txt").read_text() == "mine" and (run / "metrics.jsonl").exists()
    shutil.rmtree(run)
    shutil.rmtree(notes)
    hf.mkdir()  # an empty --save is fine
    main(["megatron-to-hf", "--load", str(mg), "--save", str(hf)])
    assert sorted(os.listdir(tmp_path)) == ["hf", "megatron"]  # no temporaries left
    a, b = hf_mapping.load_hf_state_dict(tiny_qwen2), hf_mapping.load_hf_state_dict(str(hf))
    assert set(a) == set(b) and all(a[k].equal(b[k]) for k in a)

    main(["megatron-to-hf", "--load", str(mg), "--save", str(hf), "--overwrite",
          "--dtype", "bfloat16"])
    assert {t.dtype for t in hf_mapping.load_hf_state_dict(str(hf)).values()} == {torch.bfloat16}
    assert sorted(os.listdir(tmp_path)) == ["hf", "megatron"]

    (hf / "README.md").write_text("my notes")
    with pytest.raises(ValueError, match=r"--overwrite replaces only what megatron-rl convert "
                                         r"wrote there, but it also holds \['README.md'\]"):
        main(["megatron-to-hf", "--load", str(mg), "--save", str(hf), "--overwrite"])
    assert (hf / "README.md").read_text() == "my notes"


def _trained_root(hf_model: str, root) -> None:
    """A run directory as training leaves it: iter_0000000 (the conversion of `hf_model`) and
    iter_0000001 (its weights + 1, saved by a run), `latest` naming the newest."""
    from megatron_rl import checkpoint
    from megatron_rl.models import ModelArgs
    from megatron_rl.models.policy import Policy
    from megatron_rl.parallel import ParallelConfig, init_distributed

    main(["hf-to-megatron", "--load", hf_model, "--save", str(root)])
    os.remove(root / MARKER)  # a run's directory now, not a conversion's
    init_distributed(ParallelConfig(1, 1))  # (the conversion ended its process group)
    args = ModelArgs.from_pretrained(hf_model)
    policy = Policy(args, trainable=False)
    policy.load_hf(hf_model)
    with torch.no_grad():
        for p in policy.module.parameters():
            p.add_(1.0)
    checkpoint.save_checkpoint(str(root), 1, policy, {"rng": checkpoint.rng_state()},
                               with_optimizer=False, hf_config=args.to_hf_config())


def test_a_damaged_checkpoint_is_not_exported_and_a_root_without_latest_exports_its_newest(
        tiny_qwen2, tmp_path):
    """megatron-to-hf checks the checkpoint against its manifest first: a damaged one is
    refused naming the file at fault and the complete checkpoint before it, and nothing is
    written (an export of it had NaN weights and exit status 0). A run directory whose `latest`
    is lost exports its newest iteration, with a warning naming `latest`."""
    from megatron_rl.models import hf_mapping

    torch.set_num_threads(1)
    root, hf = tmp_path / "run", tmp_path / "hf"
    _trained_root(tiny_qwen2, root)
    os.remove(root / "latest")
    with pytest.warns(UserWarning, match=re.escape(str(root / "latest"))):
        main(["megatron-to-hf", "--load", str(root), "--save", str(hf)])
    base = hf_mapping.load_hf_state_dict(tiny_qwen2)
    exported = hf_mapping.load_hf_state_dict(str(hf))
    assert all(exported[k].equal(base[k] + 1.0) for k in base)  # iter_0000001's weights
    shutil.rmtree(hf)

    newest = root / "iter_0000001"
    shard = max((p for p in newest.iterdir() if p.name.endswith(".distcp")),
                key=lambda p: p.stat().st_size)
    with open(shard, "r+b") as f:  # overwritten in place, same size: only the checksum tells
        f.seek(shard.stat().st_size // 2)
        f.write(os.urandom(4096))
    for load in (root, newest):
        with pytest.raises(ValueError, match="damaged") as e:
            main(["megatron-to-hf", "--load", str(load), "--save", str(hf)])
        assert f"--load {load}" in str(e.value) and str(shard) in str(e.value)
        assert str(root / "iter_0000000") in str(e.value)  # the complete one before it
        assert sorted(os.listdir(tmp_path)) == ["run"]  # nothing written, nothing left


def test_a_killed_conversions_temporaries_are_removed_by_the_next_and_a_live_ones_kept(
        tiny_qwen2, tmp_path, start_stalled_writer):
    """kill -9 during megatron-to-hf leaves its staging temporaries beside --save; the next
    conversion removes them (with a warning naming them), also those a killed conversion into a
    sibling directory left, and nothing else: not while their conversion is alive (a second
    conversion into the same --save is refused then), never files of other names."""
    torch.set_num_threads(1)
    mg, hf = tmp_path / "megatron", tmp_path / "hf"
    main(["hf-to-megatron", "--load", tiny_qwen2, "--save", str(mg)])
    mine = {"keep.txt": "x", ".tmp-hf.convert-notes": "y", ".tmp-hf.convert.lock.bak": "z"}
    for name, text in mine.items():
        (tmp_path / name).write_text(text)
    expected_after = sorted(["megatron", "hf", *mine])

    proc = start_stalled_writer("convert", mg, hf)
    try:
        left = sorted(set(os.listdir(tmp_path)) - {"megatron", *mine})
        assert ".tmp-hf.convert.lock" in left
        assert any(re.fullmatch(r"\.tmp-\.tmp-hf\.convert-[a-z0-9_]{8}", n) for n in left)
        with pytest.raises(ValueError, match=f"--save {re.escape(str(hf))}: another conversion "
                                             "into it is running"):
            main(["megatron-to-hf", "--load", str(mg), "--save", str(hf)])
        assert sorted(set(os.listdir(tmp_path)) - {"megatron", *mine}) == left  # untouched
    finally:
        proc.kill()
        proc.wait()
    assert not hf.exists()
    # a conversion into a sibling killed as well: its lock file (free: its process is gone)
    (tmp_path / ".tmp-other.convert.lock").write_text("")
    (tmp_path / ".tmp-.tmp-other.convert-ab12cd_9").mkdir()
    (tmp_path / ".tmp-.tmp-other.convert-ab12cd_9" / "model.safetensors").write_text("partial")
    with pytest.warns(UserWarning, match="removing .*did not finish") as record:
        main(["megatron-to-hf", "--load", str(mg), "--save", str(hf)])
    removed = " ".join(str(w.message) for w in record)
    assert ".tmp-.tmp-hf.convert-" in removed and ".tmp-.tmp-other.convert-ab12cd_9" in removed
    assert sorted(os.listdir(tmp_path)) == expected_after
    assert all((tmp_path / n).read_text() == t for n, t in mine.items())
