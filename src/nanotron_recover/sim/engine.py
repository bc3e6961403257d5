"""The discrete-event simulation of one training run under one policy.

Between two events nothing changes, so progress is continuous: while the job trains, steps advance at
``1 / step_s`` and tokens at ``tokens_per_step / step_s``. Events: a failure (drawn per GPU and per node in wall
time, or scheduled at a step), a periodic checkpoint due, the end of a stall (in-step recovery, a checkpoint
save, a teardown, a restart), a replica rejoining, the target step, the horizon; with regrow (issue #40), a lost
slot's replacement arriving and the step boundary a regrow was decided for. That keeps a month at 131k GPUs
to a few thousand events.

Accounting (:class:`SimResult`): useful tokens (tokens of steps that stay in the final trajectory: work lost to
a rollback is subtracted), wall time, allocated GPU-seconds (every GPU of the cluster, for the whole wall time)
and live process-seconds (the benchmarks' "process-seconds": processes of the current job, dead ones not
counted; a relaunch counts with its own size from the moment it is started).
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

from nanotron_recover.sim.accounting import SimResult, ideal_tokens_per_gpu_s
from nanotron_recover.sim.cluster import Cluster
from nanotron_recover.sim.params import Params
from nanotron_recover.sim.policies import Policy
from nanotron_recover.sim.regrow import decide

__all__ = ["ScheduledFailure", "simulate"]

_EPS = 1e-9


@dataclass(frozen=True)
class ScheduledFailure:
    """At progress ``step`` (e.g. 18.5: half-way through step 19) one rank of each slot in ``slots`` dies."""

    step: float
    slots: tuple[int, ...]
    kind: str = "gpu"  # gpu | node (a node: every slot listed loses its node)
    gpus: tuple[int, ...] = ()  # instead of ``slots``: exactly these GPUs die (a pooled one, a formed replica's)


class _Run:
    """Mutable state of one simulated run (see the module docstring)."""

    def __init__(self, cluster: Cluster, policy: Policy, p: Params, rng: random.Random,
                 scheduled: Sequence[ScheduledFailure], random_failures: bool, log: bool) -> None:
        self.c = replace(cluster, spare_replicas=policy.spare_replicas)
        self.pol, self.p, self.rng, self.log = policy, p, rng, log
        self.misc = random.Random(rng.random())  # hangs: apart, so every policy sees the same failure stream
        self.R0 = self.c.replicas
        self.M = self.R0 * p.accumulation
        self.t = 0.0
        self.progress = 0.0
        self.tokens = 0.0
        self.ckpt_progress, self.ckpt_tokens = 0.0, 0.0
        self.next_ckpt = float(policy.checkpoint_interval) if policy.checkpoint_interval else math.inf
        self.scheduled = sorted(scheduled, key=lambda f: f.step)
        self.failed_slots: dict[int, float] = {}  # slot -> when its hardware is repaired (never back in this job)
        self.generation = 0
        self.rejoins: list[tuple[float, int, int]] = []  # (time, generation, slot)
        self.replacements: list[float] = []  # regrow: when a lost slot's replacement is in the allocation
        self.regrow_at = math.inf  # regrow decided: the step boundary it ends at
        self.pending: deque[list] = deque()  # [kind, remaining_s, processes]
        self.phase = "run"
        self.done = False
        self.res = SimResult(policy.name, self.c, 0.0, 0.0, 0.0, 0.0, 0.0,
                             ideal_tokens_per_gpu_s=ideal_tokens_per_gpu_s(self.c, p))
        self._full_job()
        # the first launch
        start = p.startup_s if p.startup_s is not None else p.restart_s(self.c.nodes, self.job_procs(), load=False)
        self._push("startup", start, self.job_procs())
        rate = 1.0 / (p.mttf_hours(self.c.job_gpus) * 3600.0) if random_failures else 0.0
        self.fail_rate = rate
        self.next_fail = self.t + rng.expovariate(rate) if rate > 0 else math.inf

    # -- layout
    def _full_job(self, regrow: bool = False) -> None:
        """A (re)launched job: every slot not lost for good (replacement) or only the healthy ones; a regrow stays
        in its allocation: slots whose replacement has not arrived stay out."""
        if self.p.replacement and not regrow:
            self.failed_slots = {}
        self.regrow_at = math.inf
        self.failed_slots = {s: t for s, t in self.failed_slots.items() if t > self.t + _EPS}  # repaired: usable
        usable = [s for s in range(self.c.slots) if s not in self.failed_slots]
        n_spares = min(self.pol.spare_replicas, max(0, len(usable) - 1))
        self.active = set(usable[: len(usable) - n_spares])
        self.spares = list(usable[len(usable) - n_spares:])
        self.pool: set[int] = set()  # recycling: healthy GPUs of failed replicas, waiting to form one
        self.formed: dict[int, tuple[int, ...]] = {}  # a formed replica's id (>= slots) -> its GPUs
        self.owner: dict[int, int] = {}  # a GPU of a formed replica -> that replica's id
        self.generation += 1

    def job_procs(self) -> int:
        return (len(self.active) + len(self.spares)) * self.c.ranks_per_replica + len(self.pool)

    def gpus_of(self, slot: int) -> tuple[int, ...]:
        if slot in self.formed:
            return self.formed[slot]
        r = self.c.ranks_per_replica
        return tuple(range(slot * r, (slot + 1) * r))

    def replica_of(self, gpu: int) -> int | None:
        """The replica a GPU computes in now (None: in the pool)."""
        if gpu in self.pool:
            return None
        return self.owner.get(gpu, self.c.slot_of_gpu(gpu))

    # -- rates
    def quota(self) -> int:
        return math.ceil(self.M / len(self.active)) if self.pol.keep_m else self.p.accumulation

    def step_s(self) -> float:
        return self.p.step_s(self.quota(), self.job_procs(), self.c.pp, recover=self.pol.recover_path)

    def tokens_per_step(self) -> float:
        mbs = self.M if self.pol.keep_m else len(self.active) * self.p.accumulation
        return mbs * self.p.tokens_per_microbatch

    # -- phases
    def _push(self, kind: str, dur: float, procs: int) -> None:
        self.pending.append([kind, max(0.0, dur), procs])
        self.phase = "stalled"

    def _event(self, what: str) -> None:
        if self.log:
            self.res.events.append((self.t, what))

    def _advance(self, t_next: float) -> None:
        dt = t_next - self.t
        if dt <= 0:
            return
        if self.phase == "run":
            procs = self.job_procs()
            step = self.step_s()
            self.progress += dt / step
            self.tokens += dt / step * self.tokens_per_step()
        else:
            head = self.pending[0]
            procs = head[2]
            head[1] -= dt
            if head[0] != "startup":
                self.res.stall_s += dt
        self.res.process_s += procs * dt
        self.t = t_next

    def _phase_done(self) -> None:
        kind, _, _ = self.pending.popleft()
        if kind == "save":
            self.ckpt_progress, self.ckpt_tokens = self.progress, self.tokens
        elif kind in ("restart", "startup"):
            if kind == "restart":
                self._full_job()
        elif kind == "regrow":
            self._full_job(regrow=True)
        elif kind == "exit":
            self.done = True
        if not self.pending and not self.done:
            self.phase = "run"

    # -- failures
    def _crash(self, dead_procs: int) -> None:
        """The whole job ends: roll back to the last checkpoint (with node-local snapshots: to the last committed
        step, only the step in flight is lost), tear down, relaunch."""
        self.res.crashes += 1
        if self.pol.local_snapshots:
            in_flight = self.progress - math.floor(self.progress + _EPS)
            self.progress, self.tokens = self.progress - in_flight, self.tokens - in_flight * self.tokens_per_step()
        else:
            self.progress, self.tokens = self.ckpt_progress, self.ckpt_tokens
        self.next_ckpt = self._next_ckpt_after(self.progress)
        self.pending.clear()
        self._push("teardown", self.p.teardown_s, max(0, self.job_procs() - dead_procs))
        procs = self._relaunch_procs()
        self._push("restart", self.p.restart_s(self.c.nodes, procs), procs)
        self._event("crash")

    def _relaunch_procs(self) -> int:
        if self.p.replacement:
            return self.c.slots * self.c.ranks_per_replica
        return sum(1 for s in range(self.c.slots) if s not in self.failed_slots) * self.c.ranks_per_replica

    def _lose(self, slot: int) -> None:
        self.failed_slots[slot] = self.t + self.p.hw_repair_hours * 3600.0
        if self.pol.regrow != "off":
            self.failed_slots[slot] = self.t + self.p.replacement_s()
            if self.p.replacement_s() > 0:
                heapq.heappush(self.replacements, self.failed_slots[slot])

    def _next_ckpt_after(self, progress: float) -> float:
        k = self.pol.checkpoint_interval
        return (math.floor(progress / k + _EPS) + 1) * k if k else math.inf

    def exit_s(self) -> float:
        return self.p.job_exit_s(self.job_procs(), self.pol.recover_path and self.res.failures > 0)

    def _fail_in_restart(self, slots: Sequence[int] = ()) -> None:
        """A failure while the job is going away (teardown, exit: nothing more) or coming back (the relaunch fails
        too: another one, as ``failure_during_stall`` models it; a regrow's leaves ``slots`` out)."""
        if self.pending[0][0] == "regrow":
            for s in slots:
                self._lose(s)
        if self.pending[0][0] in ("restart", "startup", "regrow"):
            dur = self._relaunch_s() if self.pending[0][0] == "regrow" else self.p.restart_s(self.c.nodes,
                                                                                              self.pending[0][2])
            if self.p.failure_during_stall == "reset":
                self.pending[0][1] = dur
            else:
                self.pending.insert(1, [self.pending[0][0].replace("startup", "restart"), dur, self.pending[0][2]])

    def _in_restart(self) -> bool:
        return self.phase != "run" and self.pending[0][0] in ("teardown", "restart", "startup", "exit", "regrow")

    def fail_gpus(self, gpus: Iterable[int], node: bool) -> None:
        """These GPUs die: the replicas they compute in fail; pooled ones leave the pool (one more repair)."""
        gpus = set(gpus)
        slots = sorted({r for r in map(self.replica_of, gpus) if r is not None})
        pooled = gpus & self.pool
        if pooled and not self.done and not [s for s in slots if s in self.active or s in self.spares]:
            self.res.failures += 1
            self.res.node_failures += int(node)
            if self._in_restart():
                return
            if node and self.pol.node_loss_ends_job:
                self._crash(len(pooled))
                return
            self.pool -= pooled
            self._push("stall", self.p.detect_s + self.p.repair_at(self.job_procs()), self.job_procs())
            return
        self.pool -= pooled
        self.fail(slots, node, dead=gpus)

    def fail(self, slots: Iterable[int], node: bool, dead: set[int] | None = None) -> None:
        """Replicas ``slots`` lose GPUs ``dead`` (default: each its first)."""
        slots = [s for s in slots if s in self.active or s in self.spares]
        if not slots or self.done:
            return  # hardware the job does not use (failed before, not replaced)
        if dead is None:
            dead = {self.gpus_of(s)[0] for s in slots}
        self.res.failures += 1
        self.res.node_failures += int(node)
        if self._in_restart():
            self._fail_in_restart(slots)
            return
        dead_procs = self.c.gpus_per_node if node else len(slots)
        if not self.pol.in_place or (node and self.pol.node_loss_ends_job):
            if not self.p.replacement:
                for s in slots:
                    self._lose(s)
            self._crash(dead_procs)
            return
        # in place: the replicas leave, the survivors repair in-step
        hang = (not node) and self.misc.random() < self.p.hang_fraction
        stall = (self.p.hang_timeout_s if hang else self.p.detect_s) + self.p.repair_at(self.job_procs())
        lost_active = [s for s in slots if s in self.active]
        for s in slots:
            if s in self.spares:
                self.spares.remove(s)
        q_before = self.quota()
        for s in lost_active:
            self.active.discard(s)
            self._lose(s)
            if self.pol.rejoin:
                heapq.heappush(self.rejoins, (self.t + self.p.rejoin_s, self.generation, s))
        if self.pol.recycle:
            self._pool_survivors(slots, dead)
        for s in lost_active:
            if self.spares:
                self.active.add(self.spares.pop())
                self.res.spares_used += 1
                stall += self.p.transfer_s()
        if len(self.active) < max(1, self.pol.min_replicas):
            if self.active:  # planned stop: checkpoint and exit, the requeued job starts at full size
                self.res.requeues += 1
                self._push("stall", stall, self.job_procs())
                self._push("save", self.p.ckpt_save_s(), self.job_procs())
                self._push("teardown", self.exit_s(), self.job_procs())
                procs = self._relaunch_procs()
                self._push("restart", self.p.restart_s(self.c.nodes, procs), procs)
                self._event("requeue")
            else:
                self._crash(dead_procs)
            return
        if self.pol.keep_m and lost_active:  # orphaned microbatches of this step, spread over the survivors
            orphans = q_before * len(lost_active)
            share = max(1.0, self.job_procs() / self.p.devices) if self.p.devices else 1.0
            stall += math.ceil(orphans / len(self.active)) * self.p.mb_s * share
        stall += self._form_from_pool()
        self._push("stall", stall, self.job_procs())
        self._event(f"in-place ({len(lost_active)} replica(s) left, {len(self.active)} active)")
        if lost_active:
            self.consider_regrow()

    # -- regrow (issue #40)
    def _regrow_slots(self) -> int:
        """Training replicas a relaunch now would have: the slots whose hardware is in the allocation."""
        usable = sum(1 for s in range(self.c.slots) if self.failed_slots.get(s, 0.0) <= self.t + _EPS)
        return max(1, usable - min(self.pol.spare_replicas, max(0, usable - 1)))

    def _relaunch_s(self) -> float:
        return self.p.relaunch_s(self.c.nodes, self._relaunch_procs(), warm=self.pol.regrow == "warm")

    def consider_regrow(self) -> None:
        """Replicas were lost or a replacement arrived: regrow at the next step boundary if a relaunch pays."""
        if self.pol.regrow == "off" or self.done or self.regrow_at < math.inf or self._in_restart():
            return
        full = self._regrow_slots()
        if full <= len(self.active):
            return  # nothing to come back to
        step_full = self.p.step_s(math.ceil(self.M / full) if self.pol.keep_m else self.p.accumulation,
                                  full * self.c.ranks_per_replica, self.c.pp, recover=self.pol.recover_path)
        d = decide(self.step_s(), step_full, self._relaunch_s(), self.p.regrow_horizon_s(self.c.job_gpus))
        self.res.decisions.append(d)
        if d.regrow:
            self.regrow_at = math.floor(self.progress + _EPS) + 1.0
        else:
            self.res.regrow_declined += 1
        self._event(d.describe())

    # -- recycling
    def _pool_survivors(self, slots: Iterable[int], dead: set[int]) -> None:
        """The healthy GPUs of the failed replicas join the pool; a formed replica's id is gone."""
        for s in slots:
            self.pool |= set(self.gpus_of(s)) - dead
            for g in self.formed.pop(s, ()):
                self.owner.pop(g, None)

    def _form_from_pool(self) -> float:
        """At the step boundary, each replica's worth of pooled GPUs forms a replica: it takes a free slot (or
        waits as a spare), after the formation and the state transfer, which the whole job waits for."""
        r, stall = self.c.ranks_per_replica, 0.0
        while len(self.pool) >= r:
            members = tuple(sorted(self.pool)[:r])
            self.pool -= set(members)
            rid = self.c.slots + self.res.formations  # ids never reused
            self.formed[rid] = members
            self.owner.update({g: rid for g in members})
            (self.active.add if len(self.active) < self.R0 else self.spares.append)(rid)
            self.res.formations += 1
            stall += self.p.formation_s + self.p.transfer_s()
        return stall

    def random_failure(self) -> None:
        node = self.rng.random() < self.p.node_fraction
        if node:
            n = self.rng.randrange(self.c.nodes)
            first = n * self.c.gpus_per_node
            self.fail_gpus(range(first, min(first + self.c.gpus_per_node, self.c.job_gpus)), node=True)
        else:
            self.fail_gpus([self.rng.randrange(self.c.job_gpus)], node=False)

    def scheduled_failure(self, f: ScheduledFailure) -> None:
        if f.gpus:
            self.fail_gpus(f.gpus, node=f.kind == "node")
        else:
            self.fail(f.slots, node=f.kind == "node")


def simulate(
    cluster: Cluster,
    policy: Policy,
    p: Params,
    *,
    horizon_s: float | None = None,
    target_steps: float | None = None,
    scheduled: Sequence[ScheduledFailure] = (),
    random_failures: bool = True,
    seed: int = 0,
    log_events: bool = False,
) -> SimResult:
    """One run until ``target_steps`` are committed (then the job exits) or ``horizon_s`` of wall time."""
    if horizon_s is None and target_steps is None:
        raise ValueError("give horizon_s or target_steps")
    run = _Run(cluster, policy, p, random.Random(seed), scheduled, random_failures, log_events)
    horizon = horizon_s if horizon_s is not None else math.inf
    target = target_steps if target_steps is not None else math.inf
    sched = deque(run.scheduled)
    guard = 0
    while not run.done and run.t < horizon - _EPS:
        guard += 1
        if guard > 5_000_000:
            raise RuntimeError("simulation did not converge (event storm)")
        t_next, what = _next_event(run, horizon, target, sched)
        run._advance(t_next)
        if what == "horizon":
            break
        _handle(run, what, target, sched, policy, p)
    res = run.res
    res.wall_s, res.tokens, res.steps = run.t, run.tokens, run.progress
    res.gpu_s_allocated = cluster.gpus * run.t
    res.failure_free_tokens_per_s = failure_free_rate(cluster, policy, p)
    return res


def _next_event(run: "_Run", horizon: float, target: float, sched: deque) -> tuple[float, str]:
    """The earliest of: the horizon, the next random failure, a rejoin, and (while running) the target, the next
    checkpoint or the next scheduled failure; (otherwise) the end of the current phase."""
    cands: list[tuple[float, str]] = [(horizon, "horizon"), (run.next_fail, "fail")]
    if run.rejoins:
        cands.append((run.rejoins[0][0], "rejoin"))
    if run.replacements:
        cands.append((run.replacements[0], "replaced"))
    if run.phase == "run":
        step = run.step_s()
        for prog, what in ((target, "target"), (run.next_ckpt, "ckpt"),
                           (sched[0].step if sched else math.inf, "sched"), (run.regrow_at, "regrow")):
            if prog < math.inf:
                cands.append((run.t + max(0.0, prog - run.progress) * step, what))
    else:
        cands.append((run.t + run.pending[0][1], "phase"))
    return min(cands, key=lambda c: c[0])


def _handle(run: "_Run", what: str, target: float, sched: deque, policy: Policy, p: Params) -> None:
    if what == "fail":
        run.random_failure()
        run.next_fail = run.t + run.rng.expovariate(run.fail_rate)
    elif what == "rejoin":
        _, gen, slot = heapq.heappop(run.rejoins)
        if gen == run.generation and slot in run.failed_slots and not run.done:
            del run.failed_slots[slot]
            run.active.add(slot)
    elif what == "phase":
        run._phase_done()
    elif what == "replaced":
        heapq.heappop(run.replacements)
        run.consider_regrow()
    elif what == "regrow":
        run.progress, run.regrow_at = run.regrow_at, math.inf
        run.res.regrows += 1
        run._push("regrow", run._relaunch_s(), run._regrow_slots() * run.c.ranks_per_replica)
        run._event("regrow: relaunch at full width")
    elif what == "target":
        run.progress = target
        run._push("exit", run.exit_s(), run.job_procs())
    elif what == "ckpt":
        run.progress = run.next_ckpt
        run.next_ckpt += policy.checkpoint_interval or math.inf
        run._push("save", p.ckpt_stall_s(policy.recover_path), run.job_procs())
    elif what == "sched":
        run.progress = max(run.progress, sched[0].step)
        run.scheduled_failure(sched.popleft())


def failure_free_rate(cluster: Cluster, policy: Policy, p: Params) -> float:
    """Tokens per second of ``policy`` without failures, checkpoints included, startup excluded."""
    c = replace(cluster, spare_replicas=policy.spare_replicas)
    step = p.step_s(p.accumulation, c.slots * c.ranks_per_replica, c.pp, recover=policy.recover_path)
    tokens = c.replicas * p.accumulation * p.tokens_per_microbatch
    k = policy.checkpoint_interval
    per_step = step + (p.ckpt_stall_s(policy.recover_path) / k if k else 0.0)
    return tokens / per_step
