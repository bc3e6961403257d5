"""What the launcher tells the ranks of a job about relaunching it in place (environment variables, set per launch).

The ranks decide a regrow from them (:mod:`nanotron_recover.recovery.regrow`): it needs a relaunch in place left,
and weighs what one costs. Where the warm standby starts only once a replica is lost (``fault_tolerance.standby:
after_loss``), the launcher also names a file it creates when that standby is ready; the ranks wait for it before
they stop to regrow, so that the relaunch is warm. A job relaunched on fewer nodes than its allocation's (a node
did not answer) learns its full width, and the file the launcher creates when a missing node answers again: then
coming back to full width can pay.
"""

from __future__ import annotations

import os

IN_PLACE_ENV = "NANOTRON_RECOVER_IN_PLACE_RESTARTS"  # relaunches in place the launcher has left after this job
RELAUNCH_S_ENV = "NANOTRON_RECOVER_RELAUNCH_S"  # what the launcher expects one to cost, in seconds
STANDBY_READY_ENV = "NANOTRON_RECOVER_STANDBY_READY"  # the file that says the standby after a loss is ready
FULL_REPLICAS_ENV = "NANOTRON_RECOVER_FULL_REPLICAS"  # a job run narrower than its allocation: its full width
NODES_BACK_ENV = "NANOTRON_RECOVER_NODES_BACK"  # the file that says a missing node answers again


def standby_follows_loss() -> bool:
    """The launcher starts a standby when a replica of this job is lost (and says when it is ready)."""
    return bool(os.environ.get(STANDBY_READY_ENV))


def _launcher_said(env: str) -> bool:
    """The file the launcher names in ``env`` exists (this rank's view; the step's sums make it every rank's)."""
    path = os.environ.get(env)
    return bool(path) and os.path.exists(path)


def standby_ready() -> bool:
    """That standby is ready now."""
    return _launcher_said(STANDBY_READY_ENV)


def full_replicas() -> int | None:
    """The job's full width when the launcher ran this launch narrower (a node did not answer), else None."""
    value = os.environ.get(FULL_REPLICAS_ENV, "")
    return int(value) if value.isdigit() else None


def nodes_back() -> bool:
    """A node this launch left out answers again."""
    return _launcher_said(NODES_BACK_ENV)
