"""Adapters of other packages' environments to the agent loop's interface (agent/env.py), each
chosen by import path with --agent-environment: skyrl.py (skyrl-gym)."""
