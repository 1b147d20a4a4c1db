"""MetricsLogger (megatron_rl.metrics_log): every step in metrics.jsonl, TensorBoard and W&B
exactly once after a run is killed and started again, whether it resumes a checkpoint or starts
over, and whatever a kill mid-write left at the end of metrics.jsonl; W&B's flags, and its error
where the wandb package is missing."""

import glob
import json
import os
import sys
import time

import pytest

from megatron_rl.metrics_log import LoggingConfig, MetricsLogger


def _next_second() -> None:
    """Waits for the next whole second. TensorBoard reads a directory's event files in name
    order, and a name is the start's whole-second time, then a per-process counter compared as
    text ("10" before "9"): two starts in one second of one process (only a test does that)
    could be read in the wrong order."""
    time.sleep(1.0 - time.time() % 1.0 + 0.01)


def _attempt(save: str, start_step: int, end_step: int, value: float) -> None:
    """One run's attempt: logs steps start_step + 1 .. end_step, then stops (killed)."""
    _next_second()
    logger = MetricsLogger(save, enabled=True, start_step=start_step)
    for step in range(start_step + 1, end_step + 1):
        logger.log(step, {"loss": value + step})
    logger.close()


def _jsonl(save: str) -> list[tuple[int, float]]:
    with open(os.path.join(save, "metrics.jsonl")) as f:
        return [(row["step"], row["loss"]) for row in map(json.loads, f)]


def _tensorboard(save: str) -> list[tuple[int, float]]:
    """The scalars TensorBoard shows (after its purge of orphaned events)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(save, "tensorboard"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars("loss")]


def test_resume_after_a_torn_line_logs_each_step_once(tmp_path):
    save = str(tmp_path)
    _attempt(save, 0, 5, 100.0)  # steps 1..5 logged, checkpoint at step 3, killed in step 6's
    with open(os.path.join(save, "metrics.jsonl"), "a") as f:  # write of metrics.jsonl
        f.write('{"step": 6, "lo')
    with pytest.warns(UserWarning, match=r"metrics\.jsonl: dropping 1 incomplete line"):
        _attempt(save, 3, 7, 200.0)  # resumes the checkpoint of step 3
    expected = [(s, 100.0 + s) for s in (1, 2, 3)] + [(s, 200.0 + s) for s in (4, 5, 6, 7)]
    assert _jsonl(save) == expected
    assert _tensorboard(save) == expected


def test_restart_without_a_checkpoint_starts_the_logs_over(tmp_path):
    save = str(tmp_path)
    _attempt(save, 0, 4, 100.0)  # killed before its first checkpoint
    _attempt(save, 0, 2, 200.0)  # so the restart begins at step 0 again
    assert _jsonl(save) == [(1, 201.0), (2, 202.0)]
    assert _tensorboard(save) == [(1, 201.0), (2, 202.0)]


def test_a_logger_on_another_rank_touches_nothing(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')
    MetricsLogger(str(tmp_path), enabled=False, start_step=0).close()
    assert path.read_text() == '{"step": 1, "loss": 1.0}\n{"step": 2, "lo'
    assert not (tmp_path / "tensorboard").exists()


# -- Weights & Biases (--wandb-project) ---------------------------------------------------------

BASE = ["--hf-checkpoint", "m", "--train-data", "d.jsonl"]


def _offline_segments(wandb_dir: str) -> list[dict]:
    """Each start's offline W&B run, in the order the starts ran, read back from its
    transaction log (the .wandb file that `wandb sync` uploads): its run id, its rewind point
    (the step its history continues from, or None) and its {step: loss} history rows."""
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal.datastore import DataStore

    segments = []
    for path in glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*", "run-*.wandb")):
        store = DataStore()
        store.open_for_scan(path)
        segment: dict = {"id": None, "rewind_to": None, "rows": []}
        while (data := store.scan_data()) is not None:
            record = wandb_internal_pb2.Record()  # pyright: ignore[reportAttributeAccessIssue] (re-exported by protobuf version)
            record.ParseFromString(data)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                segment["id"] = record.run.run_id
                segment["started"] = record.run.start_time.ToMicroseconds()
                point = record.run.branch_point
                if point.run:
                    assert (point.run, point.metric) == (record.run.run_id, "_step"), point
                    segment["rewind_to"] = int(point.value)
                segment["config"] = {u.key: json.loads(u.value_json)
                                     for u in record.run.config.update}
            elif kind == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                       for i in record.history.item}
                segment["rows"].append((row["_step"], row["loss"]))
        segments.append(segment)
    return sorted(segments, key=lambda segment: segment["started"])


def _synced_history(segments: list[dict]) -> list[tuple[int, float]]:
    """The history W&B holds once the segments are uploaded in order: a rewinding segment
    first truncates the run's history after its rewind point, a continuing one appends."""
    history: list[tuple[int, float]] = []
    for segment in segments:
        if segment["rewind_to"] is not None:
            history = [(s, v) for s, v in history if s <= segment["rewind_to"]]
        history += segment["rows"]
    return history


@pytest.fixture(scope="module")
def wandb_attempts(tmp_path_factory):
    """Three starts of one run with --wandb-project under WANDB_MODE=offline: the first logs
    steps 1..4 and is killed (its checkpoint: step 2); the second resumes step 2, logs 3..5 and
    stops cleanly (its checkpoint: step 5); the third resumes step 5 and logs 6."""
    import wandb

    save = str(tmp_path_factory.mktemp("run"))
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true",
           **{k: os.path.join(save, "home") for k in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR",
                                                      "WANDB_DATA_DIR")}}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        cfg = LoggingConfig(wandb_project="megatron-rl-test", wandb_exp_name="tiny")
        for start, end, value in ((0, 4, 100.0), (2, 5, 200.0), (5, 6, 300.0)):
            _next_second()
            logger = MetricsLogger(save, enabled=True, start_step=start, wandb_cfg=cfg,
                                   config={"train_iters": 6, "seed": 1234})
            for step in range(start + 1, end + 1):
                logger.log(step, {"loss": value + step, "note": "not a scalar"})
            logger.close()
            wandb.teardown()  # as at the process's exit: W&B's files are complete on disk
    return save


def test_wandb_resumes_into_one_run_and_holds_each_step_once(wandb_attempts):
    save = wandb_attempts
    segments = _offline_segments(os.path.join(save, "wandb"))
    with open(os.path.join(save, "wandb", "run_id")) as f:
        run_id = f.read().strip()
    assert [s["id"] for s in segments] == [run_id] * 3
    # what the offline logs hold: every start's steps, with W&B's step = the run's step
    assert [s["rows"] for s in segments] == [
        [(1, 101.0), (2, 102.0), (3, 103.0), (4, 104.0)],
        [(3, 203.0), (4, 204.0), (5, 205.0)],
        [(6, 306.0)]]
    # the second start found steps 3, 4 beyond its checkpoint: it rewinds the run to step 2;
    # the third had nothing to redo and continues the run
    assert [s["rewind_to"] for s in segments] == [None, 2, None]
    expected = [(1, 101.0), (2, 102.0), (3, 203.0), (4, 204.0), (5, 205.0), (6, 306.0)]
    assert _synced_history(segments) == expected
    assert _jsonl(save) == expected
    assert _tensorboard(save) == expected
    assert all(s["config"]["train_iters"] == 6 and s["config"]["seed"] == 1234
               for s in segments)


def test_wandb_flags_parse_and_default_to_off():
    from megatron_rl.config import build_parser, parse_config

    assert parse_config(BASE).logging == LoggingConfig()
    cfg = parse_config(BASE + ["--wandb-project", "p", "--wandb-exp-name", "n",
                               "--wandb-save-dir", "/tmp/w", "--wandb-entity", "e"])
    assert cfg.logging == LoggingConfig("p", "n", "/tmp/w", "e")
    shown = build_parser().format_help()
    for flag in ("--wandb-project", "--wandb-exp-name", "--wandb-save-dir", "--wandb-entity"):
        assert flag in shown
    with pytest.raises(ValueError, match=r"--wandb-exp-name 'n' needs --wandb-project"):
        parse_config(BASE + ["--wandb-exp-name", "n"])


def test_wandb_without_the_package_fails_at_startup_saying_how_to_install(monkeypatch, tmp_path):
    from megatron_rl.config import parse_config

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(ValueError, match=r"--wandb-project 'p' .*not installed: pip install "
                                         r"wandb"):
        parse_config(BASE + ["--wandb-project", "p"])
    with pytest.raises(ImportError, match=r"not installed: pip install wandb"):
        MetricsLogger(str(tmp_path), enabled=True, wandb_cfg=LoggingConfig("p"))
    MetricsLogger(str(tmp_path), enabled=True, wandb_cfg=LoggingConfig()).close()  # W&B off


# -- a log that fails mid-run -------------------------------------------------------------------

def test_a_failing_log_is_reported_once_and_a_repaired_one_gets_every_step(tmp_path, capsys):
    """metrics.jsonl turned into a directory (what no process can append to, root included)
    and the TensorBoard directory removed after step 2: logging goes on with one warning each;
    once metrics.jsonl is a file again it receives the steps it missed, in order, and
    TensorBoard's directory is made again for the steps after its removal."""
    import shutil

    save = str(tmp_path)
    path = tmp_path / "metrics.jsonl"
    logger = MetricsLogger(save, enabled=True, start_step=0)
    logger.log(1, {"loss": 101.0})
    logger.log(2, {"loss": 102.0})
    path.rename(tmp_path / "moved.jsonl")
    path.mkdir()
    shutil.rmtree(tmp_path / "tensorboard")
    with pytest.warns(UserWarning) as caught:
        for step in (3, 4, 5):
            logger.log(step, {"loss": 100.0 + step})
    messages = [str(w.message) for w in caught]
    assert len([m for m in messages if "metrics.jsonl: writing the metrics failed" in m]) == 1
    assert len([m for m in messages if "tensorboard: writing the metrics failed" in m]) <= 1
    path.rmdir()
    (tmp_path / "moved.jsonl").rename(path)
    logger.log(6, {"loss": 106.0})
    logger.close()
    assert "metrics.jsonl: written again (steps 3-5 late)" in capsys.readouterr().err
    assert _jsonl(save) == [(s, 100.0 + s) for s in range(1, 7)]
    assert [s for s, _ in _tensorboard(save)] == [3, 4, 5, 6]


def test_a_log_still_failing_at_the_end_names_the_steps_it_lacks(tmp_path):
    logger = MetricsLogger(str(tmp_path), enabled=True, start_step=4)
    (tmp_path / "metrics.jsonl").mkdir()
    with pytest.warns(UserWarning, match=r"metrics\.jsonl: writing the metrics failed "
                                         r"\(IsADirectoryError"):
        logger.log(5, {"loss": 1.0})
        logger.log(6, {"loss": 2.0})
    with pytest.warns(UserWarning, match=r"metrics\.jsonl: steps 5-6 of this run were not "
                                         r"written \(IsADirectoryError"):
        logger.close()
    assert _tensorboard(str(tmp_path)) == [(5, 1.0), (6, 2.0)]


def test_an_unusable_metrics_file_is_refused_at_the_start_naming_it(tmp_path):
    from megatron_rl.metrics_log import check_log_files

    check_log_files(str(tmp_path))  # nothing there yet
    (tmp_path / "metrics.jsonl").mkdir()
    with pytest.raises(ValueError, match=rf"{tmp_path}/metrics\.jsonl cannot be read and "
                                         r"appended to \(IsADirectoryError"):
        check_log_files(str(tmp_path))
    with pytest.raises(ValueError, match=r"metrics\.jsonl cannot be read and appended to"):
        MetricsLogger(str(tmp_path), enabled=True, start_step=3)
    (tmp_path / "metrics.jsonl").rmdir()
    (tmp_path / "tensorboard").write_text("")
    with pytest.raises(ValueError, match=rf"{tmp_path}/tensorboard is not a directory"):
        check_log_files(str(tmp_path))


def test_a_failing_wandb_run_is_retried_with_the_steps_it_missed(tmp_path):
    class FlakyRun:  # W&B's service unreachable for two steps
        id, failures, logged = "abc123", 2, []

        def log(self, row, step, commit):
            if self.failures:
                self.failures -= 1
                raise ConnectionError("W&B service unreachable")
            self.logged.append((step, row["loss"]))

        def finish(self, exit_code):
            pass

    logger = MetricsLogger(str(tmp_path), enabled=True)
    logger.wandb_run = FlakyRun()  # type: ignore[assignment]
    with pytest.warns(UserWarning, match=r"W&B run abc123: writing the metrics failed "
                                         r"\(ConnectionError"):
        for step in (1, 2, 3):
            logger.log(step, {"loss": float(step)})
    assert FlakyRun.logged == [(1, 1.0), (2, 2.0), (3, 3.0)]
    logger.close()
