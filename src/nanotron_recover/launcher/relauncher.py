"""The launcher's in-place relaunch, from a warm standby when one is ready.

A job that ends with the restart outcome (too few replicas, a lost node or ``mpirun``, a start-up fault) is
launched again by the launcher itself, up to ``--max-restarts`` times (each launch recorded in the run folder);
only then, or when a stop signal asked the job to end (the scheduler wants the nodes), does the launcher exit 3
for the scheduler's requeue. While a job trains, the next one waits beside it as a warm standby
(:mod:`nanotron_recover.process.standby_rank`): released when the job ends, it skips the launcher's and the
ranks' start-up (mpirun, interpreters, imports); a standby that is not ready or has died gives way to a cold
launch, said so. ``fault_tolerance.standby: auto`` starts one where memory allows
(:func:`~nanotron_recover.launcher.standby.standby_fits`);
``after_loss`` starts it only once the job logs a step with fewer replicas than it was launched with, then tells
the job when it is ready (a file in the run folder, :mod:`nanotron_recover.run.in_place`), which a regrow waits
for. A job that ends while its standby is still importing waits for it (bounded): it has a head start on a cold
launch.

In a Slurm allocation of several nodes, each relaunch first asks the nodes whether they answer
(:mod:`nanotron_recover.launcher.node_fit`): a relaunch after a node was lost runs on the others at the width
that fits, and comes back to full width once the node answers again (a standby at full width is started, then the
job regrows at a step boundary).
"""

from __future__ import annotations

import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from nanotron_recover.launcher.mpirun import with_env
from nanotron_recover.launcher.node_fit import NodeFit
from nanotron_recover.launcher.standby import Standby
from nanotron_recover.process.stop_request import LauncherStop
from nanotron_recover.run.exit_codes import EXIT_RESTART
from nanotron_recover.run.in_place import (
    FULL_REPLICAS_ENV,
    IN_PLACE_ENV,
    NODES_BACK_ENV,
    RELAUNCH_S_ENV,
    STANDBY_READY_ENV,
)
from nanotron_recover.run.run_folder import (
    LAUNCH_TOKEN_ENV,
    metrics_path,
    nodes_back_path,
    read_launches,
    read_metrics_jsonl,
    read_records_after,
    standby_ready_path,
    token_in,
)

MAX_RESTARTS_ENV = "NANOTRON_RECOVER_MAX_RESTARTS"
DEFAULT_MAX_RESTARTS = 3
READ_BYTES = 65536  # of metrics.jsonl, read at most per tick
STANDBY_STARTS = 3  # standbys started per launch at most (one whose mpirun ended while it waited is replaced)
STANDBY_WAIT_S = 60.0  # a job ended while its standby was importing: how long the launch waits for it


@dataclass
class JobSpec:
    """What every launch of one ``nanotron-recover train`` shares."""

    cmd: list[str]
    run_dir: Path
    world_size: int
    pass_fds: tuple[int, ...]
    finalize_timeout_s: float
    stop_grace_s: float | None  # None: the stock path (no graceful stop, no standby)
    max_restarts: int
    standby: bool
    standby_after_loss: bool = False  # start the standby once a replica is lost, not as soon as the job trains
    replicas: int = 0  # the job's data-parallel replicas (a step with fewer ran degraded)
    nodes: NodeFit | None = None  # in a Slurm allocation of several nodes: relaunches fit the nodes that answer


def max_restarts_setting() -> int:
    """``NANOTRON_RECOVER_MAX_RESTARTS`` (default 3; 0: every restart outcome goes to the scheduler)."""
    import os

    value = os.environ.get(MAX_RESTARTS_ENV, "").strip()
    return int(value) if value.isdigit() else DEFAULT_MAX_RESTARTS


def say(line: str) -> None:
    print(f"[nanotron-recover] {line}", file=sys.stderr, flush=True)


def with_launch_token(cmd: list[str], token: str) -> list[str]:
    """``cmd`` with a fresh launch token (the temporary names of its checkpoint writers are its own)."""
    return [f"{LAUNCH_TOKEN_ENV}={token}" if part.startswith(f"{LAUNCH_TOKEN_ENV}=") else part for part in cmd]


def measured_relaunch_s(run_dir: Path) -> float | None:
    """The newest in-place relaunch of this run folder: its old job's end to its first committed step."""
    launches = [r for r in read_launches(run_dir) if isinstance(r.get("previous_job_ended"), (int, float))]
    if not launches:
        return None
    newest = launches[-1]
    firsts = [r["time"] for r in read_metrics_jsonl(run_dir) if "event" not in r and "step" in r
              and isinstance(r.get("time"), (int, float)) and r["time"] >= newest["time"]]
    return min(firsts) - newest["previous_job_ended"] if firsts else None


class Relauncher:
    """Launch, judge, relaunch in place (warm when a standby is ready) until done or out of restarts."""

    def __init__(self, spec: JobSpec, judge: Callable[[int], int], begin: Callable[[dict], None],
                 launch_cold: Callable[[list[str], LauncherStop, Callable[[], None]], int]) -> None:
        self.spec, self.judge, self.begin, self.launch_cold = spec, judge, begin, launch_cold
        self.stop = LauncherStop(None, spec.stop_grace_s, say=say)
        self.standby: Standby | None = None
        self._metrics_offset = self._launch_offset = 0  # metrics.jsonl: read up to here; where this launch began
        self._job_trained = self._job_degraded = False  # seen since this launch started
        self._previous_ended: float | None = None  # when the last job's mpirun ended (time.time())
        self._standby_starts = 0  # standbys started during the running launch
        self._back_heard: float | None = None  # when this launch heard that a node it left out answers again
        self.restarts = 0
        self.cmd, self.replicas = spec.cmd, spec.replicas  # this launch's line and width (narrower: a node out)

    def run(self) -> int:
        self.stop.install()
        try:
            while True:
                code = self._one_launch()
                if code != EXIT_RESTART or self.stop.requested or self.restarts >= self.spec.max_restarts:
                    return code
                if self._ranks_were_stopped():
                    say(f"the job's ranks were asked to stop (a stop signal reached them, not this launcher): no "
                        f"relaunch in place, exit {code} for the scheduler")
                    return code
                if self.spec.nodes is not None:
                    fitted = self.spec.nodes.fit(say)
                    if fitted is None or self.stop.requested:
                        return code  # not enough nodes answer, or a stop came during the probe: the scheduler's turn
                    self.cmd, self.replicas = fitted
                self.restarts += 1
                how = "from the warm standby" if self._standby_fits() and self.standby.ready() else "cold"
                say(f"relaunching in place {how} (restart {self.restarts} of --max-restarts "
                    f"{self.spec.max_restarts})")
        finally:
            if self.standby is not None:
                self.standby.cancel()

    def _nodes_out(self) -> tuple[str, ...]:
        return self.spec.nodes.out if self.spec.nodes is not None else ()

    def _standby_fits(self) -> bool:
        return self.standby is not None and self.standby.nodes_out == self._nodes_out()

    def _one_launch(self) -> int:
        if self.standby is not None and not self._standby_fits():
            say("the warm standby was started for other nodes: a cold launch")
            self.standby.cancel()
            self.standby = None
        standby, self.standby = self.standby, None
        self._mark_start()
        record = {"previous_job_ended": self._previous_ended, "replicas": self.replicas,
                  **({"nodes_out": list(self._nodes_out())} if self.spec.nodes is not None else {})}
        if standby is not None and not standby.ready():
            self._wait_for(standby)
        if self.stop.requested:  # a launch started now would only be stopped, its ranks perhaps before they can be
            say(f"a stop signal came before launch {len(read_launches(self.spec.run_dir)) + 1} began: none is "
                f"started (exit {EXIT_RESTART})")
            if standby is not None:
                standby.cancel()
            return EXIT_RESTART
        if standby is not None and standby.ready():
            self.begin({**record, "warm": True, "token": standby.token})
            job = standby.release()
            self.stop.attach(job.proc)
            rc = job.wait(self.spec.run_dir, self.spec.finalize_timeout_s, self.stop, self._tick)
            standby.remove()
        else:
            if standby is not None:
                say(f"the warm standby is not ready ({standby.why_not()}): a cold launch")
                standby.cancel()
            cmd = self._command(self.restarts)
            self.begin({**record, "warm": False, "token": token_in(cmd)})
            rc = self.launch_cold(cmd, self.stop, self._tick)
        self._previous_ended = time.time()
        return self.judge(rc)

    def _wait_for(self, standby: Standby) -> None:
        """The job ended while its standby was still importing: wait for it (bounded), as a cold launch would
        import the same from the start."""
        if standby.ended() or standby.broken() is not None or self.stop.requested:
            return
        say(f"waiting for the warm standby ({standby.why_not()})")
        deadline = time.monotonic() + STANDBY_WAIT_S
        while not standby.ready() and not standby.ended() and standby.broken() is None and not self.stop.requested \
                and time.monotonic() < deadline:
            time.sleep(0.05)

    def _mark_start(self) -> None:
        self._standby_starts, self._back_heard = 0, None
        self._job_trained = self._job_degraded = False
        standby_ready_path(self.spec.run_dir).unlink(missing_ok=True)
        nodes_back_path(self.spec.run_dir).unlink(missing_ok=True)
        path = metrics_path(self.spec.run_dir)
        self._metrics_offset = self._launch_offset = path.stat().st_size if path.exists() else 0

    def _tick(self) -> None:
        """While a job runs: start the standby once the job has logged a step (its start-up, which the standby's
        would slow down, is over), or with ``after_loss`` a step with fewer replicas; tell the job when that one
        is ready. A standby whose ``mpirun`` ended while it waited is replaced, up to :data:`STANDBY_STARTS` per
        launch (seen on Slurm: the standby's daemon step failed to start, exit 213). A job run narrower is told
        when a node it left out answers again (:meth:`_watch_nodes`)."""
        if self._watch_nodes() or not self.spec.standby or self.stop.requested or self.spec.max_restarts < 1:
            return
        if self.standby is not None:
            ready = standby_ready_path(self.spec.run_dir)
            if not self.standby.ended() and self.standby.broken() is None:
                if self.spec.standby_after_loss and not ready.exists() and self.standby.ready():
                    ready.touch()
                return
            say(f"the warm standby ended while waiting ({self.standby.why_not()})"
                + ("; starting another" if self._standby_starts < STANDBY_STARTS else "; no other this launch"))
            ready.unlink(missing_ok=True)  # the job must not count on it any more
            self.standby.cancel()
            self.standby = None
        self._read_new_steps()
        wanted = self._job_degraded if self.spec.standby_after_loss else self._job_trained
        if self._standby_starts < STANDBY_STARTS and wanted:
            self._standby_starts += 1
            self.standby = self._new_standby(self._command(self.restarts + 1), self._nodes_out())

    def _watch_nodes(self) -> bool:
        """A job run narrower: once a node it left out answers again, keep a standby at full width (one of the
        narrower shape is cancelled, one whose ``mpirun`` ended is replaced up to :data:`STANDBY_STARTS` per
        launch) and tell the job when it is ready, so that its regrow is a warm relaunch; at once without
        standbys, or when none is left to start, or after :data:`STANDBY_WAIT_S` (the regrow is then cold or waits
        for the standby at the launch). True while the standby is this one's business."""
        nodes = self.spec.nodes
        if nodes is None or not nodes.out or self.stop.requested or not nodes.back_now(say):
            return False
        back = nodes_back_path(self.spec.run_dir)
        if self._back_heard is None:
            self._back_heard = time.monotonic()
        if not self.spec.standby:
            back.touch()
            return False
        if self.standby is not None and (self.standby.nodes_out or self.standby.ended()
                                         or self.standby.broken() is not None):
            self.standby.cancel()  # shaped for the narrower job, or its mpirun ended
            self.standby = None
        if self.standby is None and self._standby_starts < STANDBY_STARTS:
            self._standby_starts += 1
            say("starting the warm standby at full width for the regrow")
            self.standby = self._new_standby(self._command(self.restarts + 1, full_width=True), ())
        if self.standby is None or self.standby.ready() or time.monotonic() - self._back_heard >= STANDBY_WAIT_S:
            back.touch()
        return True

    def _new_standby(self, cmd: list[str], nodes_out: tuple[str, ...]) -> Standby:
        return Standby(cmd, self.spec.world_size, graceful=self.spec.stop_grace_s is not None,
                       pass_fds=self.spec.pass_fds, nodes_out=nodes_out)

    def _command(self, restarts: int, full_width: bool = False) -> list[str]:
        """The launch line of the job that follows ``restarts`` relaunches (at ``full_width``, else the running
        launch's width): a fresh launch token, and what the ranks need to decide a regrow
        (:mod:`nanotron_recover.recovery.regrow`): the relaunches in place left, and what one costs (the last one
        measured in this run folder, if any)."""
        left = max(0, self.spec.max_restarts - restarts)
        env = {IN_PLACE_ENV: str(left)}
        relaunch_s = measured_relaunch_s(self.spec.run_dir)
        if relaunch_s is not None:  # else the ranks weigh their own start-up
            env[RELAUNCH_S_ENV] = f"{relaunch_s:.3f}"
        if self.spec.standby and self.spec.standby_after_loss:
            env[STANDBY_READY_ENV] = str(standby_ready_path(self.spec.run_dir))
        if self.replicas < self.spec.replicas and not full_width:  # run narrower: a node is out
            env[FULL_REPLICAS_ENV] = str(self.spec.replicas)
            env[NODES_BACK_ENV] = str(nodes_back_path(self.spec.run_dir))
        return with_env(with_launch_token(self.spec.cmd if full_width else self.cmd, secrets.token_hex(4)), env)

    def _read_new_steps(self) -> None:
        """Read the step records this launch appended to ``metrics.jsonl`` since the last tick (whole lines)."""
        if self._job_degraded or (self._job_trained and not self.spec.standby_after_loss):
            return  # nothing more to learn
        records, self._metrics_offset = read_records_after(metrics_path(self.spec.run_dir), self._metrics_offset,
                                                           READ_BYTES)
        for record in records:
            if "event" not in record and "step" in record:
                self._job_trained = True
                live = record.get("live_replicas")
                self._job_degraded |= isinstance(live, int) and live < self.replicas

    def _ranks_were_stopped(self) -> bool:
        """The ranks of the launch that just ended stopped on a stop signal of their own (``scancel --signal``
        reaches the job's steps, not the launcher): the scheduler asked for the nodes, no relaunch in place."""
        records, _ = read_records_after(metrics_path(self.spec.run_dir), self._launch_offset)
        return any(r.get("event") == "stop_signal" for r in records)
