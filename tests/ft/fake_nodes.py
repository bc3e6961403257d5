"""Several Open MPI "nodes" on one machine: one real ``prted`` daemon per node, as over ssh.

A hostfile names nodes ``n1 n2 ...``; ``--prtemca plm_ssh_agent`` points at a script that drops ssh's options and
the host name and runs the daemon's command locally (FACTS.md, "Many nodes"). Ranks fill the nodes in order.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from nanotron_recover.launch import HOSTFILE_ENV, MPIRUN_ARGS_ENV

AGENT = """#!/usr/bin/env bash
# a stand-in for ssh: drop its options and the host name, run the command here
while [[ $# -gt 0 ]]; do
  case "$1" in
    -o|-p|-l|-i|-F) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
shift
exec bash -c "$*"
"""


def fake_nodes_env(folder: Path, slots_per_node: list[int]) -> dict[str, str]:
    """Write the agent and the hostfile into ``folder``; the environment for ``nanotron-recover train``."""
    folder.mkdir(parents=True, exist_ok=True)
    agent = folder / "fake_ssh.sh"
    agent.write_text(AGENT)
    agent.chmod(0o755)
    hostfile = folder / "hostfile"
    hostfile.write_text("".join(f"n{i + 1} slots={n}\n" for i, n in enumerate(slots_per_node)))
    # Shared memory only within a real node: processes of two fake nodes would map each other's segments wrongly
    # (a segfault in mca_btl_sm_poll_handle_frag was seen), so the bed talks TCP, as real nodes do.
    args = ["--prtemca", "plm_ssh_agent", str(agent), "--mca", "btl", "tcp,self"]
    return {HOSTFILE_ENV: str(hostfile), MPIRUN_ARGS_ENV: shlex.join(args)}
