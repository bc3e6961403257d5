"""The nodes of a hostfile launch (Open MPI over ssh, no Slurm): which of them answer.

Without Slurm, ``mpirun`` reaches each node of ``NANOTRON_RECOVER_HOSTFILE`` over ssh (or the agent that
``plm_ssh_agent`` names) and starts its daemon there. A node that is lost, or cut off from the network, makes every
later launch fail at that daemon's start: ssh waits for its connect timeout, ``mpirun`` says a daemon did not report
back, and the launcher's restarts are spent on a node that is not there. So before each relaunch the launcher asks
every node with the same agent (``AGENT NODE true``, all at once, each bounded by the probe timeout) and relaunches
on those that answer at the width that fits them, the global batch kept, as in a Slurm allocation
(:mod:`nanotron_recover.launcher.node_fit`); a node that answers again lets the job regrow. A hostfile does not
shrink: every node of it stays a candidate.
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
from dataclasses import dataclass
from typing import Mapping, Sequence

from nanotron_recover.launcher.mpirun import hostfile_slots
from nanotron_recover.launcher.slurm_nodes import PROBE_TIMEOUT_S, PROBE_TIMEOUT_S_ENV, Node, ask_nodes

AGENT_PARAMETERS = ("plm_ssh_agent", "plm_rsh_agent")
AGENT_ENV = ("PRTE_MCA_plm_ssh_agent", "OMPI_MCA_plm_rsh_agent", "PRTE_MCA_plm_rsh_agent")


def ssh_agent(mpirun_args: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    """The command ``mpirun`` reaches a node with: ``--prtemca/--mca plm_ssh_agent X`` in its arguments, else the
    environment's setting, else ``ssh``. A list of choices (``ssh : rsh``, PRRTE's own default form) gives the
    first one installed, as PRRTE picks it."""
    said = None
    for i, arg in enumerate(mpirun_args[:-2]):
        if arg in ("--prtemca", "--mca", "-mca", "--prte-mca") and mpirun_args[i + 1] in AGENT_PARAMETERS:
            said = mpirun_args[i + 2]
            break
    said = said or next((environ[name] for name in AGENT_ENV if environ.get(name)), None) or "ssh"
    choices = [shlex.split(choice) for choice in said.split(":") if choice.strip()]
    return next((c for c in choices if shutil.which(c[0])), choices[0] if choices else ["ssh"])


def short_name(host: str) -> str:
    return host.split(".")[0] if not host.replace(".", "").isdigit() else host


@dataclass
class HostfileNodes:
    """The hostfile's nodes (in its order) and how to ask one: the same questions as a Slurm allocation's."""

    nodes: list[Node]
    agent: list[str]
    batch_node: str = ""  # the launcher's own host when the hostfile names it: never asked
    probe_timeout_s: float = PROBE_TIMEOUT_S

    @classmethod
    def from_environment(cls, hostfile: str, mpirun_args: Sequence[str],
                         environ: Mapping[str, str] | None = None) -> HostfileNodes | None:
        """None when the hostfile has fewer than two nodes or a line without ``slots=``."""
        env = os.environ if environ is None else environ
        found = hostfile_slots(hostfile) if os.path.isfile(hostfile) else None
        if found is None or len(found[0]) < 2:
            return None
        here = {short_name(socket.gethostname()), "localhost"}
        batch = next((name for name in found[0] if short_name(name) in here), "")
        timeout = float(env.get(PROBE_TIMEOUT_S_ENV) or PROBE_TIMEOUT_S)
        return cls([Node(n, s) for n, s in zip(*found)], ssh_agent(mpirun_args, env), batch, timeout)

    def still_allocated(self) -> list[Node]:
        return list(self.nodes)

    def answering(self, nodes: Sequence[Node]) -> list[Node]:
        return ask_nodes(nodes, self.batch_node, self.answers)

    def answers(self, node: str) -> bool:
        """``AGENT NODE true`` within the probe timeout (ssh: without questions, its own connect timeout below it;
        ``plm_ssh_args`` such as a port or a key are not passed: a node that needs them is asked without)."""
        connect_s = max(1, int(self.probe_timeout_s) - 1)
        asks_no_questions = ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={connect_s}"] \
            if os.path.basename(self.agent[0]) == "ssh" else []  # ssh's own options; another agent gets none
        cmd = [*self.agent, *asks_no_questions, node, "true"]
        try:
            return subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  timeout=self.probe_timeout_s, start_new_session=True).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False
