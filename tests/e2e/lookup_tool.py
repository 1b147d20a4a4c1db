"""A user's tool given to the trainer by import path (--agent-tools lookup_tool:make_lookup,
with this directory on PYTHONPATH) and made from its settings (--agent-tool-args):
test_user_plugins.py checks its answers in the saved trajectories."""
from megatron_rl.agent.tools import Tool


def make_lookup(table: dict, default: str) -> Tool:
    """`lookup`: the value of `key` in `table` (`default`'s value when no key is given)."""
    def lookup(key: str = default) -> str:
        return table.get(key, f"unknown key {key!r}; known: {', '.join(sorted(table))}")

    return Tool("lookup", "Look a constant up by its name.",
                {"type": "object", "properties": {"key": {"type": "string"}}}, lookup)
