"""The fake-node test bed for tests: see :mod:`nanotron_recover.testbed.fake_nodes` (also a command a user can run)."""

from __future__ import annotations

from pathlib import Path

from nanotron_recover.testbed.fake_nodes import kill_node, node_pids, write_bed

__all__ = ["fake_nodes_env", "kill_node", "node_pids", "write_bed"]


def fake_nodes_env(folder: Path, slots_per_node: list[int]) -> dict[str, str]:
    """Write the agent and the hostfile into ``folder``; the environment for ``nanotron-recover train``."""
    return write_bed(folder, slots_per_node)
