"""The shared-host bed (``nanotron_recover.testbed.fake_nodes``): its ssh stand-in runs a node's command here and
losing a node ends its whole process tree (a real process tree, a real SIGKILL). The multi-node tests run on isolated
nodes; this bed stays for the benchmarks that need no root (docs/operations.md)."""

from __future__ import annotations

import subprocess
import time

from nanotron_recover.testbed.fake_nodes import kill_node, node_pids, write_bed
from nanotron_recover.testbed.fake_nodes import main as fake_nodes_main


def test_the_fake_ssh_agent_runs_a_node_here_and_kill_node_ends_its_whole_tree(tmp_path, capsys):
    assert fake_nodes_main(["up", str(tmp_path), "--nodes", "2", "--slots", "3"]) == 0
    exports = capsys.readouterr().out
    assert f"NANOTRON_RECOVER_HOSTFILE={tmp_path / 'hostfile'}" in exports and "plm_ssh_agent" in exports
    assert (tmp_path / "hostfile").read_text() == "n1 slots=3\nn2 slots=3\n"
    env = write_bed(tmp_path, [3, 3])
    agent = env["NANOTRON_RECOVER_MPIRUN_ARGS"].split()[2]
    # as prterun calls ssh: options, the host, then the command
    node = subprocess.Popen([agent, "-o", "BatchMode=yes", "-p", "22", "-x", "n2", "sleep 60 & sleep 60; wait"])
    try:
        deadline = time.monotonic() + 20
        while len(node_pids(tmp_path, "n2")) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = node_pids(tmp_path, "n2")
        assert len(pids) == 3 and node.pid in pids, pids  # the shell and its two children
        assert sorted(kill_node(tmp_path, "n2")) == sorted(pids)  # no prted here: the whole tree
        assert node.wait(timeout=20) == -9
        assert node_pids(tmp_path, "n2") == []
        assert fake_nodes_main(["kill", str(tmp_path), "n2"]) == 1  # nothing left to kill
    finally:
        if node.poll() is None:
            node.kill()
            node.wait(timeout=20)
