"""Several ISOLATED Open MPI nodes on one machine: each its own mount, pid, UTS, IPC and network namespace (a test
bed; needs root).

The fake-node bed (:mod:`.fake_nodes`) gives every node its own ``prted`` but one shared ``/tmp``, ``/dev/shm``,
hostname, pid space and loopback network, so a product bug that leans on any of them stays hidden there. Here every
node is a long-lived "node init" (``unshare --fork --pid ...``, pid 1 of its namespace) with:

* its own hostname (``n1``, ``n2``, ...) and an ``/etc/hosts`` naming every node (the bed's file, bind-mounted);
* a private ``/tmp`` and ``/dev/shm`` (tmpfs in its mount namespace: PMIx rendezvous files, node-local snapshots);
* its own address ``10.213.<id>.<N>/24`` on a host bridge ``nrbr<id>`` (one veth pair per node) and its own ``lo``.

The rest of the host's file system is seen by every node at the same path, like a cluster's shared file system:
the bed folder and its ``shared/`` (run folders, checkpoints), the repository and the venv. Where one of those lies
under ``/tmp`` or ``/dev/shm`` (pytest's ``tmp_path``), it is bind-mounted back over the node's private tmpfs, so
the shared folder may live anywhere; nothing else of the host's ``/tmp`` is seen inside.

Open MPI reaches a node the way it reaches a real one, over "ssh": ``--prtemca plm_ssh_agent`` names a script that
drops ssh's options and the host name and runs the command inside that node's namespaces (``nsenter``), so the
``prted`` of ``n2`` and its ranks live in ``n2``. Daemons and ranks talk TCP over the bridge only.

A node is lost by SIGKILLing its init: the kernel kills every process of its pid namespace, its network namespace
goes and its veth with it. A partition takes the node's veth down (silence without a closed connection)::

    eval "$(python -m nanotron_recover.testbed.isolated_nodes up /var/tmp/bed --nodes 3 --slots 2)"
    nanotron-recover train --config-file C --run-dir /var/tmp/bed/shared/run --synthetic-data
    python -m nanotron_recover.testbed.isolated_nodes ps /var/tmp/bed          # processes of each node
    python -m nanotron_recover.testbed.isolated_nodes kill /var/tmp/bed n3     # lose node n3
    python -m nanotron_recover.testbed.isolated_nodes down /var/tmp/bed        # namespaces, veths, bridge: gone

Standard library only (and the launcher's light module); Linux, root, ``unshare``/``nsenter`` (util-linux) and
``ip`` (iproute2).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

from nanotron_recover.launcher.launch import HOSTFILE_ENV, MPIRUN_ARGS_ENV
from nanotron_recover.run.procfs import proc_stat, process_is_gone
from nanotron_recover.testbed.fake_nodes import SSH_ARGS, node_names, write_bed
from nanotron_recover.testbed.fake_nodes import kill_processes as stop_and_kill

STATE = "bed.json"
SUBNET = "10.213"  # 10.213.<bed id>.0/24; the host's side of the bridge is .254
HOST_OCTET = 254
MAX_BEDS = 250
PRIVATE = ("/tmp", "/dev/shm")  # tmpfs of each node's own
STAGE = "/mnt"  # where a node parks the paths it binds back while its /tmp is replaced (its own mount namespace)
TOOLS = ("unshare", "nsenter", "ip", "mount", "hostname")

AGENT = """#!/usr/bin/env bash
# a stand-in for ssh into an isolated node (nanotron_recover.testbed.isolated_nodes): drop ssh's options and the
# host name, run the command inside that node's namespaces
""" + SSH_ARGS + """read -r pid ns veth < "$(dirname "$0")/$host.init" 2>/dev/null
if [[ -z "$pid" || "$(readlink "/proc/$pid/ns/pid" 2>/dev/null)" != "$ns" ]]; then
  echo "ssh: connect to host $host: No route to host (isolated node not running)" >&2
  exit 255
fi
if (( ! ($(cat "/sys/class/net/$veth/flags" 2>/dev/null || echo 0) & 1) )); then
  # partitioned (its link down): a connection attempt hears nothing until ssh's ConnectTimeout
  sleep "${NANOTRON_RECOVER_BED_SSH_CONNECT_S:-{connect_s}}"
  echo "ssh: connect to host $host port 22: Connection timed out (isolated node partitioned)" >&2
  exit 255
fi
nsenter -t "$pid" -m -u -i -n -p -- bash -c 'cd "$0" 2>/dev/null || cd /; exec bash -c "$1"' "$PWD" "$*"
rc=$?
if [[ "$(readlink "/proc/$pid/ns/pid" 2>/dev/null)" != "$ns" ]]; then
  # the node is gone, not just the command: ssh to a machine that vanished hears nothing until its keepalive
  # gives up, then exits 255; Open MPI notices the lost daemon by its own connection first
  sleep "${NANOTRON_RECOVER_BED_SSH_GIVES_UP_S:-{dead_s}}" &
  wait $!
  exit 255
fi
exit $rc
"""

# ssh's ServerAliveInterval x ServerAliveCountMax, a typical cluster's; NANOTRON_RECOVER_BED_SSH_GIVES_UP_S=0: an
# ssh that ends as soon as its node is gone (Open MPI then says a daemon "failed to report back")
AGENT = AGENT.replace("{dead_s}", "30").replace("{connect_s}", "10")  # ConnectTimeout: a typical 10 s

# The node's pid 1: reaps what is orphaned into it (daemons started by nsenter whose parent ended) and never ends
# by itself; SIGKILL from the host ends it and so the whole node.
INIT = """import os, time
while True:
    try:
        os.wait()
    except ChildProcessError:
        time.sleep(0.5)
"""

# Run by unshare inside the new namespaces: the hostname, the private tmpfs, the paths bound back, the hosts file.
SETUP = """set -eu
node=$1 hosts=$2 ready=$3 python=$4; shift 4
hostname "$node"
mount --make-rprivate /
mount -t tmpfs nr-stage {stage}
i=0; for p in "$@"; do mkdir -p "{stage}/$i"; mount --rbind "$p" "{stage}/$i"; i=$((i + 1)); done
mount -t tmpfs -o mode=1777 nr-tmp /tmp
mount -t tmpfs -o mode=1777 nr-shm /dev/shm
i=0; for p in "$@"; do mkdir -p "$p"; mount --rbind "{stage}/$i" "$p"; i=$((i + 1)); done
umount -l {stage}
mount --bind "$hosts" /etc/hosts
echo ok > "$ready"
exec "$python" -I -S -c "$INIT"
""".format(stage=STAGE)


@dataclass
class Node:
    name: str
    ip: str
    veth: str
    init: int = 0  # host pid of the node's pid 1
    pidns: str = ""  # its pid namespace ("pid:[inode]"): tells a live init from a reused pid
    unshare: int = 0


@dataclass
class Bed:
    folder: str
    bed_id: int
    bridge: str
    shared: str
    slots: list[int]
    keep: list[str] = field(default_factory=list)
    nodes: dict[str, Node] = field(default_factory=dict)

    @property
    def subnet(self) -> str:
        return f"{SUBNET}.{self.bed_id}.0/24"


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, check=check)


def missing_tools() -> list[str]:
    """The commands this bed needs that are not installed (util-linux, iproute2)."""
    return [t for t in TOOLS if shutil.which(t) is None]


def unavailable_reason() -> str | None:
    """Why this machine cannot host the bed (not root, a tool missing, namespaces refused); None when it can."""
    if os.geteuid() != 0:
        return "isolated nodes need root (namespaces, bridge, veth)"
    if missing_tools():
        return f"missing tools: {' '.join(missing_tools())} (scripts/ci_install_testbed.sh)"
    probe = _run("unshare", "--mount", "--pid", "--uts", "--ipc", "--net", "--fork", "--mount-proc", "true",
                 check=False)
    if probe.returncode != 0:
        return f"unshare of mount/pid/uts/ipc/net namespaces failed: {probe.stderr.strip()}"
    return None


def load(folder: Path) -> Bed | None:
    """The bed recorded in ``folder`` (None when there is none)."""
    path = Path(folder) / STATE
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    raw["nodes"] = {k: Node(**v) for k, v in raw["nodes"].items()}
    return Bed(**raw)


def save(bed: Bed) -> None:
    path = Path(bed.folder) / STATE
    path.with_suffix(".tmp").write_text(json.dumps(asdict(bed), indent=1))
    path.with_suffix(".tmp").replace(path)


def _claim_bridge() -> tuple[int, str]:
    """Create a bridge no other bed holds: the first ``nrbr<id>`` that ``ip link add`` accepts (so two beds started
    at once never share one)."""
    for bed_id in range(1, MAX_BEDS + 1):
        bridge = f"nrbr{bed_id}"
        if _run("ip", "link", "add", bridge, "type", "bridge", check=False).returncode == 0:
            # a MAC of its own: a bridge without one takes its lowest port's, and a lost node's veth taking it away
            # changed the host's address under the other nodes' ARP caches (their SYNs to mpirun dropped for up
            # to a minute: a relaunch after a node loss started 70 s late)
            _run("ip", "link", "set", bridge, "address", "02:00:0a:d5:%02x:fe" % bed_id)
            _run("ip", "addr", "add", f"{SUBNET}.{bed_id}.{HOST_OCTET}/24", "dev", bridge)
            _run("ip", "link", "set", bridge, "up")
            return bed_id, bridge
    raise RuntimeError(f"no free bridge name nrbr1..nrbr{MAX_BEDS}")


def paths_to_keep(paths: Sequence[str | Path]) -> list[str]:
    """Of ``paths``, those a node's private tmpfs would hide (under /tmp or /dev/shm), outermost only: each node
    binds them back so that they stay shared."""
    resolved = sorted({os.path.realpath(p) for p in paths})
    hidden = [p for p in resolved if any(p == d or p.startswith(d + "/") for d in PRIVATE)]
    return [p for p in hidden if not any(p.startswith(q + "/") for q in hidden if q != p)]


def _seen_by_nodes(folder: Path, shared: Path) -> list[str]:
    """What every node must see at the host's path: the bed, the shared folder, this Python, this repository."""
    here = Path(__file__).resolve()
    code = here.parents[3] if (here.parents[3] / "pyproject.toml").is_file() else here.parents[1]  # repo or package
    python = os.path.dirname(os.path.realpath(sys.executable))
    return [str(folder), str(shared), sys.prefix, sys.base_prefix, python, str(code)]


def up(folder: Path, slots_per_node: Sequence[int], shared: Path | None = None, timeout_s: float = 20.0) -> Bed:
    """Start the bed: the bridge, one isolated node per entry of ``slots_per_node``, the hostfile and the agent.
    On any failure what was started is torn down again."""
    reason = unavailable_reason()
    if reason:
        raise RuntimeError(reason)
    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    down(folder)
    shared = Path(shared).resolve() if shared else folder / "shared"
    shared.mkdir(parents=True, exist_ok=True)
    bed_id, bridge = _claim_bridge()
    names = node_names(len(slots_per_node))
    bed = Bed(str(folder), bed_id, bridge, str(shared), list(slots_per_node),
              paths_to_keep(_seen_by_nodes(folder, shared)),
              {n: Node(n, f"{SUBNET}.{bed_id}.{i + 1}", f"nr{bed_id}n{i + 1}") for i, n in enumerate(names)})
    save(bed)  # from here on, down() finds whatever was started
    try:
        _write_hosts(bed)
        for node in bed.nodes.values():
            start_node(bed, node.name, timeout_s)
        _write_launch_files(bed)
    except BaseException:
        down(folder)
        raise
    return bed


def _write_hosts(bed: Bed) -> None:
    lines = ["127.0.0.1 localhost", f"{SUBNET}.{bed.bed_id}.{HOST_OCTET} nr-host"]
    lines += [f"{n.ip} {n.name}" for n in bed.nodes.values()]
    (Path(bed.folder) / "hosts").write_text("\n".join(lines) + "\n")


def start_node(bed: Bed, name: str, timeout_s: float = 20.0) -> Node:
    """Start (or start again, as a replaced machine: empty /tmp and /dev/shm) node ``name``: its namespaces, its
    init, its veth on the bed's bridge."""
    node, folder = bed.nodes[name], Path(bed.folder)
    if node_alive(node):
        raise RuntimeError(f"node {name} is running already (init {node.init})")
    ready = folder / f"{name}.ready"
    ready.unlink(missing_ok=True)
    log = open(folder / f"{name}.log", "ab")
    cmd = ["unshare", "--mount", "--pid", "--uts", "--ipc", "--net", "--fork", "--mount-proc", "--propagation",
           "private", "bash", "-c", SETUP, "setup", name, str(folder / "hosts"), str(ready), sys.executable,
           *bed.keep]
    with log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                                env={**os.environ, "INIT": INIT})
    _wait_ready(proc, ready, folder / f"{name}.log", timeout_s)
    node.unshare, node.init = proc.pid, _only_child(proc.pid)
    node.pidns = os.readlink(f"/proc/{node.init}/ns/pid")
    save(bed)
    _plug(bed, node)
    (folder / f"{name}.init").write_text(f"{node.init} {node.pidns} {node.veth}\n")
    return node


def _wait_ready(proc: subprocess.Popen, ready: Path, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready.is_file():
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            raise RuntimeError(f"a node did not come up (rc {proc.poll()}): {log.read_text()[-2000:]}")
        time.sleep(0.02)


def _only_child(pid: int) -> int:
    """The one child of ``pid`` (unshare --fork's child: the node's pid 1)."""
    for _ in range(200):
        kids = [int(e) for e in os.listdir("/proc") if e.isdigit() and (proc_stat(int(e)) or (0,))[0] == pid]
        if len(kids) == 1:
            return kids[0]
        time.sleep(0.01)
    raise RuntimeError(f"unshare {pid} has no single child")


def _plug(bed: Bed, node: Node) -> None:
    """The node's veth pair: ``eth0`` inside with its address, the host's end on the bridge; ``lo`` up."""
    _run("ip", "link", "del", node.veth, check=False)  # a lost node's end, when its namespace is not gone yet
    # a fixed MAC per node, as a rebooted machine keeps its NIC's: with a new one each start, the others' ARP caches
    # sent a restarted node's packets to the lost one's address for up to a minute (seen: a relaunch's start-up 70 s)
    mac = "02:00:0a:d5:%02x:%02x" % (bed.bed_id, int(node.name.lstrip("n")))
    _run("ip", "link", "add", node.veth, "type", "veth", "peer", "name", "eth0", "address", mac, "netns",
         str(node.init))
    _run("ip", "link", "set", node.veth, "master", bed.bridge, "up")
    inside = ["nsenter", "-t", str(node.init), "-n", "ip"]
    _run(*inside, "addr", "add", f"{node.ip}/24", "dev", "eth0")
    _run(*inside, "link", "set", "eth0", "up")
    _run(*inside, "link", "set", "lo", "up")


def _write_launch_files(bed: Bed) -> dict[str, str]:
    """The hostfile and the mpirun options (fake_nodes' own: TCP between ranks, ranks yield), with the ssh agent
    replaced by this bed's and every daemon and rank held to the bridge's subnet."""
    folder = Path(bed.folder)
    env = write_bed(folder, bed.slots)
    (folder / "fake_ssh.sh").unlink(missing_ok=True)
    agent = folder / "node_ssh.sh"
    agent.write_text(AGENT)
    agent.chmod(0o755)
    args = shlex.split(env[MPIRUN_ARGS_ENV])
    args[args.index("plm_ssh_agent") + 1] = str(agent)
    args += ["--prtemca", "prte_if_include", bed.subnet, "--mca", "btl_tcp_if_include", bed.subnet]
    env[MPIRUN_ARGS_ENV] = shlex.join(args)
    (folder / "env.json").write_text(json.dumps(env))
    return env


def launch_env(folder: Path, nodes: Sequence[str] | None = None) -> dict[str, str]:
    """``NANOTRON_RECOVER_HOSTFILE`` and ``NANOTRON_RECOVER_MPIRUN_ARGS`` for a launch on the bed in ``folder``;
    ``nodes``: on those nodes only (a hostfile of their own, as a job given fewer nodes has)."""
    env = json.loads((Path(folder) / "env.json").read_text())
    if nodes is not None:
        bed = load(folder)
        if bed is None or not set(nodes) <= set(bed.nodes):
            raise KeyError(f"nodes {list(nodes)} are not all of the bed in {folder}")
        slots = dict(zip(bed.nodes, bed.slots))
        hostfile = Path(folder) / f"hostfile-{'-'.join(nodes)}"
        hostfile.write_text("".join(f"{name} slots={slots[name]}\n" for name in nodes))
        env[HOSTFILE_ENV] = str(hostfile)
    return env


def node_path(bed: Bed, name: str, path: str | Path) -> Path:
    """``path`` as node ``name`` sees it, read from the host (through its init's root: its private /tmp and
    /dev/shm included). Gone with the node."""
    return Path(f"/proc/{bed.nodes[name].init}/root") / Path(path).relative_to("/")


def node_alive(node: Node) -> bool:
    """The node's init still runs (the same pid namespace: a reused pid is not the node)."""
    if not node.init or process_is_gone(node.init):
        return False
    try:
        return os.readlink(f"/proc/{node.init}/ns/pid") == node.pidns
    except OSError:
        return False


def node_pids(node: Node) -> list[int]:
    """Host pids of every live process in the node's pid namespace (its init included)."""
    if not node.pidns:
        return []
    out = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.readlink(f"/proc/{entry}/ns/pid") == node.pidns:
                out.append(int(entry))
        except OSError:
            continue
    return sorted(p for p in out if not process_is_gone(p))


def node_ranks(node: Node) -> list[int]:
    """The MPI world ranks running in the node now (``OMPI_COMM_WORLD_RANK`` of its processes)."""
    ranks = set()
    for pid in node_pids(node):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        found = [e.split(b"=", 1)[1] for e in env if e.startswith(b"OMPI_COMM_WORLD_RANK=")]
        if found and found[0].isdigit():
            ranks.add(int(found[0]))
    return sorted(ranks)  # a rank's forked helpers inherit its environment


def in_node(bed: Bed, name: str, command: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
    """Run ``command`` inside node ``name`` (all its namespaces), wait for it; ``kwargs`` go to subprocess.run."""
    node = bed.nodes[name]
    if not node_alive(node):
        raise ProcessLookupError(f"node {name} is not running")
    cmd = ["nsenter", "-t", str(node.init), "-m", "-u", "-i", "-n", "-p", "--", *command]
    return subprocess.run(cmd, **{"capture_output": True, "text": True, **kwargs})


def kill_node(bed: Bed, name: str, timeout_s: float = 10.0) -> list[int]:
    """Lose node ``name``: SIGKILL its init (the kernel kills every process of its pid namespace at once); wait until
    none is left. Returns the host pids that were alive. Raises when the node is not running."""
    node = bed.nodes[name]
    if not node_alive(node):
        raise ProcessLookupError(f"node {name} of {bed.folder} is not running")
    pids = node_pids(node)
    os.kill(node.init, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while node_pids(node) or not process_is_gone(node.unshare):
        if time.monotonic() > deadline:
            raise TimeoutError(f"processes of node {name} still alive {timeout_s} s after SIGKILL: {node_pids(node)}")
        time.sleep(0.01)
    _reap(node.unshare)
    return pids


def kill_processes(bed: Bed, name: str, timeout_s: float = 10.0) -> list[int]:
    """SIGKILL every process of node ``name`` but its init: what ran there dies (a crashed daemon, an OOM kill), the
    node and its memory (/tmp, /dev/shm) stay. Returns the host pids killed."""
    node = bed.nodes[name]
    if not node_alive(node):
        raise ProcessLookupError(f"node {name} of {bed.folder} is not running")
    return stop_and_kill([p for p in node_pids(node) if p != node.init], timeout_s, what=f"node {name}")


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass  # not ours (started by another process, e.g. the CLI's up)


def partition(bed: Bed, name: str, connected: bool = False) -> None:
    """Cut node ``name`` off the bridge (its veth down: packets vanish, no connection is closed); ``connected``:
    heal it again."""
    _run("ip", "link", "set", bed.nodes[name].veth, "up" if connected else "down")


def down(folder: Path, timeout_s: float = 10.0) -> None:
    """Tear the bed in ``folder`` down: every node (its processes die with its init), every veth, the bridge. Safe to
    call again, or on a half-started bed."""
    bed = load(folder)
    if bed is None:
        return
    for node in bed.nodes.values():
        if node_alive(node):
            kill_node(bed, node.name, timeout_s)
        _run("ip", "link", "del", node.veth, check=False)  # gone with its namespace, or never plugged
        (Path(folder) / f"{node.name}.init").unlink(missing_ok=True)
    _run("ip", "link", "del", bed.bridge, check=False)
    for ready in Path(folder).glob("n*.ready"):
        ready.unlink()
    (Path(folder) / STATE).unlink()


def link_exists(name: str) -> bool:
    return _run("ip", "link", "show", name, check=False).returncode == 0


def _comm(pid: int) -> str:
    stat = proc_stat(pid)
    return stat[1] if stat else "?"


def describe(bed: Bed) -> list[str]:
    """One line per node: its state, address, link and processes (host pid:name)."""
    lines = []
    for node in bed.nodes.values():
        state = "up" if node_alive(node) else "lost"
        link = _run("ip", "-br", "link", "show", node.veth, check=False).stdout.split()
        pids = " ".join(f"{p}:{_comm(p)}" for p in node_pids(node)) or "(none)"
        link_state = link[1] if len(link) > 1 else "gone"
        lines.append(f"{node.name} {state} {node.ip} link {link_state} ranks {node_ranks(node)} pids {pids}")
    return lines


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m nanotron_recover.testbed.isolated_nodes", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("up", help="start the nodes; print the exports for the launcher")
    start.add_argument("folder", type=Path)
    start.add_argument("--nodes", type=int, required=True)
    start.add_argument("--slots", type=int, required=True, help="slots (ranks) per node")
    start.add_argument("--shared", type=Path, help="the folder every node sees (default: FOLDER/shared)")
    for name, text in [("ps", "each node's state and processes"), ("down", "tear everything down")]:
        sub.add_parser(name, help=text).add_argument("folder", type=Path)
    for name, text in [("kill", "lose a node: SIGKILL every process in it"), ("partition", "take its link down"),
                       ("heal", "bring its link up again"), ("restart", "start a lost node again, empty"),
                       ("exec", "run a command inside a node (a daemon it starts stays there: e.g. slurmd)")]:
        one = sub.add_parser(name, help=text)
        one.add_argument("folder", type=Path)
        one.add_argument("node", help="n1, n2, ...")
        if name == "exec":
            one.add_argument("argv", nargs=argparse.REMAINDER, help="the command (after --)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "up":
        if args.nodes < 1 or args.slots < 1:
            _parser().error("--nodes and --slots must be >= 1")
        bed = up(args.folder, [args.slots] * args.nodes, args.shared)
        for key, value in launch_env(args.folder).items():
            print(f"export {key}={shlex.quote(value)}")
        print(f"# shared folder (every node): {bed.shared}")
        return 0
    if args.command == "down":
        down(args.folder)
        return 0
    bed = load(args.folder)
    if bed is None:
        print(f"isolated_nodes: no bed in {args.folder}", file=sys.stderr)
        return 1
    try:
        if args.command == "exec":
            argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
            return in_node(bed, args.node, argv, capture_output=False).returncode
        return _act(bed, args.command, getattr(args, "node", ""))
    except (ProcessLookupError, TimeoutError, RuntimeError, KeyError) as e:
        print(f"isolated_nodes: {e}", file=sys.stderr)
        return 1


def _act(bed: Bed, command: str, node: str) -> int:
    if command == "ps":
        print("\n".join(describe(bed)))
    elif command == "kill":
        pids = kill_node(bed, node)
        print(f"{node}: SIGKILLed its init; {len(pids)} processes gone: {' '.join(map(str, pids))}")
    elif command in ("partition", "heal"):
        partition(bed, node, connected=command == "heal")
    elif command == "restart":
        start_node(bed, node)
    return 0


if __name__ == "__main__":
    sys.exit(main())
