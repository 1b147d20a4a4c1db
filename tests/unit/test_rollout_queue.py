"""Batches a checkpoint saved ahead (--async-level) that name their classes by the modules that
defined them in earlier releases (Trajectory in megatron_rl.rollout.functions, Sampled in
megatron_rl.rollout.orchestrate) load as today's classes, so that such a resume trains on them
rather than generating them again."""
import io
import sys
import types

import pytest
import torch

from megatron_rl.batch import Trajectory
from megatron_rl.dynamic_sampling import Sampled
from megatron_rl.rollout_queue import _SAVED_PICKLE


def _saved_under(module_name: str, obj) -> bytes:
    """torch.save of a saved-ahead state holding `obj`, its class named as defined in
    `module_name` (the attribute is set there for the save only)."""
    cls = type(obj)
    module = sys.modules.get(module_name) or types.ModuleType(module_name)
    registered, real = module_name not in sys.modules, cls.__module__
    held = getattr(module, cls.__name__, None)
    sys.modules[module_name] = module
    setattr(module, cls.__name__, cls)
    cls.__module__ = module_name
    try:
        buffer = io.BytesIO()
        torch.save({"rollouts": [obj]}, buffer)
        return buffer.getvalue()
    finally:
        cls.__module__ = real
        if held is None:
            delattr(module, cls.__name__)
        else:
            setattr(module, cls.__name__, held)
        if registered:
            del sys.modules[module_name]


@pytest.mark.parametrize("former, obj", [
    ("megatron_rl.rollout.functions", Trajectory([1, 2], [3, 4], [1, 0], [-0.5, 0.0], "stop", 1.0)),
    ("megatron_rl.rollout.orchestrate", Sampled(groups=[], data_state={"position": 3}, stats={"rollout/rounds": 1.0})),
])
def test_a_batch_saved_under_its_former_module_loads(former, obj):
    saved = _saved_under(former, obj)
    assert former.encode() in saved
    loaded = torch.load(io.BytesIO(saved), weights_only=False, pickle_module=_SAVED_PICKLE)
    assert type(loaded["rollouts"][0]) is type(obj) and loaded["rollouts"][0] == obj
