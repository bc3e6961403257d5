"""The launcher's in-place relaunch, from a warm standby when one is ready, and its watch over each launch.

A job that ends with the restart outcome (too few replicas, a lost node or ``mpirun``, a start-up fault) is
launched again by the launcher itself, up to ``--max-restarts`` times (each launch recorded in the run folder);
only then, or when a stop signal asked the job to end (the scheduler wants the nodes: it reached the launcher, or
only the ranks, whose ``stop_signal`` event says so), does the launcher exit 3 for the scheduler's requeue. A stop
signal between two launches starts no launch. While a job trains, the next one waits beside it as a warm standby
(:mod:`nanotron_recover.launcher.standby`): released when the job ends, it skips the launcher's and the ranks'
start-up (mpirun, interpreters, imports); a standby that is not ready, has died or lost a rank gives way to a cold
launch, said so. ``fault_tolerance.standby: auto`` starts one where memory allows
(:func:`~nanotron_recover.launcher.standby.standby_fits`); ``after_loss`` starts it only once the job logs a step
with fewer replicas than it was launched with. A job that ends while its standby is still importing waits for it
(bounded): it has a head start on a cold launch.

The launcher decides the job's width: it reads the step records the job logs, and when coming back to full width
through a relaunch pays (:mod:`nanotron_recover.launcher.regrow`), it asks the job to stop at a step boundary
through the graceful stop (SIGUSR1 to ``mpirun``) and relaunches it in place at full width.

In a Slurm allocation of several nodes, each relaunch first asks the nodes whether they answer
(:mod:`nanotron_recover.launcher.node_fit`): a relaunch after a node was lost runs on the others at the width
that fits, and comes back to full width once the node answers again (a standby at full width is started, then the
regrow). When the relaunch first waits for its standby to finish importing, the nodes are asked again after the
wait: a node that went silent during it is not launched on.
"""

from __future__ import annotations

import secrets
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from nanotron_recover.launcher.node_fit import NodeFit
from nanotron_recover.launcher.regrow import Regrow
from nanotron_recover.launcher.standby import Standby
from nanotron_recover.process.priority import can_idle
from nanotron_recover.process.standby_rank import IDLE_IMPORT_S
from nanotron_recover.process.stop_request import LauncherStop
from nanotron_recover.run.exit_codes import EXIT_RESTART
from nanotron_recover.run.launch_contract import TOKEN_ENV
from nanotron_recover.run.run_folder import (
    append_metrics_record,
    metrics_path,
    read_launches,
    read_metrics_jsonl,
    read_records_after,
    standby_root,
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
    ranks_per_replica: int = 1  # tp x pp (HSDP: the shards): a narrower launch has that many fewer ranks a replica
    nodes: NodeFit | None = None  # in a Slurm allocation of several nodes: relaunches fit the nodes that answer
    regrow: str = "off"  # fault_tolerance.regrow: back to full width through a relaunch in place, when it pays
    relaunch_mtbf_h: float = 2.0  # the expected time to the next failure that a regrow weighs


def max_restarts_setting() -> int:
    """``NANOTRON_RECOVER_MAX_RESTARTS`` (default 3; 0: every restart outcome goes to the scheduler)."""
    import os

    value = os.environ.get(MAX_RESTARTS_ENV, "").strip()
    return int(value) if value.isdigit() else DEFAULT_MAX_RESTARTS


def say(line: str) -> None:
    print(f"[nanotron-recover] {line}", file=sys.stderr, flush=True)


def with_launch_token(cmd: list[str], token: str) -> list[str]:
    """``cmd`` with a fresh launch token (the temporary names of its checkpoint writers are its own)."""
    return [f"{TOKEN_ENV}={token}" if part.startswith(f"{TOKEN_ENV}=") else part for part in cmd]


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
    """Launch, judge, relaunch in place (warm when a standby is ready) until done or out of restarts; meanwhile
    keep the standby, hear a node come back, and decide when coming back to full width pays (a regrow)."""

    def __init__(self, spec: JobSpec, judge: Callable[[int], int], begin: Callable[[dict], None],
                 launch_cold: Callable[[list[str], LauncherStop, Callable[[], None]], int]) -> None:
        self.spec, self.judge, self.begin, self.launch_cold = spec, judge, begin, launch_cold
        self.stop = LauncherStop(None, spec.stop_grace_s, say=say)
        self.standby: Standby | None = None
        self.regrow = Regrow(spec.regrow, spec.replicas, spec.relaunch_mtbf_h)
        self._metrics_offset = self._launch_offset = 0  # metrics.jsonl: read up to here; where this launch began
        self._job_trained = self._job_degraded = False  # seen since this launch started
        self._previous_ended: float | None = None  # when the last job's mpirun ended (time.time())
        self._standby_starts = 0  # standbys started during the running launch
        self._back_heard: float | None = None  # when this launch heard that a node it left out answers again
        self._token: str | None = None  # the running launch's
        self._regrow: dict | None = None  # the regrow this launch was stopped for: its decision
        self._said_priority = False  # the standby's priority is said once
        self.restarts = 0
        self.cmd, self.replicas = spec.cmd, spec.replicas  # this launch's line and width (narrower: a node out)

    def run(self) -> int:
        self.stop.install()
        shutil.rmtree(standby_root(self.spec.run_dir), ignore_errors=True)  # a killed launcher's (the folder is ours)
        try:
            while True:
                code = self._one_launch()
                if code != EXIT_RESTART or self.stop.requested or self.restarts >= self.spec.max_restarts:
                    return code
                regrown = self._regrow is not None and self._log_regrow_stop()
                torn_down = getattr(self.stop.proc, "lost_a_daemon", lambda: False)()  # a lost node's teardown
                if not regrown and not torn_down and self._ranks_were_stopped():
                    say(f"the job's ranks were asked to stop (a stop signal reached them, not this launcher): no "
                        f"relaunch in place, exit {code} for the scheduler")
                    return code
                if self.spec.nodes is not None:
                    fitted = self._fit_nodes()
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

    def _fit_nodes(self) -> tuple[list[str], int] | None:
        """Ask the nodes which answer; when a standby shaped for them is still importing, wait for it first and ask
        again after the wait (a node may have gone silent meanwhile: the answer the launch follows is fresh)."""
        fitted = self.spec.nodes.fit(say)
        if fitted is not None and not self.stop.requested and self._standby_fits() and self._wait_for(self.standby):
            fitted = self.spec.nodes.fit(say)
        return fitted

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
        record = {"previous_job_ended": self._previous_ended, "replicas": self.replicas,
                  **({"nodes_out": list(self._nodes_out())} if self.spec.nodes is not None else {}),
                  **({"regrow": self._regrow} if self._regrow is not None else {})}
        self._mark_start()
        if standby is not None:
            self._wait_for(standby)
            standby.look_now()
        if self.stop.requested:  # a launch started now would only be stopped, its ranks perhaps before they can be
            say(f"a stop signal came before launch {len(read_launches(self.spec.run_dir)) + 1} began: none is "
                f"started (exit {EXIT_RESTART})")
            if standby is not None:
                standby.cancel()
            return EXIT_RESTART
        if standby is not None and standby.ready():
            self._token = standby.token
            self.begin({**record, "warm": True, "token": self._token})
            job = standby.release()
            self.stop.attach(job)
            rc = job.wait(self.spec.run_dir, self.spec.finalize_timeout_s, self.stop, self._tick)
            standby.remove()
        else:
            if standby is not None:
                say(f"the warm standby is not ready ({standby.why_not()}): a cold launch")
                standby.cancel()
            cmd = self._command()
            self._token = token_in(cmd)
            self.begin({**record, "warm": False, "token": self._token})
            rc = self.launch_cold(cmd, self.stop, self._tick)
        self._previous_ended = time.time()
        return self.judge(rc)

    def _wait_for(self, standby: Standby) -> bool:
        """The job ended while its standby was still importing: wait for it (bounded, once), as a cold launch would
        import the same from the start. True when it waited."""
        standby.look_now()
        if standby.waited or standby.ready() or standby.ended() or standby.broken() is not None \
                or self.stop.requested:
            return False
        standby.waited = True
        say(f"waiting for the warm standby ({standby.why_not()})")
        deadline = time.monotonic() + STANDBY_WAIT_S
        while not standby.ready() and not standby.ended() and standby.broken() is None and not self.stop.requested \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        return True

    def _mark_start(self) -> None:
        self._standby_starts, self._back_heard, self._regrow = 0, None, None
        self._job_trained = self._job_degraded = False
        path = metrics_path(self.spec.run_dir)
        self._metrics_offset = self._launch_offset = path.stat().st_size if path.exists() else 0
        self.regrow.begin(self.replicas, restarts_left=self.spec.max_restarts - self.restarts,
                          relaunch_s=measured_relaunch_s(self.spec.run_dir),
                          standby_follows=self.spec.standby and self.spec.standby_after_loss)

    # ------------------------------------------------------------------------------------------ while a job runs
    def _tick(self) -> None:
        """While a job runs: hear whether a node it left out answers again, keep the standby, and read what the
        job logged since the last tick (its steps start the standby and weigh a regrow)."""
        if self.stop.requested:
            return
        back = self._hear_nodes_back()
        if back is None:
            self._keep_standby()
        standby_ready = self._standby_fits() and self.standby.ready()
        if standby_ready and not self.standby.announced:  # when a standby got ready: a run's record says it
            self.standby.announced = True
            say(f"the warm standby is ready, {time.time() - self.standby.started:.1f} s after its start "
                f"(at {self.standby.ready_at()} priority)")
            append_metrics_record(self.spec.run_dir, {"event": "standby_ready", "time": time.time(),
                                                      "import_s": round(time.time() - self.standby.started, 3),
                                                      "priority": self.standby.ready_at()},
                                  launch=self._token)
        records, self._metrics_offset = read_records_after(metrics_path(self.spec.run_dir), self._metrics_offset,
                                                           READ_BYTES)
        for record in records:
            self._learn(record, standby_ready, back is True)

    def _keep_standby(self) -> None:
        """Start the standby once the job has logged a step (its start-up, which the standby's would slow down,
        is over), or with ``after_loss`` a step with fewer replicas. A standby whose ``mpirun`` ended, or that lost
        a rank, while it waited is replaced, up to :data:`STANDBY_STARTS` per launch (seen on Slurm: the standby's
        daemon step failed to start, exit 213)."""
        if not self.spec.standby or self.spec.max_restarts < 1:
            return
        if self.standby is not None:
            if not self.standby.ended() and self.standby.broken() is None:
                return
            say(f"the warm standby ended while waiting ({self.standby.why_not()})"
                + ("; starting another" if self._standby_starts < STANDBY_STARTS else "; no other this launch"))
            self.standby.cancel()
            self.standby = None
        wanted = self._job_degraded if self.spec.standby_after_loss else self._job_trained
        if self._standby_starts < STANDBY_STARTS and wanted:
            self._standby_starts += 1
            self.standby = self._new_standby(self._command(), self._nodes_out(), self._world_size())

    def _hear_nodes_back(self) -> bool | None:
        """A job run narrower: once a node it left out answers again, keep a standby at full width (one of the
        narrower shape is cancelled, one that ended or broke is replaced up to :data:`STANDBY_STARTS` per launch).
        None: no node left out answers (the standby is :meth:`_keep_standby`'s); False: one does, its standby is
        not ready yet; True: a regrow may count the node, with the standby ready (at once without standbys, or
        when none is left to start, or after :data:`STANDBY_WAIT_S`: the regrow is then cold, or waits for the
        standby at the launch)."""
        nodes = self.spec.nodes
        if nodes is None or not nodes.out or not nodes.back_now(say):
            return None
        if self._back_heard is None:
            self._back_heard = time.monotonic()
        if not self.spec.standby:
            return True
        if self.standby is not None and (self.standby.nodes_out or self.standby.ended()
                                         or self.standby.broken() is not None):
            self.standby.cancel()  # shaped for the narrower job, or its mpirun ended
            self.standby = None
        if self.standby is None and self._standby_starts < STANDBY_STARTS:
            self._standby_starts += 1
            say("starting the warm standby at full width for the regrow")
            self.standby = self._new_standby(self._command(full_width=True), (), self.spec.world_size)
        return self.standby is None or self.standby.ready() or time.monotonic() - self._back_heard >= STANDBY_WAIT_S

    def _learn(self, record: dict, standby_ready: bool, nodes_back: bool) -> None:
        """A record the running launch logged: a step says whether the job trains, and degraded; the regrow weighs
        it. When coming back to full width pays, the job is asked to stop after the step in flight (SIGUSR1 to
        ``mpirun``, the graceful stop): every rank learns it in the same step, snapshots it and exits 3."""
        if "event" not in record and "step" in record:
            self._job_trained = True
            live = record.get("live_replicas")
            self._job_degraded |= isinstance(live, int) and live < self.replicas
        why = self.regrow.observe(record, standby_ready=standby_ready, nodes_back=nodes_back)
        if self.regrow.news is not None:
            append_metrics_record(self.spec.run_dir, {**self.regrow.news, "time": time.time()}, launch=self._token)
        if why is not None and self._regrow is None:
            self._regrow = {**(self.regrow.news or {}), "reason": why}
            say(f"{why}: asking the job to stop after the step in flight")
            self.stop.forward(signal.SIGUSR1)

    def _log_regrow_stop(self) -> bool:
        """After a job asked to stop for a regrow ended: the ``regrow_stop`` event at the step its ranks stopped
        after (their ``stop_signal``); False when it ended otherwise (then it is judged like any other end)."""
        records, _ = read_records_after(metrics_path(self.spec.run_dir), self._launch_offset)
        stops = [r["step"] for r in records if r.get("event") == "stop_signal" and isinstance(r.get("step"), int)]
        if not stops:
            return False
        append_metrics_record(self.spec.run_dir, {"event": "regrow_stop", "step": stops[-1],
                                                  "reason": self._regrow["reason"],
                                                  "decided_at_step": self._regrow.get("step"), "time": time.time()},
                              launch=self._token)
        return True

    def _world_size(self) -> int:
        """The running launch's ranks: a launch narrower than the job (a node out) has fewer replicas."""
        return self.spec.world_size - (self.spec.replicas - self.replicas) * self.spec.ranks_per_replica

    def _new_standby(self, cmd: list[str], nodes_out: tuple[str, ...], world_size: int) -> Standby:
        if not self._said_priority:
            self._said_priority = True
            say("the warm standby imports at idle CPU and I/O priority (it runs on what the training leaves idle; a "
                f"rank not ready after {IDLE_IMPORT_S:g} s, where no core is idle, finishes at normal priority)"
                if can_idle() else "the warm standby imports at normal priority, beside the training: this user "
                "may not leave the idle class again (root, CAP_SYS_NICE or RLIMIT_NICE >= 20 would allow it)")
        return Standby(cmd, world_size, root=standby_root(self.spec.run_dir),
                       graceful=self.spec.stop_grace_s is not None, pass_fds=self.spec.pass_fds, nodes_out=nodes_out)

    def _command(self, full_width: bool = False) -> list[str]:
        """The launch line of the next job (at ``full_width``, else the running launch's width), with a fresh
        launch token."""
        return with_launch_token(self.spec.cmd if full_width else self.cmd, secrets.token_hex(4))

    def _ranks_were_stopped(self) -> bool:
        """The ranks of the launch that just ended stopped on a stop signal of their own (``scancel --signal``
        reaches the job's steps, not the launcher): the scheduler asked for the nodes, no relaunch in place."""
        records, _ = read_records_after(metrics_path(self.spec.run_dir), self._launch_offset)
        return any(r.get("event") == "stop_signal" for r in records)
