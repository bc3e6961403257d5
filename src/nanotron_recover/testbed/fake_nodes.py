"""Several Open MPI "nodes" on one machine: one real ``prted`` daemon per node, as over ssh (a test bed).

A hostfile names nodes ``n1 n2 ...``; ``--prtemca plm_ssh_agent`` points at a script that stands in for ssh: it
drops ssh's options and the host name and runs the daemon's command here (README, "Running on many nodes"). Every node
then has its own ``prted`` with its ranks under it, exactly as on a cluster, so a node can be lost for real:
:func:`kill_node` SIGKILLs one node's daemon and every process under it. The agent records the pid it runs as
in ``<folder>/<node>.pid`` (it ``exec``s, so that pid is the root of the node's process tree).

Processes of two fake nodes must not use shared memory with each other (a segfault in
``mca_btl_sm_poll_handle_frag`` was seen), so the bed talks TCP between all ranks, as real nodes do.

Use it from a shell::

    eval "$(python -m nanotron_recover.testbed.fake_nodes up /tmp/bed --nodes 3 --slots 2)"
    nanotron-recover train --config-file C ...        # mpirun starts one prted per fake node
    python -m nanotron_recover.testbed.fake_nodes ps /tmp/bed  # which ranks and pids live on which node
    python -m nanotron_recover.testbed.fake_nodes kill /tmp/bed n3   # lose node n3 (its prted and its ranks)

Standard library only (and the launcher's light module); Linux (/proc).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Sequence

from nanotron_recover.launcher.launch import HOSTFILE_ENV, MPIRUN_ARGS_ENV  # what the launcher reads (light imports)
from nanotron_recover.run.procfs import proc_stat, process_is_gone

# what an ssh stand-in does first: drop ssh's options, take the host name ($host), leave the command in "$@"
SSH_ARGS = """while [[ $# -gt 0 ]]; do
  case "$1" in
    -o|-p|-l|-i|-F) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
host=$1
shift
export NANOTRON_RECOVER_NODE_NAME="$host"  # the ranks' node name (node-local snapshots)
"""

AGENT = """#!/usr/bin/env bash
# a stand-in for ssh (nanotron_recover.testbed.fake_nodes): drop its options and the host name, run the command here
""" + SSH_ARGS + """# the node's root process, not the launcher's probe (hostfile_nodes.py: `true`)
[[ "$*" != true ]] && echo $$ > "$(dirname "$0")/$host.pid"
exec bash -c "$*"
"""


def node_names(n_nodes: int) -> list[str]:
    return [f"n{i + 1}" for i in range(n_nodes)]


def write_bed(folder: Path, slots_per_node: Sequence[int]) -> dict[str, str]:
    """Write the agent and the hostfile into ``folder``; return the environment for ``nanotron-recover train``
    (``NANOTRON_RECOVER_HOSTFILE`` and ``NANOTRON_RECOVER_MPIRUN_ARGS``)."""
    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("n*.pid"):
        stale.unlink()
    agent = folder / "fake_ssh.sh"
    agent.write_text(AGENT)
    agent.chmod(0o755)
    hostfile = folder / "hostfile"
    names = node_names(len(slots_per_node))
    hostfile.write_text("".join(f"{name} slots={n}\n" for name, n in zip(names, slots_per_node)))
    # The nodes share this machine's cores, but PRRTE sees each fake node's slots filled, not exceeded, so ranks
    # would busy-poll in MPI as on a real node: with more ranks than cores that slowed every MPI operation ~100x
    # here (an Allreduce of 10 KB over 3 nodes x 2 ranks on 2 cores: 33 ms, 0.38 ms yielding). Ranks yield instead.
    args = ["--prtemca", "plm_ssh_agent", str(agent), "--mca", "btl", "tcp,self", "--mca", "mpi_yield_when_idle", "1"]
    return {HOSTFILE_ENV: str(hostfile), MPIRUN_ARGS_ENV: shlex.join(args)}


def _children() -> dict[int, list[int]]:
    """parent pid -> child pids, from /proc."""
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        stat = proc_stat(int(entry)) if entry.isdigit() else None
        if stat is not None:
            out.setdefault(stat[0], []).append(int(entry))
    return out


def _alive(pid: int) -> bool:
    return not process_is_gone(pid)


def process_tree(root: int, children: dict[int, list[int]] | None = None) -> list[int]:
    """``root`` and every live descendant."""
    children = _children() if children is None else children
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        if _alive(pid):
            found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def node_pids(folder: Path, node: str, *, daemon_only: bool = False) -> list[int]:
    """The live processes of ``node``: the agent's shell (the stand-in for the ssh session) and every descendant
    (``prted``, ranks, their watchdogs). ``daemon_only``: the ``prted`` and what runs under it, without the shell."""
    pid_file = Path(folder) / f"{node}.pid"
    if not pid_file.is_file():
        return []
    children = _children()
    found = process_tree(int(pid_file.read_text().strip()), children)
    if daemon_only:
        daemons = [p for p in found if _comm(p) == "prted"]
        if daemons:
            # a prted forks a prted of its own: each process once
            return list(dict.fromkeys(p for d in daemons for p in process_tree(d, children)))
    return found


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def node_ranks(folder: Path, node: str) -> list[int]:
    """The MPI world ranks running on ``node`` now (``OMPI_COMM_WORLD_RANK`` of the processes under its daemon)."""
    ranks = []
    for pid in node_pids(folder, node, daemon_only=True):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        found = [e.split(b"=", 1)[1] for e in env if e.startswith(b"OMPI_COMM_WORLD_RANK=")]
        if found and found[0].isdigit():
            ranks.append(int(found[0]))
    return sorted(set(ranks))  # a rank's forked helpers inherit its environment


def kill_node(folder: Path, node: str, timeout_s: float = 10.0) -> list[int]:
    """Lose ``node``: SIGSTOP its ``prted`` and every process under it (the node goes silent at once), then
    SIGKILL them; wait until all are gone. Returns the pids killed; raises if the node has none.

    The agent's shell is left to end by itself, as the launching node's ssh client ends when its remote node
    dies (killing it first reads as "a daemon failed to report back" instead)."""
    pids = node_pids(folder, node, daemon_only=True)
    if not pids:
        raise ProcessLookupError(f"no live process of fake node {node} under {folder}")
    return kill_processes(pids, timeout_s, what=node)


def kill_processes(pids: Sequence[int], timeout_s: float = 10.0, what: str = "the node") -> list[int]:
    """SIGSTOP all of ``pids`` (all go silent at once), then SIGKILL them; wait until every one is gone."""
    pids = list(pids)
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + timeout_s
    while any(_alive(p) for p in pids):
        if time.monotonic() > deadline:
            raise TimeoutError(f"processes of {what} still alive {timeout_s} s after SIGKILL: "
                               f"{[p for p in pids if _alive(p)]}")
        time.sleep(0.01)
    return pids


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanotron_recover.testbed.fake_nodes", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="write the hostfile and the ssh stand-in; print the exports for the launcher")
    up.add_argument("folder", type=Path)
    up.add_argument("--nodes", type=int, required=True)
    up.add_argument("--slots", type=int, required=True, help="slots (ranks) per node")
    ps = sub.add_parser("ps", help="the live processes of each node")
    ps.add_argument("folder", type=Path)
    kill = sub.add_parser("kill", help="lose a node: SIGKILL its prted and every process under it")
    kill.add_argument("folder", type=Path)
    kill.add_argument("node", help="n1, n2, ...")
    args = parser.parse_args(argv)
    if args.command == "up":
        if args.nodes < 1 or args.slots < 1:
            parser.error("--nodes and --slots must be >= 1")
        for key, value in write_bed(args.folder, [args.slots] * args.nodes).items():
            print(f"export {key}={shlex.quote(value)}")
        return 0
    if args.command == "ps":
        for pid_file in sorted(Path(args.folder).glob("n*.pid")):
            node = pid_file.stem
            pids = " ".join(f"{p}:{_comm(p)}" for p in sorted(node_pids(args.folder, node))) or "(none)"
            print(f"{node} ranks {node_ranks(args.folder, node)} pids {pids}")
        return 0
    names = {p: _comm(p) for p in node_pids(args.folder, args.node)}
    try:
        pids = kill_node(args.folder, args.node)
    except (ProcessLookupError, TimeoutError) as e:
        print(f"fake_nodes: {e}", file=sys.stderr)
        return 1
    print(f"{args.node}: SIGKILLed {len(pids)} processes: {' '.join(f'{p}:{names.get(p)}' for p in pids)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
