"""Damaged checkpoints (megatron_rl.checkpoint): a real tiny checkpoint, damaged the ways a disk
or a kill damages one, is caught at the start of the next run by its manifest (sizes and
CRC-32s written at save), named with the file at fault, renamed aside, and the run resumes from
the previous complete checkpoint. Also: checkpoints without a manifest still load, partial saves
are removed at the next start, and a full disk during a save is reported as such."""

import errno
import json
import os
import shutil
import subprocess

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_rl import checkpoint  # noqa: E402
from megatron_rl.config import CheckpointConfig  # noqa: E402


@pytest.fixture(scope="module")
def policy(dist_env, tiny_qwen2):
    from megatron_rl.models import ModelArgs
    from megatron_rl.models.policy import Policy

    pol = Policy(ModelArgs.from_pretrained(tiny_qwen2), trainable=False)
    pol.load_hf(tiny_qwen2)
    return pol


def _first(policy) -> torch.Tensor:
    return next(policy.module.parameters()).detach().clone()


@pytest.fixture(scope="module")
def saved(policy, tmp_path_factory):
    """A run root with checkpoints of steps 1 and 2 (weights differing by 1), and the first
    parameter of each."""
    root = str(tmp_path_factory.mktemp("run"))
    weights = {}
    for step in (1, 2):
        if step == 2:
            with torch.no_grad():
                for p in policy.module.parameters():
                    p.add_(1.0)
        checkpoint.save_checkpoint(root, step, policy, {"rng": checkpoint.rng_state()},
                                   with_optimizer=False)
        weights[step] = _first(policy)
    return root, weights


def _copy(saved, tmp_path) -> str:
    root = str(tmp_path / "run")
    shutil.copytree(saved[0], root)
    return root


def _overwrite(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _shard(ckpt: str) -> str:
    """The largest tensor file of `ckpt`."""
    return max((os.path.join(ckpt, n) for n in os.listdir(ckpt) if n.endswith(".distcp")),
               key=os.path.getsize)


def test_manifest_lists_every_file_with_its_size(saved):
    ckpt = os.path.join(saved[0], "iter_0000002")
    with open(os.path.join(ckpt, checkpoint.MANIFEST)) as f:
        files = json.load(f)["files"]
    on_disk = {n for n in os.listdir(ckpt) if n != checkpoint.MANIFEST}
    assert set(files) == on_disk and {".metadata", "extra_rank0.pt"} <= on_disk
    assert all(files[n][0] == os.path.getsize(os.path.join(ckpt, n)) for n in on_disk)
    assert checkpoint.checkpoint_damage(ckpt) is None


def _truncate(ckpt):
    path = _shard(ckpt)
    os.truncate(path, os.path.getsize(path) // 2)
    return path


def _overwrite_4k(ckpt):  # same size: only the checksum tells
    path = _shard(ckpt)
    _overwrite(path, os.path.getsize(path) // 2, os.urandom(4096))
    return path


def _delete_metadata(ckpt):
    path = os.path.join(ckpt, ".metadata")
    os.remove(path)
    return path


def _corrupt_extra_state(ckpt):
    path = os.path.join(ckpt, "extra_rank0.pt")
    _overwrite(path, os.path.getsize(path) // 3, b"\0" * 64)
    return path


@pytest.mark.parametrize("damage", [_truncate, _overwrite_4k, _delete_metadata,
                                    _corrupt_extra_state])
def test_damaged_newest_checkpoint_is_named_kept_aside_and_the_previous_one_resumed(
        saved, policy, tmp_path, damage):
    root = _copy(saved, tmp_path)
    newest = os.path.join(root, "iter_0000002")
    bad_file = damage(newest)
    with pytest.warns(UserWarning) as record:
        resume, weights = checkpoint.checkpoints_to_load(CheckpointConfig(save=root))
    message = " ".join(str(w.message) for w in record)
    assert newest in message and bad_file in message and "iter_0000001" in message
    assert resume == os.path.join(root, "iter_0000001") and weights is None
    assert os.path.isdir(newest + ".damaged") and not os.path.exists(newest)  # kept, not deleted
    with open(os.path.join(root, "latest")) as f:
        assert f.read().strip() == "iter_0000001"
    extra = checkpoint.load_checkpoint(resume, policy, with_optimizer=False)
    assert extra["step"] == 1 and torch.equal(_first(policy), saved[1][1])
    # the next start finds the fallback complete and says nothing
    assert checkpoint.complete_checkpoint(root) == resume


def test_fallback_resumes_the_reference_of_the_same_step(saved, policy, tiny_qwen2, tmp_path):
    """With --ref-reset-interval the reference is saved beside each checkpoint: a fallback to
    step 1 takes step 1's reference, not the newer one of the damaged step."""
    from megatron_rl.models import ModelArgs
    from megatron_rl.models.policy import Policy

    root = _copy(saved, tmp_path)
    for step in (1, 2):
        shutil.copytree(os.path.join(root, checkpoint.iter_dir_name(step)),
                        os.path.join(root, "reference", checkpoint.iter_dir_name(step)))
    with open(os.path.join(root, "reference", "latest"), "w") as f:
        f.write("iter_0000002\n")
    _truncate(os.path.join(root, "iter_0000002"))
    with pytest.warns(UserWarning, match="damaged"):
        resume, weights = checkpoint.checkpoints_to_load(CheckpointConfig(save=root))
    reference = Policy(ModelArgs.from_pretrained(tiny_qwen2), trainable=False)
    extra = checkpoint.load_run_weights(policy, reference, resume, weights, hf=tiny_qwen2,
                                        ref_hf=None, reference_resets=True)
    assert extra is not None and extra["step"] == 1
    assert torch.equal(_first(reference), saved[1][1]) and torch.equal(_first(policy), saved[1][1])


def test_no_complete_checkpoint_is_refused_naming_each_and_nothing_is_moved(saved, tmp_path):
    root = _copy(saved, tmp_path)
    first = _truncate(os.path.join(root, "iter_0000001"))
    second = _delete_metadata(os.path.join(root, "iter_0000002"))
    with pytest.raises(ValueError, match="no complete checkpoint") as e:
        checkpoint.checkpoints_to_load(CheckpointConfig(save=root))
    assert first in str(e.value) and second in str(e.value)
    assert sorted(n for n in os.listdir(root) if n.startswith("iter_")) == [
        "iter_0000001", "iter_0000002"]


def test_damaged_load_checkpoint_is_refused_naming_the_flag_and_file(saved, tmp_path):
    root = _copy(saved, tmp_path)
    ck = CheckpointConfig(save=str(tmp_path / "new"), load=root)
    assert checkpoint.checkpoints_to_load(ck) == (os.path.join(root, "iter_0000002"), None)
    bad = _overwrite_4k(os.path.join(root, "iter_0000002"))
    with pytest.raises(ValueError, match="--load") as e:
        checkpoint.checkpoints_to_load(ck)
    assert bad in str(e.value)


def test_checkpoint_without_a_manifest_still_loads(saved, policy, tmp_path):
    root = _copy(saved, tmp_path)
    os.remove(os.path.join(root, "iter_0000002", checkpoint.MANIFEST))
    resume, _ = checkpoint.checkpoints_to_load(CheckpointConfig(save=root))
    assert resume == os.path.join(root, "iter_0000002")
    assert checkpoint.load_checkpoint(resume, policy, with_optimizer=False)["step"] == 2
    assert torch.equal(_first(policy), saved[1][2])


def test_unreadable_checkpoint_without_a_manifest_names_the_checkpoint(saved, policy, tmp_path):
    root = _copy(saved, tmp_path)
    ckpt = os.path.join(root, "iter_0000002")
    os.remove(os.path.join(ckpt, checkpoint.MANIFEST))
    _overwrite(os.path.join(ckpt, ".metadata"), 0, b"\0" * 64)
    with pytest.raises(RuntimeError, match="move .* aside") as e:
        checkpoint.load_checkpoint(ckpt, policy, with_optimizer=False)
    assert ckpt in str(e.value)


def test_partial_saves_are_removed_at_the_next_start(saved, tmp_path):
    root = _copy(saved, tmp_path)
    partial = os.path.join(root, ".tmp-iter_0000003")
    os.makedirs(partial)
    with open(os.path.join(partial, "__0_0.distcp"), "wb") as f:  # a save killed mid-write
        f.write(b"x" * 100)
    with pytest.warns(UserWarning, match=r"removing .*\.tmp-iter_0000003"):
        resume, _ = checkpoint.checkpoints_to_load(CheckpointConfig(save=root))
    assert resume == os.path.join(root, "iter_0000002") and not os.path.exists(partial)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 512 KiB tmpfs mounted on a fresh directory (root only): a full disk that cannot fill the
    real one. The mount is checked before anything is written there."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")
    try:
        st = os.statvfs(mnt)
        assert os.path.ismount(mnt) and st.f_blocks * st.f_frsize <= 1 << 20, "not the tmpfs"
        yield str(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_during_a_save_is_named_and_its_partial_save_removed(policy, small_tmpfs):
    root = os.path.join(small_tmpfs, "run")
    with pytest.raises(OSError) as e:
        checkpoint.save_checkpoint(root, 1, policy, with_optimizer=False)
    assert e.value.errno == errno.ENOSPC
    assert "disk full" in str(e.value) and os.path.join(root, ".tmp-iter_0000001") in str(e.value)
    assert not os.path.exists(os.path.join(root, "latest"))
    with pytest.warns(UserWarning, match="did not finish"):
        assert checkpoint.complete_checkpoint(root) is None
    assert os.listdir(root) == []
