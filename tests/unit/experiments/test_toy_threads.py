"""`megatron-rl toy` picks its own torch thread count: 1 unless OMP_NUM_THREADS or --num-threads
says otherwise (its tensors are small, so extra threads only synchronise)."""
import pytest
import torch

from megatron_rl.experiments.toy import main, study_threads


def test_one_thread_unless_told(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert study_threads(None) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert study_threads(None) == 3
    assert study_threads(2) == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "")
    assert study_threads(None) == 1


def test_the_cli_runs_on_the_threads_it_picked(monkeypatch, tmp_path):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    seen = []
    import megatron_rl.experiments.toy as toy
    real = toy.run_study
    monkeypatch.setattr(toy, "run_study", lambda setup: seen.append(torch.get_num_threads())
                        or real(setup))
    try:
        args = ["--out", str(tmp_path), "--seq-len", "3", "--num-trials", "0", "--no-plot"]
        assert main(args) == 0
        assert main(args + ["--num-threads", "2"]) == 0
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 2]
    with pytest.raises(SystemExit):
        main(args + ["--num-threads", "0"])
