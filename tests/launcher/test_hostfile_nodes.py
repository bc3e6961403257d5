"""The nodes of a hostfile launch and how they are asked (``nanotron_recover.launcher.hostfile_nodes``).

The probe runs a real agent (a script standing in for ssh, as ``mpirun``'s ``plm_ssh_agent`` would): one node
answers, one refuses at once, one never answers (a partitioned node: the probe timeout ends it). A two-node bed whose
node is really cut off is in ``tests/testbed/test_isolated_nodes.py``.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

from nanotron_recover.launcher.hostfile_nodes import HostfileNodes, ssh_agent
from nanotron_recover.launcher.node_fit import NodeFit
from nanotron_recover.launcher.slurm_nodes import Node

AGENT = """#!/usr/bin/env bash
# drops ssh's options; n1 answers, n2 refuses, n3 hears nothing
while [[ $# -gt 0 ]]; do case "$1" in -o) shift 2 ;; -*) shift ;; *) break ;; esac; done
echo "$1 $2" >> "$(dirname "$0")/asked"
case "$1" in n1) exec bash -c "$2" ;; n2) exit 255 ;; *) sleep 30 ;; esac
"""


def _agent(tmp_path: Path) -> Path:
    agent = tmp_path / "agent.sh"
    agent.write_text(AGENT)
    agent.chmod(0o755)
    return agent


def test_the_agent_is_what_mpirun_is_told_else_the_environment_else_ssh():
    assert ssh_agent(["--prtemca", "plm_ssh_agent", "/bed/a.sh -x", "--mca", "btl", "tcp"], {}) == ["/bed/a.sh", "-x"]
    assert ssh_agent(["--mca", "plm_rsh_agent", "rsh"], {"PRTE_MCA_plm_ssh_agent": "other"}) == ["rsh"]
    assert ssh_agent([], {"PRTE_MCA_plm_ssh_agent": "/opt/ssh2"}) == ["/opt/ssh2"]
    assert ssh_agent(["--mca", "btl", "tcp,self"], {}) == ["ssh"]


def test_a_list_of_agents_gives_the_first_installed_one_as_prrte_picks_it():
    assert ssh_agent([], {"PRTE_MCA_plm_ssh_agent": "no-such-agent-here : sh -x"}) == ["sh", "-x"]
    assert ssh_agent(["--prtemca", "plm_ssh_agent", "ssh : rsh"], {})[0] in ("ssh", "rsh")


def test_the_launchers_own_node_is_found_by_its_short_name_and_never_asked(tmp_path):
    here = socket.gethostname().split(".")[0]
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"{here}.cluster.example slots=2\nn2 slots=2\n")
    nodes = HostfileNodes.from_environment(str(hostfile), ["--prtemca", "plm_ssh_agent", str(_agent(tmp_path))],
                                           {"NANOTRON_RECOVER_NODE_PROBE_S": "1"})
    assert nodes is not None and nodes.batch_node == f"{here}.cluster.example"
    assert [n.name for n in nodes.answering(nodes.nodes)] == [f"{here}.cluster.example"]  # n2 refuses
    assert (tmp_path / "asked").read_text().split() == ["n2", "true"]


def test_only_ssh_is_given_ssh_options(tmp_path):
    nodes = HostfileNodes([Node("n1", 2), Node("n2", 2)], [str(_agent(tmp_path))], probe_timeout_s=2)
    assert nodes.answers("n1")
    assert (tmp_path / "asked").read_text() == "n1 true\n"
    fake_ssh = tmp_path / "bin" / "ssh"
    fake_ssh.parent.mkdir()
    fake_ssh.write_text('#!/usr/bin/env bash\necho "$@" > "$(dirname "$0")/args"\n')
    fake_ssh.chmod(0o755)
    assert HostfileNodes([Node("n1", 2)], [str(fake_ssh)], probe_timeout_s=3).answers("n1")
    assert (fake_ssh.parent / "args").read_text().split() == ["-o", "BatchMode=yes", "-o", "ConnectTimeout=2",
                                                              "n1", "true"]


def test_a_hostfile_of_one_node_or_without_slots_has_no_nodes_to_fit(tmp_path):
    one = tmp_path / "one"
    one.write_text("n1 slots=4\n")
    assert HostfileNodes.from_environment(str(one), [], {}) is None
    bare = tmp_path / "bare"
    bare.write_text("n1 slots=2\nn2\n")  # Open MPI would count n2's cores: unknown here
    assert HostfileNodes.from_environment(str(bare), [], {}) is None
    assert HostfileNodes.from_environment(str(tmp_path / "missing"), [], {}) is None


def test_each_node_is_asked_once_with_the_agent_and_a_silent_one_is_out_at_the_timeout(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("n1 slots=2\nn2 slots=2\nn3 slots=2  # a comment\n")
    nodes = HostfileNodes.from_environment(str(hostfile), ["--prtemca", "plm_ssh_agent", str(_agent(tmp_path))],
                                           {"NANOTRON_RECOVER_NODE_PROBE_S": "2"})
    assert nodes is not None and nodes.nodes == [Node("n1", 2), Node("n2", 2), Node("n3", 2)]
    assert nodes.probe_timeout_s == 2.0 and nodes.batch_node == ""
    started = time.monotonic()
    answering = nodes.answering(nodes.still_allocated())
    took = time.monotonic() - started
    assert [n.name for n in answering] == ["n1"]
    assert 2.0 <= took < 10.0, took  # asked at once, the silent one bounded by the timeout
    assert sorted((tmp_path / "asked").read_text().splitlines()) == ["n1 true", "n2 true", "n3 true"]


def test_a_relaunch_on_a_hostfile_fits_the_nodes_that_answer(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("n1 slots=2\nn2 slots=2\nn3 slots=2\n")
    nodes = HostfileNodes.from_environment(str(hostfile), ["--prtemca", "plm_ssh_agent", str(_agent(tmp_path))],
                                           {"NANOTRON_RECOVER_NODE_PROBE_S": "1"})
    said: list[str] = []
    fit = NodeFit(nodes, ranks_per_replica=2, replicas=3, spares=0, microbatches=6, min_replicas=1,
                  full_cmd=["mpirun", "full"], reshape=lambda r, hosts: ["mpirun", "--host", hosts, f"--replicas={r}"])
    assert fit.fit(said.append) == (["mpirun", "--host", "n1:2", "--replicas=1"], 1)
    assert fit.out == ("n2", "n3")
    assert "node(s) n2, n3 did not answer over ssh within 1 s" in said[0]
