"""A graceful stop, asked for by a signal: the job ends at a step boundary with nothing to compute again.

SIGTERM and SIGINT (what Slurm sends every process of a job at preemption or at its time limit, or Ctrl-C) and
SIGUSR1 (``sbatch --signal=B:USR1@SECONDS``, a warning before the time limit; the launcher also turns its own
SIGTERM into a SIGUSR1 to ``mpirun``, which forwards it to every rank) only set a flag here. The step's world-wide
sums carry how many ranks saw one (:mod:`nanotron_recover.recovery.step_sums`), so every rank learns
in the same step that this step is the last: it is committed, snapshotted node-locally (and checkpointed where
``fault_tolerance.checkpoint_on_stop`` asks), and the job exits 3. A relaunch resumes at the next step.

A second SIGTERM or SIGINT to a rank ends it at once (the default action): what is on disk stays intact, since
snapshots and checkpoints are published by a rename.
"""

from __future__ import annotations

import signal
import time
from types import FrameType
from typing import Any, Callable

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
STOP_SUMS = (("stop_requests", 1),)  # this tenant's entry of the step's sums: the ranks asked to stop
ESCALATING = (signal.SIGTERM, signal.SIGINT)  # asked twice: end now (SIGUSR1 may well come twice: Slurm, launcher)


class StopRequest:
    """This process's stop flag: the first stop signal's number and when it came."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.at: float | None = None  # time.monotonic() of the first stop signal
        self._installed = False

    def install(self) -> None:
        """Catch the stop signals (a rank of the resilient path, from its first line on)."""
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._on_signal)
        self._installed = True

    def uninstall(self) -> None:
        """Back to the default actions (the stock path ends on a signal, as stock nanotron does)."""
        if self._installed:
            for signum in STOP_SIGNALS:
                signal.signal(signum, signal.SIG_DFL)
            self._installed = False

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else "none"

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum, self.at = signum, time.monotonic()
            return
        if signum in ESCALATING and self.signum in ESCALATING:
            signal.signal(signum, signal.SIG_DFL)  # asked twice: the default action, now
            signal.raise_signal(signum)


STOP = StopRequest()  # the one of this process


class StopRequested(Exception):
    """Raised by every rank after the stop's step was committed, logged and snapshotted: the job ends with the
    restart outcome (exit 3)."""


def stop_reason(ranks: int, step: int) -> str:
    """The exit reason of a graceful stop, the same on every rank."""
    return (f"stopped on request ({ranks} rank(s) received SIGTERM, SIGINT or SIGUSR1) after committing step {step}: "
            f"a relaunch resumes at step {step + 1}")


class LauncherStop:
    """The launcher's side: a stop signal to ``nanotron-recover train`` becomes a SIGUSR1 to ``mpirun``, which
    forwards it to every rank, on every node; the job then has ``grace_s`` to stop by itself. A second SIGTERM or
    SIGINT, a SIGHUP, or the grace running out ends ``mpirun`` at once (SIGHUP: ``mpirun`` then ends the job; it
    was started with SIGTERM and SIGINT blocked, so that a signal sent to every process of the job, as Slurm does,
    leaves the ending to the ranks). ``grace_s`` None: the stock path, where every signal ends the job at once.
    ``proc``: the running ``mpirun`` (anything with ``send_signal``; :meth:`attach` the next one after an in-place
    relaunch; a stop asked for in between reaches it when attached, and no further relaunch happens:
    :attr:`requested`)."""

    def __init__(self, proc: Any, grace_s: float | None, say: Callable[[str], None]) -> None:
        self.proc, self.grace_s, self.say = proc, grace_s, say
        self.deadline: float | None = None
        self.ended = False

    @property
    def requested(self) -> bool:
        """A stop signal came: the launcher ends with the job, it does not relaunch."""
        return self.deadline is not None or self.ended

    def attach(self, proc: Any) -> None:
        self.proc = proc
        if self.ended:
            self._send(signal.SIGHUP if self.grace_s is not None else signal.SIGTERM)
        elif self.deadline is not None:
            self._send(signal.SIGUSR1)

    def install(self) -> None:
        for signum in (*STOP_SIGNALS, signal.SIGHUP):
            signal.signal(signum, self.on_signal)

    def on_signal(self, signum: int, frame: FrameType | None = None) -> None:
        name = signal.Signals(signum).name
        if self.grace_s is None or signum == signal.SIGHUP or (self.deadline is not None and signum in ESCALATING):
            self.end_now(f"{name}: ending the job now")
        elif self.deadline is None:
            self.deadline = time.monotonic() + self.grace_s
            self.say(f"{name}: the job stops after the step in flight (its node-local snapshot written, exit 3), "
                     f"within {self.grace_s:g} s; a second SIGTERM or SIGINT ends it at once")
            self._send(signal.SIGUSR1)

    def forward(self, signum: int) -> None:
        """Pass ``signum`` to the running ``mpirun`` without taking it for the launcher's own stop: the launcher's
        regrow asks the job to stop at a step boundary (SIGUSR1), and then relaunches it."""
        self._send(signum)

    def overdue(self) -> bool:
        """The grace ran out (then the job is ended: call every few seconds)."""
        if self.deadline is not None and not self.ended and time.monotonic() > self.deadline:
            self.end_now(f"the job did not stop within stop_grace_s={self.grace_s:g} s: ending it now")
            return True
        return False

    def end_now(self, why: str) -> None:
        if not self.ended:
            self.ended = True
            self.say(why)
            self._send(signal.SIGHUP if self.grace_s is not None else signal.SIGTERM)

    def _send(self, signum: int) -> None:
        if self.proc is None:  # between two launches: :meth:`attach` passes it on
            return
        try:
            self.proc.send_signal(signum)
        except (ProcessLookupError, OSError):  # mpirun is gone already
            pass


def blocked_for_mpirun(graceful: bool) -> set[int]:
    """The signals ``mpirun`` starts with blocked (inherited through fork and exec; PRRTE unblocks every signal in
    the ranks it starts): on the resilient path the ranks end the job themselves on SIGTERM and SIGINT, while
    ``mpirun`` would SIGKILL them within a second."""
    return {signal.SIGTERM, signal.SIGINT} if graceful else set()
