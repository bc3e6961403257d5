"""What the launcher (or a test bed's node) tells each rank of a launch: one frozen record.

The launcher writes it into the ranks' environment (``mpirun -x NAME=value``, :meth:`LaunchContract.as_env`); each
rank reads it once, at its entry point (:meth:`LaunchContract.read`, in ``train.py``), and hands down the fields
that a part needs. No other module reads these variables: a reader of the code finds here everything that crosses
from the launcher to the ranks, besides the command line (the config file and its overrides). What the ranks tell
the launcher goes the other way, through the run folder (:mod:`nanotron_recover.run.run_folder`).

The launcher's decisions about the job's shape (when to relaunch, at which width, a regrow) reach the ranks only
through the graceful stop (a signal): nothing in here changes while a launch runs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Mapping

TOKEN_ENV = "NANOTRON_RECOVER_LAUNCH_TOKEN"
STANDBY_ENV = "NANOTRON_RECOVER_STANDBY"
LAUNCHER_PID_ENV = "NANOTRON_RECOVER_LAUNCHER_PID"
LAUNCHER_NODE_ENV = "NANOTRON_RECOVER_LAUNCHER_NODE"
NODE_NAME_ENV = "NANOTRON_RECOVER_NODE_NAME"
HOST_ENV = "NANOTRON_RECOVER_HOST"
SNAPSHOT_STALE_ENV = "NANOTRON_RECOVER_SNAPSHOT_STALE_S"
_ENV = {"token": TOKEN_ENV, "standby_folder": STANDBY_ENV, "launcher_pid": LAUNCHER_PID_ENV,
        "launcher_node": LAUNCHER_NODE_ENV, "node_name": NODE_NAME_ENV, "host": HOST_ENV,
        "snapshot_stale_s": SNAPSHOT_STALE_ENV}


@dataclass(frozen=True)
class LaunchContract:
    """Each field's variable is in ``_ENV``; None: not said (the default applies)."""

    token: str = "0"  # one per launch: the names its writers use; every line a rank writes names it
    standby_folder: Path | None = None  # a warm standby's folder: the rank waits there before MPI_Init until released
    launcher_pid: int | None = None  # the launcher a standby must not outlive
    launcher_node: str | None = None  # the node (host name) it runs on: its pid means something only there
    node_name: str | None = None  # this node's name for its snapshot folder (a test bed's nodes share one host)
    host: str | None = None  # the address this rank's replica rendezvous on (a test bed's node)
    snapshot_stale_s: float | None = None  # a user's snapshot folders of other runs untouched this long are removed

    def as_env(self) -> dict[str, str]:
        """The variables that say it (the fields that are set)."""
        return {_ENV[f.name]: str(value) for f in fields(self) if (value := getattr(self, f.name)) is not None}

    @classmethod
    def read(cls, environ: Mapping[str, str]) -> LaunchContract:
        """The contract an environment carries (the entry point passes ``os.environ``); a malformed number is
        not said."""
        said = {name: environ.get(var) or None for name, var in _ENV.items()}
        return cls(token=said["token"] or "0",
                   standby_folder=Path(said["standby_folder"]) if said["standby_folder"] else None,
                   launcher_pid=_number(said["launcher_pid"], int), launcher_node=said["launcher_node"],
                   node_name=said["node_name"], host=said["host"],
                   snapshot_stale_s=_number(said["snapshot_stale_s"], float))


def _number(text: str | None, kind: type) -> int | float | None:
    try:
        return kind(text) if text is not None else None
    except ValueError:
        return None
