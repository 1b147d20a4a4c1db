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


@pytest.mark.parametrize("latest", ["missing", "empty", "../elsewhere", "absolute"])
def test_a_missing_empty_or_foreign_latest_resumes_the_newest_checkpoint_with_a_warning(
        saved, tmp_path, latest):
    """`latest` lost (a hand edit, a copy without it) with checkpoints present: the run resumes
    the newest complete one and says so, never starts over at step 0 on top of them; a `latest`
    naming a directory beside --save leaves that directory alone."""
    root = _copy(saved, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("not a checkpoint")
    path = os.path.join(root, "latest")
    if latest == "missing":
        os.remove(path)
    else:
        with open(path, "w") as f:
            f.write({"empty": "", "absolute": str(elsewhere)}.get(latest, latest) + "\n")
    with pytest.warns(UserWarning) as record:
        resume, weights = checkpoint.checkpoints_to_load(CheckpointConfig(save=root))
    message = " ".join(str(w.message) for w in record)
    assert resume == os.path.join(root, "iter_0000002") and weights is None
    assert path in message and f"present, {resume}" in message
    assert sorted(os.listdir(tmp_path)) == ["elsewhere", "run"]  # nothing renamed, inside or out
    assert os.listdir(elsewhere) == ["keep.txt"]
    assert sorted(n for n in os.listdir(root) if n.startswith("iter_")) == [
        "iter_0000001", "iter_0000002"]
    with open(path) as f:
        assert f.read().strip() == "iter_0000002"
    # a damaged newest checkpoint without `latest` falls back as with it
    os.remove(path)
    _truncate(resume)
    with pytest.warns(UserWarning) as record:
        assert checkpoint.complete_checkpoint(root) == os.path.join(root, "iter_0000001")
    assert os.path.isdir(resume + ".damaged")
    assert any("damaged" in str(w.message) for w in record)


def test_a_load_root_without_latest_gives_its_newest_checkpoint(saved, tmp_path):
    """--load of a run directory whose `latest` is missing or names a directory beside it: the
    newest iteration inside it, never the other directory."""
    root = _copy(saved, tmp_path)
    (tmp_path / "elsewhere").mkdir()
    ck = CheckpointConfig(save=str(tmp_path / "new"), load=root)
    for content in (None, "../elsewhere"):
        path = os.path.join(root, "latest")
        if content is None:
            os.remove(path)
        else:
            with open(path, "w") as f:
                f.write(content)
        with pytest.warns(UserWarning, match="latest"):
            assert checkpoint.checkpoints_to_load(ck) == (os.path.join(root, "iter_0000002"),
                                                          None)


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


# -- a step's pieces (policy, optimizer, reference) are one checkpoint ---------------------------

def _tiny_policy(hf: str, shift: float = 0.0, trainable: bool = False, **optim):
    """A tiny Policy with `hf`'s weights, each shifted by `shift`; trainable ones get an Adam
    with OptimConfig(**optim)."""
    from megatron_rl.models import ModelArgs
    from megatron_rl.models.optim import OptimConfig
    from megatron_rl.models.policy import Policy

    pol = Policy(ModelArgs.from_pretrained(hf), trainable=trainable,
                 optim=OptimConfig(**optim) if trainable else None)
    pol.load_hf(hf)
    _shift(pol, shift)
    return pol


def _shift(pol, by: float) -> None:
    with torch.no_grad():
        for p in pol.module.parameters():
            p.add_(by)


def _save_pairs(root: str, hf: str, steps) -> tuple:
    """Run checkpoints of `steps` under `root`, each with a policy and a reference that differ
    (--ref-reset-interval's layout); (policy, reference, {step: (policy's, reference's first
    parameter)})."""
    policy, reference = _tiny_policy(hf), _tiny_policy(hf, shift=0.5)
    pairs = {}
    for step in steps:
        _shift(policy, 1.0)
        _shift(reference, 1.0)
        checkpoint.save_run(root, step, policy, {}, step, reference=reference)
        pairs[step] = (_first(policy), _first(reference))
    return policy, reference, pairs


def _resume(root: str, hf: str, reference_resets: bool = True):
    """(extra state, policy, reference) of a run resumed from `root` as setup_run does."""
    resume, weights = checkpoint.checkpoints_to_load(CheckpointConfig(save=root))
    policy, reference = _tiny_policy(hf, shift=-9.0), _tiny_policy(hf, shift=-9.0)
    extra = checkpoint.load_run_weights(policy, reference, resume, weights, hf=hf, ref_hf=None,
                                        reference_resets=reference_resets)
    return extra, policy, reference


def test_a_save_failing_between_the_policy_and_the_reference_publishes_neither(
        dist_env, tiny_qwen2, tmp_path, monkeypatch):
    """With --ref-reset-interval a step is its policy and its reference. A save that fails
    after the policy's files and before the reference's (a write error there; a kill there
    leaves the same files) publishes neither: the resume takes the step before, with that
    step's reference, never step 2's policy with step 1's reference."""
    from megatron.core import dist_checkpointing

    root = str(tmp_path / "run")
    policy, reference, pairs = _save_pairs(root, tiny_qwen2, [1])
    _shift(policy, 1.0)
    _shift(reference, 1.0)
    real_save = dist_checkpointing.save

    def failing_at_the_reference(state_dict, path, *args, **kwargs):
        if "reference" in path:
            raise OSError(errno.EIO, "Input/output error writing the reference")
        return real_save(state_dict, path, *args, **kwargs)

    monkeypatch.setattr(dist_checkpointing, "save", failing_at_the_reference)
    with pytest.raises(OSError, match="writing the reference"):
        checkpoint.save_run(root, 2, policy, {}, 2, reference=reference)
    monkeypatch.undo()
    with pytest.warns(UserWarning, match="did not finish"):
        extra, resumed, resumed_ref = _resume(root, tiny_qwen2)
    assert extra is not None and extra["step"] == 1
    assert torch.equal(_first(resumed), pairs[1][0])
    assert torch.equal(_first(resumed_ref), pairs[1][1])


def test_the_manifest_covers_the_reference_and_a_damaged_one_falls_back_as_a_pair(
        dist_env, tiny_qwen2, tmp_path):
    root = str(tmp_path / "run")
    _, _, pairs = _save_pairs(root, tiny_qwen2, [1, 2])
    newest = os.path.join(root, "iter_0000002")
    with open(os.path.join(newest, checkpoint.MANIFEST)) as f:
        files = json.load(f)["files"]
    assert {"reference/.metadata", "reference/metadata.json"} <= set(files)
    assert checkpoint.TRAIN_CONFIG not in files  # save_run without a config writes none
    bad = _truncate(os.path.join(newest, checkpoint.REFERENCE))
    with pytest.warns(UserWarning) as record:
        extra, resumed, resumed_ref = _resume(root, tiny_qwen2)
    assert bad in " ".join(str(w.message) for w in record)
    assert extra is not None and extra["step"] == 1
    assert torch.equal(_first(resumed), pairs[1][0])
    assert torch.equal(_first(resumed_ref), pairs[1][1])


def test_a_healthy_save_with_its_reference_warns_of_nothing(dist_env, tiny_qwen2, tmp_path,
                                                             caplog):
    """A save of a step with its reference (--ref-reset-interval), over an earlier step and a
    killed save's leftover, logs no warning: megatron's "Overwriting old incomplete / corrupted
    checkpoint" on a healthy run sends a user looking for damage that is not there."""
    root = str(tmp_path / "run")
    os.makedirs(os.path.join(root, ".tmp-iter_0000002", checkpoint.REFERENCE))
    with caplog.at_level("WARNING"):
        _save_pairs(root, tiny_qwen2, [1, 2])
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == []
    assert checkpoint.complete_checkpoint(root) == os.path.join(root, "iter_0000002")


def test_a_resumed_step_without_its_reference_is_refused_naming_it(saved, tiny_qwen2, tmp_path):
    """The older layout (<root>/reference/iter_N beside the steps): a run killed between its
    policy's and its reference's save has step 2 without a reference. Resuming it with step 1's
    reference would be another run: refused, naming the checkpoint and the way out."""
    root = _copy(saved, tmp_path)
    shutil.copytree(os.path.join(root, "iter_0000001"),
                    os.path.join(root, "reference", "iter_0000001"))
    with open(os.path.join(root, "reference", "latest"), "w") as f:
        f.write("iter_0000001\n")
    with pytest.raises(ValueError, match="holds no reference") as e:
        _resume(root, tiny_qwen2)
    newest = os.path.join(root, "iter_0000002")
    assert f"Move {newest} aside" in str(e.value)
    # a run that never saved its reference resumes with its initial one
    extra, _, resumed_ref = _resume(root, tiny_qwen2, reference_resets=False)
    assert extra is not None and extra["step"] == 2
    assert torch.equal(_first(resumed_ref), _first(_tiny_policy(tiny_qwen2)))


def test_a_resumed_optimizer_takes_the_runs_hyperparameters_and_the_checkpoints_state(
        dist_env, tiny_qwen2, tmp_path):
    """The checkpoint restores the optimizer's state (Adam's moments and step count, the
    schedule's step count); its hyperparameters (learning rate, schedule, weight decay, betas,
    eps) are the resuming run's OptimConfig, so a changed --lr takes effect."""
    saved_optim = dict(lr=1e-2, lr_warmup_iters=1, lr_decay_style="cosine", lr_decay_iters=10)
    policy = _tiny_policy(tiny_qwen2, trainable=True, **saved_optim)
    for _ in range(2):
        for p in policy.parameters():  # main_grad: the fp32 gradient buffer megatron's DDP adds
            p.main_grad.fill_(0.01)  # pyright: ignore[reportAttributeAccessIssue]
        assert policy.step()[0]
    root = str(tmp_path / "run")
    ckpt = checkpoint.save_checkpoint(root, 2, policy)
    same = _tiny_policy(tiny_qwen2, trainable=True, **saved_optim)
    checkpoint.load_checkpoint(ckpt, same)
    assert same.lr == policy.lr  # the same configuration: the same learning rate
    changed = _tiny_policy(tiny_qwen2, trainable=True, lr=4e-3, min_lr=1e-3, weight_decay=0.1,
                           adam_beta1=0.8, adam_beta2=0.99, adam_eps=1e-6, lr_warmup_iters=0,
                           lr_decay_style="linear", lr_decay_iters=20)
    checkpoint.load_checkpoint(ckpt, changed)
    assert changed.scheduler is not None and changed.scheduler.num_steps == 2
    expected = 1e-3 + (4e-3 - 1e-3) * (1 - 2 / 20)  # linear, no warm-up, at step 2 of 20
    assert changed.lr == pytest.approx(expected, rel=1e-12)
    groups = changed.optimizer.param_groups
    assert {g["betas"] for g in groups} == {(0.8, 0.99)} and {g["eps"] for g in groups} == {1e-6}
    assert sorted(g["weight_decay"] for g in groups) == [0.0, 0.1]  # biases and norms: none
    for a, b in zip(_adam_moments(policy), _adam_moments(changed), strict=True):
        assert torch.equal(a, b)  # Adam's state, restored


def _adam_moments(pol) -> list[torch.Tensor]:
    """The first moments of `pol`'s Adam, in parameter-group order."""
    optimizers = getattr(pol.optimizer, "chained_optimizers", [pol.optimizer])
    return [opt.optimizer.state[p]["exp_avg"] for opt in optimizers
            for g in opt.optimizer.param_groups for p in g["params"]]


def test_kills_at_random_moments_of_back_to_back_saves_always_resume_a_matching_pair(
        policy, tiny_qwen2, tmp_path):
    """SIGKILL at seeded random moments of a process that does nothing but save run
    checkpoints (policy + optimizer + reference; nearly every moment is inside a save), each
    restart continuing after the newest complete one: after every kill the next start finds a
    complete checkpoint no older than the last one it saw, its policy and reference of the same
    step, and no partial save left behind."""
    import random
    import signal
    import sys
    import time

    root, worker = str(tmp_path / "run"), os.path.join(os.path.dirname(__file__),
                                                       "save_kill_worker.py")
    rng, newest = random.Random(0), 0
    reference = policy  # one module, loaded twice: the pair is compared step by step
    for attempt in range(3):
        proc = subprocess.Popen([sys.executable, worker, root, tiny_qwen2], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "saved"
        time.sleep(rng.uniform(0.0, 1.5))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        found = checkpoint.complete_checkpoint(root)
        assert found is not None and not any(n.startswith(".tmp-") for n in os.listdir(root))
        step = int(found.rsplit("_", 1)[1])
        assert step >= newest, (attempt, step, newest)
        newest = step
        checkpoint.load_checkpoint(found, policy, with_optimizer=False)
        assert torch.all(_first(policy) == float(step)), (attempt, step)
        ref = checkpoint.step_reference(found)
        assert ref is not None, found
        checkpoint.load_checkpoint(ref, reference, with_optimizer=False)
        assert torch.all(_first(reference) == -float(step)), (attempt, step)
    assert newest >= 2, "the saves never got going: the test did not exercise them"


# -- a weights-only checkpoint in --save; every reader checks the manifest ------------------------

def test_a_conversion_in_save_starts_the_run_at_step_0_and_stays_its_reference(
        dist_env, tiny_qwen2, tmp_path):
    """`megatron-rl convert hf-to-megatron --save X`, then `train --save X` (with --load X,
    --finetune, or neither): the run starts at step 0 from the converted weights with a fresh
    optimizer, not a resume of optimizer state that a conversion does not hold; once the run has
    saved a step, a restart resumes that step and keeps the conversion as its reference."""
    from megatron_rl.convert import hf_to_megatron

    root = str(tmp_path / "run")
    converted = hf_to_megatron(tiny_qwen2, root)
    initial = _first(_tiny_policy(tiny_qwen2))
    for load, finetune in ((None, False), (root, False), (root, True)):
        ck = CheckpointConfig(save=root, load=load, finetune=finetune)
        assert checkpoint.checkpoints_to_load(ck) == (None, converted)
    resume, weights = checkpoint.checkpoints_to_load(CheckpointConfig(save=root, load=root))
    policy = _tiny_policy(tiny_qwen2, shift=-9.0, trainable=True)
    reference = _tiny_policy(tiny_qwen2, shift=-9.0)
    assert checkpoint.load_run_weights(policy, reference, resume, weights, hf=tiny_qwen2,
                                       ref_hf=None, reference_resets=False) is None  # step 0
    assert torch.equal(_first(policy), initial) and torch.equal(_first(reference), initial)
    assert len(policy.optimizer.optimizer.state) == 0  # fresh: no moments loaded
    # the run trains and saves step 2 into the same directory
    for p in policy.parameters():
        p.main_grad.fill_(0.01)  # pyright: ignore[reportAttributeAccessIssue]
    assert policy.step()[0]
    checkpoint.save_run(root, 2, policy, {}, 2)
    trained = _first(policy)
    resume, weights = checkpoint.checkpoints_to_load(CheckpointConfig(save=root, load=root))
    assert (resume, weights) == (os.path.join(root, "iter_0000002"), converted)
    extra, resumed, resumed_ref = _resume(root, tiny_qwen2, reference_resets=False)
    assert extra is not None and extra["step"] == 2
    assert torch.equal(_first(resumed), trained) and torch.equal(_first(resumed_ref), initial)


def test_a_checkpoint_loaded_for_what_it_does_not_hold_is_not_called_damaged(
        dist_env, tiny_qwen2, tmp_path):
    """A complete weights-only checkpoint loaded with an optimizer fails to load; the message
    says it is not damaged (its files match the manifest) rather than to move it aside."""
    from megatron_rl.convert import hf_to_megatron

    converted = hf_to_megatron(tiny_qwen2, str(tmp_path / "converted"))
    with pytest.raises(RuntimeError) as e:
        checkpoint.load_checkpoint(converted, _tiny_policy(tiny_qwen2, trainable=True))
    assert converted in str(e.value) and "not damaged" in str(e.value)
    assert "aside" not in str(e.value)


@pytest.mark.parametrize("damage", [_truncate, _overwrite_4k, _corrupt_extra_state])
def test_loading_a_damaged_checkpoint_is_refused_naming_the_file_before_any_weight(
        saved, policy, tmp_path, damage):
    """Every reader of a checkpoint (convert, eval, a resume) loads through load_checkpoint,
    which checks the manifest first: a damaged checkpoint is refused naming the file at fault
    and the newest complete checkpoint before it, and no weight is changed (a checkpoint
    overwritten in place loaded before as NaN or garbage weights, without an error)."""
    root = _copy(saved, tmp_path)
    newest = os.path.join(root, "iter_0000002")
    bad = damage(newest)
    before = _first(policy)
    with pytest.raises(ValueError, match="damaged") as e:
        checkpoint.load_checkpoint(newest, policy, with_optimizer=False)
    assert bad in str(e.value) and os.path.join(root, "iter_0000001") in str(e.value)
    assert torch.equal(_first(policy), before)
