"""MetricsLogger (megatron_rl.metrics_log): every step in metrics.jsonl and TensorBoard exactly
once after a run is killed and started again, whether it resumes a checkpoint or starts over,
and whatever a kill mid-write left at the end of metrics.jsonl."""

import json
import os

import pytest

from megatron_rl.metrics_log import MetricsLogger


def _attempt(save: str, start_step: int, end_step: int, value: float) -> None:
    """One run's attempt: logs steps start_step + 1 .. end_step, then stops (killed)."""
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
