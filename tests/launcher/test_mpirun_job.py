"""The launcher's ``mpirun`` child: whether its runtime tore the job down after losing a node's daemon.

The launcher tells the runtime's teardown (relaunch in place) from a scheduler's stop (exit 3 for the scheduler) by
the words the runtime printed. A child process prints them here (the runtime's own wording, from job logs of the
isolated-node beds); the rest of the path runs on those beds (tests/testbed, tests/slurm).
"""

from __future__ import annotations

import sys

import pytest

from nanotron_recover.launcher.mpirun_job import MpirunJob

PRRTE_WORDS = {
    "its daemon went silent": "PRTE has lost communication with a remote daemon.\n  HNP daemon : [prterun-n1-1@0,0]",
    "its ssh ended at once": "A daemon failed to report back after being spawned.\nRemote host: n2",
    # Slurm: the job step that ran the node's daemon ended (seen in a suite run: the job then taken for stopped)
    "its Slurm job step ended": "srun returned non-zero exit status (35072) from launching\nthe per-node daemon. "
                                "You may debug this problem further",
}


def _job_printing(text: str) -> MpirunJob:
    job = MpirunJob([sys.executable, "-c", f"import sys; sys.stderr.write({text!r})"], graceful=True)
    assert job.wait(None, finalize_timeout_s=10.0) == 0
    return job


@pytest.mark.parametrize("how", sorted(PRRTE_WORDS))
def test_a_lost_daemon_is_told_by_the_runtimes_words(how, capfd):
    assert _job_printing(PRRTE_WORDS[how]).lost_a_daemon()


def test_a_job_that_ended_otherwise_lost_no_daemon(capfd):
    assert not _job_printing("[nanotron-recover] rank 0: SIGUSR1: the job stops after this step\n").lost_a_daemon()
