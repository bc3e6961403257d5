"""A Slurm cluster on the isolated-node bed (:mod:`.isolated_nodes`): one ``slurmd`` inside each node's namespaces,
``slurmctld`` and ``munged`` on the host, reached over the bed's bridge (a test bed; needs root and Debian's Slurm).

``scripts/slurm/cluster.sh`` writes the configuration and runs the daemons, as for its one-host cluster; here each
node ``nI`` is ``NodeHostname=nI`` at its own address, and its ``slurmd`` is started through the bed's ``exec``
(so it, the job steps it starts, their ``prted`` and ranks all live in that node: a node lost takes them all, as a
machine's crash does). The munge socket and the spool folders are in the bed's folder, which every node sees.
A job's batch script runs in its first node; ``mpirun`` inside the allocation starts a ``prted`` per node through
``srun``, and ranks talk TCP over the bridge only (:func:`mpirun_args`)::

    eval "$(python -m nanotron_recover.testbed.isolated_slurm up /var/tmp/sbed --nodes 2 --slots 2)"
    sbatch --nodes=2 --ntasks-per-node=2 scripts/slurm/recover_multi_node.sbatch
    python -m nanotron_recover.testbed.isolated_nodes kill /var/tmp/sbed n2   # lose node n2, its slurmd too
    python -m nanotron_recover.testbed.isolated_slurm slurmd /var/tmp/sbed n2 # n2 started again, its slurmd back
    python -m nanotron_recover.testbed.isolated_slurm down /var/tmp/sbed
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from nanotron_recover.testbed import isolated_nodes as iso

CLUSTER = Path(__file__).resolve().parents[3] / "scripts" / "slurm" / "cluster.sh"
SLURM_DIR = "slurm"  # the cluster's scratch folder, inside the bed's folder


def _cluster_env(bed: iso.Bed) -> dict[str, str]:
    inside = f"{shlex.quote(sys.executable)} -m nanotron_recover.testbed.isolated_nodes exec {shlex.quote(bed.folder)}"
    return {**os.environ, "CLUSTER_NODES": str(len(bed.nodes)), "CLUSTER_NODE_PREFIX": f"{iso.SUBNET}.{bed.bed_id}.",
            "CLUSTER_CTLD_ADDR": f"{iso.SUBNET}.{bed.bed_id}.{iso.HOST_OCTET}", "CLUSTER_SLURMD_IN": inside,
            "PYTHON": sys.executable}


def scratch(bed: iso.Bed) -> Path:
    return Path(bed.folder) / SLURM_DIR


def slurm_env(bed: iso.Bed) -> dict[str, str]:
    """What a client (``sbatch``, ``squeue``) needs: ``SLURM_CONF``."""
    return {"SLURM_CONF": str(scratch(bed) / "slurm.conf")}


def mpirun_args(bed: iso.Bed) -> str:
    """``mpirun`` options for a job on the bed: TCP over the bridge for daemons and ranks, ranks yield."""
    return (f"--mca btl tcp,self --mca btl_tcp_if_include {bed.subnet} --prtemca prte_if_include {bed.subnet} "
            "--mca mpi_yield_when_idle 1")


def up(folder: Path, nodes: int, slots: int, timeout_s: float = 120.0, slurmd_timeout_s: int = 120) -> iso.Bed:
    """The isolated nodes, then the cluster on them (every node idle). ``slurmd_timeout_s``: how long a node whose
    slurmd is gone stays in its jobs' allocations. On any failure everything is torn down again."""
    bed = iso.up(Path(folder), [slots] * nodes)
    try:
        Path(bed.folder).chmod(0o755)  # munged runs as its own user and must walk into the cluster's folder
        env = {**_cluster_env(bed), "CLUSTER_SLURMD_TIMEOUT": str(slurmd_timeout_s)}
        subprocess.run(["bash", str(CLUSTER), "up", str(scratch(bed))], env=env, check=True, timeout=timeout_s)
    except BaseException:
        down(folder)
        raise
    return bed


def start_slurmd(bed: iso.Bed, node: str) -> None:
    """Start node ``node``'s slurmd again (after the node was started again: a machine back from repair)."""
    env = {**_cluster_env(bed), **slurm_env(bed)}
    iso.in_node(bed, node, ["slurmd", "-f", env["SLURM_CONF"], "-N", node], env=env, check=True, timeout=60)


def down(folder: Path) -> None:
    """slurmctld and munged (by their pid files), then the nodes with every slurmd and job step in them."""
    bed = iso.load(Path(folder))
    if bed is None:
        return
    if (scratch(bed) / "slurm.conf").is_file():
        subprocess.run(["bash", str(CLUSTER), "down", str(scratch(bed))], env=_cluster_env(bed), timeout=60)
    iso.down(Path(folder))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanotron_recover.testbed.isolated_slurm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("up", help="start the nodes and the cluster; print the exports for sbatch")
    start.add_argument("folder", type=Path)
    start.add_argument("--nodes", type=int, default=2)
    start.add_argument("--slots", type=int, default=2)
    sub.add_parser("down", help="tear everything down").add_argument("folder", type=Path)
    again = sub.add_parser("slurmd", help="start a node's slurmd again")
    again.add_argument("folder", type=Path)
    again.add_argument("node")
    args = parser.parse_args(argv)
    if args.command == "up":
        bed = up(args.folder, args.nodes, args.slots)
        for key, value in {**slurm_env(bed), "MPIRUN_ARGS": mpirun_args(bed)}.items():
            print(f"export {key}={shlex.quote(value)}")
        return 0
    if args.command == "down":
        down(args.folder)
        return 0
    bed = iso.load(args.folder)
    if bed is None:
        print(f"isolated_slurm: no bed in {args.folder}", file=sys.stderr)
        return 1
    start_slurmd(bed, args.node)
    return 0


if __name__ == "__main__":
    sys.exit(main())
