"""Shared pytest configuration: test tiers as markers, and hardware skips.

Markers: `distributed` (spawns processes / torch.distributed over gloo), `gpu` (needs CUDA;
skipped with a reason where it is absent), `slow` (deselect with -m "not slow").
"""
import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line("markers", "distributed: multi-process test over torch.distributed (gloo)")
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped when none is present")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
