"""One ``mpirun`` of the launcher: started, its output passed on, waited for within bounds.

Started with SIGTERM and SIGINT blocked on the resilient path (the ranks stop by themselves, see
:mod:`nanotron_recover.process.stop_request`), optionally with a parent-death signal (a warm standby must never
outlive its launcher). Its output passes through unchanged but for Open MPI's repair noise (counted), and its
last bytes are kept (a PRRTE start-up failure is recognized in them). The wait ends a frozen or stuck ``mpirun``
within a bound (:mod:`nanotron_recover.launcher.mpirun_watch`) and a job that outlives its stop grace.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

from nanotron_recover.launcher.mpirun_watch import MpirunWatch, end_mpirun, end_outliving_ranks
from nanotron_recover.launcher.startup_watch import STARTUP_SCAN_S, StartupWatch, ranks_here
from nanotron_recover.process.stop_request import LauncherStop, blocked_for_mpirun
from nanotron_recover.run.output_filter import NoiseFilter, noise_summary

WATCH_EVERY_S = 0.1  # how often the launcher looks at a running mpirun (its regrow reads the step records)
OUTPUT_TAIL_BYTES = 16384
PR_SET_PDEATHSIG = 1
OUTLIVING_BOUND_S = 5.0  # ranks left by mpirun on the stock path (no graceful stop) are ended after this
# the runtime tearing the job down after a node's daemon was lost: which line it prints depends on which it notices
# first, the daemon's silence or the end of the process that started it (ssh exits 255 once its node is gone; seen
# on the isolated-node bed: "failed to report back" alone, and the job taken for stopped by the scheduler; under
# Slurm, the daemon's job step ended: "srun returned non-zero exit status (N) from launching the per-node daemon"
# alone, seen in a suite run on the isolated-node Slurm bed)
LOST_DAEMON = ("PRTE has lost communication with a remote daemon", "A daemon failed to report back",
               "srun returned non-zero exit status")


def _die_with_launcher() -> None:
    """In the child, before exec: SIGHUP when the launcher's thread that started it ends (mpirun then ends its
    ranks), so that a SIGKILLed launcher leaves no standby behind."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGHUP)


def _tick_guarded(on_tick: Callable[[], None]) -> bool:
    """Run the launcher's own work beside the job (starting a standby, a file in the run folder); False when it
    failed. It may fail for reasons of its own (a full ``/tmp``, a failed fork, a run folder that refuses a file):
    that must never end the watch over the job, or the job trains on with nobody to forward a stop signal or
    judge the run. Said once; not tried again during this launch."""
    try:
        on_tick()
        return True
    except Exception as e:  # noqa: BLE001 - whatever it was, the watch over mpirun goes on
        print(f"[nanotron-recover] the launcher's own work failed beside the job ({type(e).__name__}: {e}); not "
              "tried again during this launch (no warm standby for the next one): the job goes on under the "
              "launcher's watch", file=sys.stderr, flush=True)
        return False


class MpirunJob:
    """``mpirun`` as a child (not exec: its return code alone says too little, the run folder is judged)."""

    def __init__(self, cmd: Sequence[str], *, graceful: bool, pass_fds: tuple[int, ...] = (),
                 env: Mapping[str, str] | None = None, die_with_launcher: bool = False) -> None:
        self.cmd = list(cmd)
        before = signal.pthread_sigmask(signal.SIG_BLOCK, blocked_for_mpirun(graceful))
        try:  # mpirun inherits the mask; a signal to the launcher meanwhile waits for its handler
            self.proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         pass_fds=pass_fds, env=None if env is None else {**os.environ, **env},
                                         preexec_fn=_die_with_launcher if die_with_launcher else None)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)
        self.started = time.time()
        self._tail = bytearray()
        self._lock = threading.Lock()
        self._filters = [NoiseFilter(), NoiseFilter()]
        self._pumps = [threading.Thread(target=self._pump, args=(self.proc.stdout, sys.stdout.buffer, f), daemon=True)
                       for f in self._filters[:1]]
        self._pumps.append(threading.Thread(target=self._pump, args=(self.proc.stderr, sys.stderr.buffer,
                                                                     self._filters[1]), daemon=True))
        for thread in self._pumps:
            thread.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send_signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def lost_a_daemon(self) -> bool:
        """Its runtime said it lost a node's daemon and tore the job down: the stop signal its ranks then got
        (their daemons SIGTERM them) came from the teardown, not from a scheduler."""
        tail = self.tail()
        return any(line.encode() in tail for line in LOST_DAEMON)

    def tail(self) -> bytes:
        with self._lock:
            return bytes(self._tail)

    def _pump(self, source, sink, noise: NoiseFilter) -> None:
        def write(data: bytes) -> None:
            try:
                sink.write(data)
                sink.flush()
            except (OSError, ValueError):  # our own output is gone: keep draining, or mpirun would block
                pass

        while chunk := os.read(source.fileno(), 65536):
            write(noise.feed(chunk))
            with self._lock:
                self._tail.extend(chunk)
                del self._tail[:-OUTPUT_TAIL_BYTES]
        write(noise.flush())

    def wait(self, run_dir: Path | None, finalize_timeout_s: float, stop: LauncherStop | None = None,
             on_tick: Callable[[], None] | None = None) -> int:
        """mpirun's return code. Meanwhile, every :data:`WATCH_EVERY_S`: the stop's grace, the watch over a frozen
        or stuck mpirun, and ``on_tick`` (the launcher starts its warm standby from there)."""
        watch = MpirunWatch(self.proc.pid, run_dir, finalize_timeout_s) if run_dir is not None else None
        startup = StartupWatch(run_dir, ranks_here(self.cmd)) if run_dir is not None else None
        while True:
            try:
                rc = self._wait_watching_startup(startup)
                break
            except subprocess.TimeoutExpired:
                if stop is not None:
                    stop.overdue()
                why = watch.overdue() if watch is not None else None
                if why is not None:
                    print(f"[nanotron-recover] {why}: ending it (SIGKILL); the run is judged by what it wrote",
                          file=sys.stderr, flush=True)
                    end_mpirun(self.proc.pid)
                    watch = None
                if on_tick is not None and not _tick_guarded(on_tick):
                    on_tick = None
            except KeyboardInterrupt:  # pragma: no cover - SIGINT has a handler while a job runs
                continue
        for thread in self._pumps:  # the ranks' last lines; a rank's child that keeps the pipe open must not hold us
            thread.join(5.0)
        summary = noise_summary(sum(f.dropped for f in self._filters))
        if summary is not None:
            print(summary, file=sys.stderr, flush=True)
        if run_dir is not None:
            self._end_outliving_ranks(run_dir, stop)
        return rc

    @staticmethod
    def _end_outliving_ranks(run_dir: Path, stop: LauncherStop | None) -> None:
        """Ranks of this node that outlived mpirun (a lost node's teardown) get their stop grace, then SIGKILL."""
        grace = stop.grace_s if stop is not None and stop.grace_s is not None else OUTLIVING_BOUND_S
        outlived, waited = end_outliving_ranks(run_dir, grace)
        if outlived:
            print(f"[nanotron-recover] rank(s) {outlived} outlived mpirun; waited {waited:.1f} s (bound {grace:g} s) "
                  "for them to end before judging the run", file=sys.stderr, flush=True)

    def _wait_watching_startup(self, startup: StartupWatch | None) -> int:
        """mpirun's return code, or TimeoutExpired after :data:`WATCH_EVERY_S`; meanwhile, during start-up, this
        node's ranks are looked at every :data:`STARTUP_SCAN_S`: a rank dead before its start-up guard was armed
        ends the job now (its peers would wait for it for startup_timeout_s)."""
        deadline = time.monotonic() + WATCH_EVERY_S
        while startup is not None and not startup.done and time.monotonic() < deadline:
            try:
                return self.proc.wait(timeout=STARTUP_SCAN_S)
            except subprocess.TimeoutExpired:
                if (why := startup.died_unarmed()) is not None:
                    print(f"[nanotron-recover] {why}: ending the job (restart outcome)", file=sys.stderr, flush=True)
                    self.end()
        return self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))

    def end(self, timeout_s: float = 10.0) -> None:
        """End it now (SIGHUP: mpirun ends its ranks; SIGKILL if it does not go)."""
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGCONT)  # a stopped mpirun would hold the SIGHUP until the bound
        self.proc.send_signal(signal.SIGHUP)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            end_mpirun(self.proc.pid)
            self.proc.wait(timeout=timeout_s)
