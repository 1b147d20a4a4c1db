"""rollout.functions: --rollout-function names a built-in or a `module:function` path, and a
name that is neither, or does not import, is refused naming the flag; what a rollout function
returns is checked before it is trained on, the error naming the flag."""
import pytest

from megatron_rl.agent.settings import AgentConfig
from megatron_rl.rollout.base import Completion
from megatron_rl.rollout.functions import ROLLOUT_FUNCTIONS, check_groups, resolve_rollout_function
from megatron_rl.rollout.single_turn import single_turn, single_turn_trajectory


def test_built_in_and_import_path_name_the_same_function():
    assert ROLLOUT_FUNCTIONS["single-turn"] == "megatron_rl.rollout.single_turn:single_turn"
    assert resolve_rollout_function("single-turn") is single_turn
    assert resolve_rollout_function("megatron_rl.rollout.single_turn:single_turn") is single_turn
    # an attribute path after the module
    assert (resolve_rollout_function("megatron_rl.agent.settings:AgentConfig.unread_flags")
            is AgentConfig.unread_flags)


@pytest.mark.parametrize("name, message", [
    ("multi-turn", r"--rollout-function 'multi-turn': neither a built-in rollout function "
                   r"\(single-turn, agent\) nor an import path `module:function`"),
    ("no_such_module_xyz:rollout", r"--rollout-function 'no_such_module_xyz:rollout': cannot "
                                   r"import module 'no_such_module_xyz' \(ModuleNotFoundError"),
    ("megatron_rl.rollout.functions:no_such", r"--rollout-function "
     r"'megatron_rl.rollout.functions:no_such': 'megatron_rl.rollout.functions' has no "
     r"attribute 'no_such'"),
    ("megatron_rl.rollout.functions:ROLLOUT_FUNCTIONS", r"'ROLLOUT_FUNCTIONS' in "
     r"'megatron_rl.rollout.functions' is a dict, not a function"),
    (":single_turn", "neither a built-in"),
    ("megatron_rl.rollout.functions:", "neither a built-in"),
])
def test_bad_names_are_refused_naming_the_flag(name, message):
    with pytest.raises(ValueError, match=message):
        resolve_rollout_function(name)


def _trajectory(n=2, **overrides):
    t = single_turn_trajectory([1, 2], Completion(list(range(5, 5 + n)), [-0.5] * n, "stop"), 1.0)
    for k, v in overrides.items():
        setattr(t, k, v)
    return t


@pytest.mark.parametrize("groups, message", [
    ([[_trajectory(), _trajectory()]], "returned 1 groups for 2 prompts"),
    ("not a list", "returned str for 2 prompts"),
    ([[_trajectory(), _trajectory()], [_trajectory()]], "prompt 1: 1 trajectories, --group-size "
                                                        "is 2"),
    ([[_trajectory(), _trajectory()], [_trajectory(), Completion([5], [-0.1], "stop")]],
     "prompt 1 trajectory 1: a Completion, not a Trajectory"),
    ([[_trajectory(), _trajectory(prompt_ids=[])], [_trajectory(), _trajectory()]],
     "prompt 0 trajectory 1: no prompt tokens"),
    ([[_trajectory(), _trajectory()], [_trajectory(response_mask=[1]), _trajectory()]],
     "prompt 1 trajectory 0: 2 response tokens, 1 mask values, 2 log-probs"),
    ([[_trajectory(response_mask=[1, 2]), _trajectory()], [_trajectory(), _trajectory()]],
     "values other than 0 and 1"),
])
def test_what_a_rollout_function_returns_is_checked(groups, message):
    with pytest.raises(ValueError, match="--rollout-function my.agent:loop.*" + message):
        check_groups(groups, 2, 2, "my.agent:loop")
    check_groups([[_trajectory(), _trajectory()], [_trajectory(), _trajectory()]], 2, 2, "x")
