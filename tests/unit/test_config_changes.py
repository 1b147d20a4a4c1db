"""What a resume may change (megatron_rl.config_changes): the differences from the checkpoint's
configuration, listed as `--flag: <checkpoint> -> <new>`; free, accepted and refused settings;
and the record of each start in <save>/config.json and config_history.jsonl."""
import json
import os
import shutil

import pytest

from megatron_rl import config_changes
from megatron_rl.checkpoint import REFERENCE, TRAIN_CONFIG
from megatron_rl.config import TrainConfig, parse_config
from megatron_rl.flags import flag_fields, to_flat_dict

BASE = ["--hf-checkpoint", "m", "--train-data", "d.jsonl", "--lr", "0.01", "--train-iters", "4"]


def _checkpoint(root, argv) -> str:
    """A run checkpoint directory under `root` that records the configuration of `argv` (what
    checkpoint.save_run writes), as far as the comparison reads it."""
    ckpt = os.path.join(str(root), "iter_0000002")
    os.makedirs(ckpt)
    cfg = parse_config(argv + ["--save", str(root)])
    with open(os.path.join(ckpt, TRAIN_CONFIG), "w") as f:
        json.dump(config_changes.flat_config(cfg), f)
    return ckpt


def _resume(root, argv):
    return config_changes.check_resume(parse_config(argv + ["--save", str(root)]),
                                       os.path.join(str(root), "iter_0000002"))


def test_every_classified_setting_is_a_flag_in_one_class_with_a_reason():
    flags = set(flag_fields(TrainConfig))
    free, fixed = set(config_changes.RESUME_FREE), set(config_changes.RESUME_FIXED)
    assert free <= flags and fixed <= flags and not free & fixed
    assert all(config_changes.RESUME_FREE.values()) and all(config_changes.RESUME_FIXED.values())
    assert config_changes.classify("lr")[0] == config_changes.NEEDS_FLAG
    assert config_changes.classify("train_iters")[0] == config_changes.FREE
    assert config_changes.classify("seed")[0] == config_changes.FIXED


def test_differences_are_each_changed_setting_with_both_values():
    old = config_changes.flat_config(parse_config(BASE))
    new = config_changes.flat_config(parse_config(BASE + [
        "--lr", "0.005", "--eval-data", "e.jsonl", "--no-task-instruction", "--top-p", "0.9"]))
    diffs = config_changes.config_differences(old, new)
    assert diffs == {"eval_data": ([], ["e.jsonl"]), "task_instruction": (True, False),
                     "top_p": (1.0, 0.9), "lr": (0.01, 0.005)}
    assert [config_changes.describe(k, *v) for k, v in diffs.items()] == [  # in flag order
        "--eval-data: unset -> e.jsonl", "--task-instruction: on -> off", "--top-p: 1.0 -> 0.9",
        "--lr: 0.01 -> 0.005"]
    # a setting declared after the file was written counts as its default; a key no setting
    # reads any more is left out
    del old["kl_coef"], old["top_p"]
    old["log_interval"] = 5
    assert config_changes.config_differences(old, new) == diffs


def test_a_changed_lr_is_refused_listing_it_and_the_flag_that_accepts_it(tmp_path):
    _checkpoint(tmp_path, BASE)
    with pytest.raises(ValueError) as e:
        _resume(tmp_path, BASE + ["--lr", "0.005", "--kl-coef", "0.1", "--train-iters", "8"])
    message = str(e.value)
    assert "--lr: 0.01 -> 0.005" in message and "--kl-coef: 0.05 -> 0.1" in message
    assert "--allow-config-change" in message and os.path.join(str(tmp_path), "iter_0000002") \
        in message
    assert "--train-iters" not in message  # free


def test_free_settings_resume_without_the_flag(tmp_path):
    _checkpoint(tmp_path, BASE)
    with pytest.warns(UserWarning, match="in-process engine"):  # the layout: its own test
        saved = _resume(tmp_path, BASE + [
            "--train-iters", "9", "--save-interval", "3", "--eval-interval", "2", "--eval-data",
            "e.jsonl", "--exit-duration-in-mins", "30", "--no-exit-signal-handler",
            "--rank-wait-timeout-minutes", "5", "--micro-batch-size", "2",
            "--tensor-model-parallel-size", "2", "--rollout-process-cores", "0", "1"])
    assert saved is not None and saved["lr"] == 0.01 and saved["train_iters"] == 4


def test_the_flag_accepts_the_changes_and_says_which(tmp_path):
    _checkpoint(tmp_path, BASE)
    with pytest.warns(UserWarning, match="--lr: 0.01 -> 0.005"):
        saved = _resume(tmp_path, BASE + ["--lr", "0.005", "--allow-config-change"])
    assert saved is not None and saved["lr"] == 0.01


@pytest.mark.parametrize("flags, refused", [
    (["--seed", "7"], "--seed: 1234 -> 7 (the saved data position"),
    (["--bf16"], "--bf16: off -> on (the optimizer's state is saved in the run's precision"),
    (["--use-distributed-optimizer"], "--use-distributed-optimizer: off -> on"),
])
def test_settings_that_cannot_take_effect_are_refused_even_with_the_flag(tmp_path, flags,
                                                                         refused):
    _checkpoint(tmp_path, BASE)
    with pytest.raises(ValueError, match="even with --allow-config-change") as e:
        _resume(tmp_path, BASE + flags + ["--lr", "0.005", "--allow-config-change"])
    assert refused in str(e.value) and "--lr: 0.01 -> 0.005" in str(e.value)


def test_the_distributed_optimizer_keeps_its_layout(tmp_path):
    _checkpoint(tmp_path, BASE + ["--use-distributed-optimizer"])
    with pytest.raises(ValueError, match="--tensor-model-parallel-size: 1 -> 2 .*layout"):
        _resume(tmp_path, BASE + ["--use-distributed-optimizer", "--tensor-model-parallel-size",
                                  "2", "--allow-config-change"])


def test_a_moved_copy_of_the_model_may_be_accepted_another_architecture_not(tmp_path,
                                                                           tiny_qwen2):
    root = tmp_path / "run"
    ckpt = _checkpoint(root, ["--hf-checkpoint", tiny_qwen2] + BASE[2:])
    shutil.copy(os.path.join(tiny_qwen2, "config.json"), os.path.join(ckpt, "hf_config.json"))
    moved = str(tmp_path / "moved")
    shutil.copytree(tiny_qwen2, moved)
    argv = ["--hf-checkpoint", moved] + BASE[2:]
    with pytest.raises(ValueError, match=f"--hf-checkpoint: {tiny_qwen2} -> {moved}\n"):
        _resume(root, argv)
    with pytest.warns(UserWarning, match="--hf-checkpoint"):
        _resume(root, argv + ["--allow-config-change"])
    with open(os.path.join(moved, "config.json")) as f:
        hf = json.load(f)
    hf["num_hidden_layers"] += 1
    with open(os.path.join(moved, "config.json"), "w") as f:
        json.dump(hf, f)
    with pytest.raises(ValueError, match="architecture: num_hidden_layers"):
        _resume(root, argv + ["--allow-config-change"])


def test_a_saved_reference_is_the_runs_so_another_ref_checkpoint_is_refused(tmp_path):
    ckpt = _checkpoint(tmp_path, BASE + ["--ref-reset-interval", "2"])
    os.makedirs(os.path.join(ckpt, REFERENCE))
    with pytest.raises(ValueError, match="--ref-checkpoint: unset -> r .*holds the run's "
                                         "reference"):
        _resume(tmp_path, BASE + ["--ref-reset-interval", "2", "--ref-checkpoint", "r",
                                  "--allow-config-change"])


def test_load_is_free_where_it_names_the_resumed_checkpoint_compared_otherwise(tmp_path):
    ckpt = _checkpoint(tmp_path / "first", BASE)
    # the run checkpoint given with --load resumes into another --save
    cfg = parse_config(BASE + ["--load", str(tmp_path / "first"), "--save",
                               str(tmp_path / "second")])
    assert config_changes.check_resume(cfg, ckpt) is not None
    # resuming --save's own checkpoint, --load is a weights-only reference: compared
    with pytest.raises(ValueError, match="--load: unset -> w"):
        _resume(tmp_path / "first", BASE + ["--load", "w"])


def test_a_decay_that_follows_train_iters_says_so(tmp_path):
    cosine = ["--lr-decay-style", "cosine"]
    _checkpoint(tmp_path, BASE + cosine)
    with pytest.raises(ValueError, match=r"--lr-decay-iters: 4 -> 8 \(unset, --lr-decay-iters "
                                         r"follows --train-iters"):
        _resume(tmp_path, BASE + cosine + ["--train-iters", "8"])
    _resume(tmp_path, BASE + cosine + ["--train-iters", "8", "--lr-decay-iters", "4"])


def test_a_checkpoint_without_its_configuration_is_compared_with_its_run_directorys(tmp_path):
    ckpt = _checkpoint(tmp_path, BASE)
    os.remove(os.path.join(ckpt, TRAIN_CONFIG))
    with pytest.warns(UserWarning, match="holds no record of its run's configuration"):
        assert _resume(tmp_path, BASE + ["--lr", "0.005"]) is None
    with open(tmp_path / "config.json", "w") as f:  # as runs wrote it before checkpoints did
        json.dump(to_flat_dict(parse_config(BASE)), f)
    with pytest.raises(ValueError, match="--lr: 0.01 -> 0.005"):
        _resume(tmp_path, BASE + ["--lr", "0.005"])


def test_each_start_appends_its_record_and_config_json_is_the_current_configuration(tmp_path):
    save = str(tmp_path)
    first = parse_config(BASE + ["--save", save])
    record = config_changes.record_start(save, first, 0, None)
    assert record["start_step"] == 0 and record["resumed_from"] is None
    assert record["config"] == config_changes.flat_config(first)
    with open(tmp_path / config_changes.HISTORY, "a") as f:
        f.write('{"time": "2026-')  # a record torn by a kill
    second = parse_config(BASE + ["--save", save, "--lr", "0.005", "--train-iters", "8",
                                  "--allow-config-change"])
    ckpt = os.path.join(save, "iter_0000004")
    config_changes.record_start(save, second, 4, ckpt)
    with open(tmp_path / config_changes.HISTORY) as f:
        lines = f.read().splitlines()
    assert len(lines) == 3 and lines[1] == '{"time": "2026-'
    last = json.loads(lines[2])
    assert last["start_step"] == 4 and last["resumed_from"] == ckpt
    assert last["changes"] == {"train_iters": [4, 8], "lr": [0.01, 0.005]}
    assert "T" in last["time"] and last["time"].endswith("+00:00")
    # config.json: the current configuration, usable as --config (the permission is this
    # start's only)
    again = parse_config(["--config", str(tmp_path / config_changes.CONFIG)])
    assert again.optimizer.lr == 0.005 and not again.checkpoint.allow_config_change
    assert to_flat_dict(again) == {**to_flat_dict(second), "allow_config_change": False}


SERVERS = ["--rollout-engine", "vllm", "--filter-overlong-prompts"]


def test_a_context_limit_that_decides_the_filtered_rows_needs_the_flag(tmp_path):
    """Under --filter-overlong-prompts the context limit decides which rows the run trains on:
    a resume that changes it is refused like a change of the data, naming why."""
    _checkpoint(tmp_path, BASE + SERVERS + ["--rollout-max-context-len", "4096"])
    with pytest.raises(ValueError) as e:
        _resume(tmp_path, BASE + SERVERS + ["--rollout-max-context-len", "2048"])
    assert ("--rollout-max-context-len: 4096 -> 2048 (under --filter-overlong-prompts the "
            "context limit decides which rows the run trains on: --rollout-max-context-len 4096 "
            "-> --rollout-max-context-len 2048)") in str(e.value)
    # attached servers: the model's positions are the limit, not --rollout-max-context-len
    with pytest.raises(ValueError, match="--rollout-url: unset -> http://h:1 .*decides which rows"):
        _resume(tmp_path, BASE + SERVERS + ["--rollout-max-context-len", "4096",
                                            "--rollout-url", "http://h:1"])
    with pytest.warns(UserWarning, match="--rollout-max-context-len: 4096 -> 2048"):
        _resume(tmp_path, BASE + SERVERS + ["--rollout-max-context-len", "2048",
                                            "--allow-config-change"])


@pytest.mark.parametrize("saved, resumed", [
    # without the filter an overlong prompt is refused at the start: the rows are the same
    (["--rollout-engine", "vllm", "--rollout-max-context-len", "4096"],
     ["--rollout-engine", "vllm", "--rollout-max-context-len", "2048"]),
    # the in-process engine's limit is the model's positions whatever the flag
    (["--filter-overlong-prompts", "--rollout-max-context-len", "4096"],
     ["--filter-overlong-prompts", "--rollout-max-context-len", "2048"]),
    # attached servers, another address: the same limit
    (SERVERS + ["--rollout-url", "http://a:1"], SERVERS + ["--rollout-url", "http://b:1"]),
])
def test_a_context_change_that_keeps_the_rows_stays_free(tmp_path, saved, resumed):
    _checkpoint(tmp_path, BASE + saved)
    assert _resume(tmp_path, BASE + resumed) is not None


def test_another_data_parallel_size_with_the_in_process_engine_resumes_with_a_warning(tmp_path):
    """The layout stays free (a preemption onto other nodes is normal); where it changes the
    samples (the in-process engine seeds each data-parallel replica), the resume says so."""
    _checkpoint(tmp_path, BASE)
    with pytest.warns(UserWarning, match=r"change which samples it draws or keeps[^\n]*\n"
                                         r"  --tensor-model-parallel-size: 1 -> 2 \(it sets the "
                                         r"data-parallel size.*in-process engine"):
        assert _resume(tmp_path, BASE + ["--tensor-model-parallel-size", "2"]) is not None


def test_another_layout_with_an_engine_of_its_own_resumes_silently(tmp_path, recwarn):
    process = BASE + ["--rollout-engine", "process"]
    _checkpoint(tmp_path, process)
    assert _resume(tmp_path, process + ["--tensor-model-parallel-size", "2",
                                        "--pipeline-model-parallel-size", "2",
                                        "--no-sequence-packing", "--micro-batch-size", "2"])
    assert not [w for w in recwarn if issubclass(w.category, UserWarning)]


def test_a_keep_kl_batch_unit_that_changes_with_the_layout_is_named(tmp_path):
    """--dynamic-sampling-keep-kl rounds a batch to whole data-parallel shares and, under
    pipeline parallelism without packing, whole microbatches: another layout may keep other
    groups, which the resume says (process engine: the samples themselves are the same)."""
    keep = BASE + ["--rollout-engine", "process", "--dynamic-sampling", "--kl-placement",
                   "reward", "--pipeline-model-parallel-size", "2", "--no-sequence-packing",
                   "--group-size", "2", "--micro-batch-size", "2"]
    _checkpoint(tmp_path, keep)
    with pytest.warns(UserWarning, match=r"--micro-batch-size: 2 -> 4 \(under pipeline "
                                         r"parallelism.*keep other groups"):
        _resume(tmp_path, keep + ["--micro-batch-size", "4"])
    with pytest.warns(UserWarning, match=r"--tensor-model-parallel-size: 1 -> 2 .*multiple of "
                                         r"data-parallel size x --ppo-minibatches"):
        _resume(tmp_path, keep + ["--tensor-model-parallel-size", "2"])
