"""The pure side of the randomized fault campaign: shapes, fault kinds, and a trial drawn from a seed.

A trial is fully determined by its seed: the shape, the fault kind and every parameter of the fault (which rank,
which step, which phase, how long after the step was logged). So any trial reruns alone from its seed
(``benchmarks/fault_campaign.py --seed S --trials 1``). Nothing here starts a process.
"""

from __future__ import annotations

import copy
import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any

from benchmarks.lib.config import make_config, n_processes, ranks_per_replica

STEPS = 8
ACCUMULATION = 2
CHECKPOINT_INTERVAL = 4  # a checkpoint mid-run (the checkpoint phase) and one at the end (the final weights)

# Timeouts a trial runs with: short, so that a frozen rank costs seconds, not minutes; far above a step here.
FAULT_TOLERANCE: dict[str, Any] = {
    "enabled": True, "reduce_bucket_mb": 0.01, "hang_timeout_s": 12, "collective_timeout_s": 40,
    "startup_timeout_s": 90, "finalize_timeout_s": 20, "local_snapshot_interval": 1,
}


@dataclass(frozen=True)
class Shape:
    """One job layout of the campaign (each at most 6 processes: 2 cores)."""

    name: str
    dp: int
    tp: int = 1
    pp: int = 1
    spares: int = 0
    recycle: bool = False
    fsdp: int | None = None  # HSDP: the shard group size
    dtype: str = "float32"
    data_plane: str | None = None  # fault_tolerance.data_plane (None: the default, auto)
    defaults: bool = False  # the timeouts and snapshot interval a user gets, not the campaign's short ones
    steps: int = STEPS  # the run's length (the faults still come in the first STEPS steps, or later: see the harness)

    def config(self, inject: list[dict], snapshot_dir: str, settings: dict | None = None) -> dict:
        base = {"enabled": True} if self.defaults else copy.deepcopy(FAULT_TOLERANCE)
        ft = {**base, "spare_replicas": self.spares, "recycle": self.recycle, "inject": inject,
              "local_snapshot_dir": snapshot_dir, **(settings or {})}
        if self.data_plane is not None:
            ft["data_plane"] = self.data_plane
        if self.fsdp is not None:
            ft.update(replica="fsdp", fsdp_shard_size=self.fsdp)
        config = make_config(dp=self.dp, tp=self.tp, pp=self.pp, accumulation=ACCUMULATION, steps=self.steps,
                             fault_tolerance=ft, checkpoint_interval=CHECKPOINT_INTERVAL)
        config["model"]["dtype"] = self.dtype
        return config

    @property
    def M(self) -> int:
        return self.dp * ACCUMULATION

    @property
    def rpr(self) -> int:
        return ranks_per_replica(self.config([], "/dev/null"))

    @property
    def world_size(self) -> int:
        return n_processes(self.config([], "/dev/null"))

    @property
    def replicas(self) -> int:
        return self.dp + self.spares

    @property
    def forms(self) -> bool:
        """Whether two broken replicas' survivors can form a new one here: recycling, two-rank replicas (each
        broken one leaves one survivor) and a third replica that stays whole."""
        return self.recycle and self.rpr == 2 and self.replicas >= 3

    def with_recycle(self, on: bool) -> Shape:
        """This shape with recycling switched on or off (the name says so when it differs from the shape's own)."""
        if on == self.recycle:
            return self
        return dataclasses.replace(self, name=f"{self.name}{'+recycle' if on else '-recycle'}", recycle=on)

    def with_defaults(self) -> Shape:
        """This shape with the settings a user gets (hang timeout derived from the steps, 60-s collectives, 600-s
        start-up, automatic snapshots); the name says so."""
        return dataclasses.replace(self, name=f"{self.name}+defaults", defaults=True)

    def with_steps(self, steps: int) -> Shape:
        """This shape trained for ``steps`` steps (long enough for a warm standby to get ready); the name says so."""
        return self if steps == self.steps else dataclasses.replace(self, name=f"{self.name}+{steps}steps",
                                                                     steps=steps)

    def with_data_plane(self, plane: str) -> Shape:
        """This shape with its gradient bytes on ``plane`` (``mpi`` or ``torch``; the name says which)."""
        return dataclasses.replace(self, name=f"{self.name}+{plane}", data_plane=plane)

    @property
    def nodes(self) -> list[int]:
        """The slots of each fake node when a trial runs on the bed: one replica per node."""
        return [self.rpr] * self.replicas


SHAPES = (
    Shape("3d-tp2", dp=2, tp=2),
    Shape("3d-pp2", dp=2, pp=2),
    Shape("spare", dp=2, spares=1),
    Shape("recycle", dp=3, tp=2, recycle=True),
    Shape("hsdp", dp=2, fsdp=2),
    Shape("bf16", dp=2, tp=2, dtype="bfloat16"),
)
SHAPES_BY_NAME = {s.name: s for s in SHAPES}

# Fault kinds. "ext-*" are signals sent from outside, by pid, at a random moment; the others are schedules in the
# config (``fault_tolerance.inject``), fired by the rank itself at a named phase.
KINDS = ("ext-kill", "ext-stop", "startup-kill", "startup-stop", "pair-same-replica", "pair-two-replicas",
         "second-in-repair", "phase", "hang", "launcher-kill", "launcher-stop", "node-loss", "checkpoint-damage",
         "non-finite", "save", "fallback-save", "startup-window")
# "save": a kill or a freeze inside a save (a writer's part written; or renamed but latest.txt not written), at the
# mid-run interval save or in the final save. "fallback-save": fewer than min_replicas left (min_replicas = dp),
# then a death in the holder's fallback save of the last committed step. "startup-window": a death right after the
# start-up agreement, before the hang monitor's collective start (the job must end with exit 3, then finish).
# "checkpoint-damage": the finished run's final checkpoint is damaged (one file of a kind, flipped or cut short);
# the relaunch must fall back to the previous intact checkpoint and train to the same weights.
# "non-finite": one microbatch of a step is poisoned (signal nan); the job must end for a person (exit 2) with
# nothing of that step committed, and the relaunch with the fault removed must finish on the failure-free losses.
DAMAGED_FILES = ("weights", "optimizer", "lr_scheduler", "trainer_state")
PHASES = ("dataload", "forward", "backward", "reduce", "optimizer", "checkpoint")


@dataclass
class ExternalFault:
    """A signal sent from outside: to world rank ``ranks`` (or to mpirun when ``ranks`` is empty), ``delay_s``
    after step ``after_step`` was logged (0: during start-up, ``delay_s`` after the rank processes appeared)."""

    signal: str  # "kill" | "stop" | "node" (the fake node ``node`` lost whole: its daemon and its ranks)
    ranks: list[int]
    after_step: int
    delay_s: float
    node: str | None = None

    def describe(self) -> str:
        if self.node is not None:
            return f"node {self.node} lost {self.delay_s:.2f} s after step {self.after_step}"
        whom = f"ranks {self.ranks}" if self.ranks else "mpirun"
        when = f"step {self.after_step}" if self.after_step else "start-up"
        return f"SIG{self.signal.upper()} {whom} {self.delay_s:.2f} s after {when}"


@dataclass
class Trial:
    seed: int
    shape: Shape
    kind: str
    inject: list[dict] = field(default_factory=list)
    external: list[ExternalFault] = field(default_factory=list)
    damage: dict | None = None  # checkpoint-damage: {"file": one of DAMAGED_FILES, "how": "flip" | "truncate"}
    settings: dict = field(default_factory=dict)  # fault_tolerance settings this trial needs (and why: its kind)

    def frozen_ranks(self) -> set[int] | None:
        """World ranks this trial freezes or hangs (a hang kill of any other rank is a false kill); None when one
        is a recycled replica's rank, whose world rank is known only at run time."""
        ranks = {r for f in self.external if f.signal == "stop" for r in f.ranks}
        for spec in self.inject:
            if spec.get("signal") in ("stop", "hang"):
                if spec["replica"] >= self.shape.replicas:
                    return None
                ranks.add(spec["replica"] * self.shape.rpr + spec.get("rank", 0))
        return ranks

    def on_bed(self) -> bool:
        """Whether the trial runs on the fake-node bed (one replica per node)."""
        return any(f.node is not None for f in self.external)

    def describe(self) -> str:
        parts = [f"{s.get('signal', 'kill')} r{s['replica']}.{s.get('rank', 0)} step {s['step']} {s['phase']}"
                 for s in self.inject] + [f.describe() for f in self.external]
        if self.damage is not None:
            parts.append(f"final checkpoint's {self.damage['file']} {self.damage['how']}")
        return "; ".join(parts)


def _fits(kind: str, shape: Shape) -> bool:
    """Kinds a shape can take: two ranks of one replica need two; a second fault in another replica's repair needs
    a third replica (a schedule that kills every replica is refused by the config check)."""
    if kind == "pair-same-replica":
        return shape.rpr > 1
    if kind == "second-in-repair":
        return shape.replicas > 2
    if kind == "fallback-save":  # below min_replicas (= dp) with a holder left after the writer's death: no spare
        return shape.dp > 2 and not shape.spares
    return True


def _rank_in(rng: random.Random, shape: Shape, replica: int) -> int:
    return replica * shape.rpr + rng.randrange(shape.rpr)


def draw_trial(seed: int, shapes: tuple[Shape, ...] = SHAPES, kinds: tuple[str, ...] = KINDS) -> Trial:
    """The trial of ``seed``: a shape, a kind, and the fault's parameters, all from one ``random.Random(seed)``."""
    rng = random.Random(seed)
    shape = rng.choice(shapes)
    kind = rng.choice([k for k in kinds if _fits(k, shape)])
    trial = Trial(seed, shape, kind)
    step = rng.randrange(2, STEPS - 1)  # a fault after the first step and before the last
    replica = rng.randrange(shape.dp)  # a computing replica
    local = rng.randrange(shape.rpr)
    if kind in ("ext-kill", "ext-stop"):
        trial.external.append(ExternalFault(kind[4:], [_rank_in(rng, shape, rng.randrange(shape.replicas))],
                                            step - 1, rng.uniform(0.0, 0.1)))
    elif kind in ("startup-kill", "startup-stop"):
        trial.external.append(ExternalFault(kind[8:], [rng.randrange(shape.world_size)], 0, rng.uniform(0.0, 4.0)))
    elif kind == "pair-same-replica":
        trial.external.append(ExternalFault("kill",
                                            rng.sample(range(replica * shape.rpr, (replica + 1) * shape.rpr), 2),
                                            step - 1, rng.uniform(0.0, 0.1)))
    elif kind == "pair-two-replicas":
        first, second = rng.sample(range(shape.replicas), 2)
        trial.external.append(ExternalFault("kill", [_rank_in(rng, shape, first), _rank_in(rng, shape, second)],
                                            step - 1, rng.uniform(0.0, 0.1)))
    elif kind == "second-in-repair":
        other = rng.choice([r for r in range(shape.replicas) if r != replica])
        trial.inject += [{"step": step, "replica": replica, "rank": local, "phase": rng.choice(("backward", "reduce"))},
                         {"step": step, "replica": other, "rank": rng.randrange(shape.rpr), "phase": "repair"}]
    elif kind == "phase":
        trial.inject += _phase_fault(rng, shape, step, replica, local)
    elif kind == "hang":
        trial.inject.append({"step": step, "replica": replica, "rank": local, "signal": "hang",
                             "phase": rng.choice(("forward", "backward", "optimizer"))})
    elif kind in ("launcher-kill", "launcher-stop"):
        trial.external.append(ExternalFault(kind[9:], [], step - 1, rng.uniform(0.0, 0.1)))
    elif kind == "node-loss":  # one replica per fake node; any node, the one holding the logging rank included
        trial.external.append(ExternalFault("node", [], step - 1, rng.uniform(0.0, 0.1),
                                            node=f"n{rng.randrange(shape.replicas) + 1}"))
    elif kind == "checkpoint-damage":
        trial.damage = {"file": rng.choice(DAMAGED_FILES), "how": rng.choice(("flip", "truncate")),
                        "seed": rng.randrange(2**31)}
    elif kind == "non-finite":
        trial.inject.append({"step": step, "replica": replica, "rank": local, "phase": "forward", "signal": "nan"})
    else:
        _save_or_startup_fault(rng, trial, kind)
    return trial


def _save_or_startup_fault(rng: random.Random, trial: Trial, kind: str) -> None:
    """The kinds that hit a save or the start-up window (the writer is the lowest replica holding the state: 0)."""
    shape = trial.shape
    if kind == "save":
        trial.inject.append({"step": rng.choice((CHECKPOINT_INTERVAL, STEPS)), "replica": 0,
                             "rank": rng.randrange(shape.rpr), "signal": rng.choice(("kill", "kill", "stop")),
                             "phase": rng.choice(("checkpoint-write", "checkpoint-publish"))})
    elif kind == "fallback-save":  # every replica is needed; one lost at `lost`, the holders save `lost - 1`
        lost = rng.choice([s for s in range(3, STEPS) if (s - 1) % CHECKPOINT_INTERVAL])  # no interval save there
        trial.settings["min_replicas"] = shape.dp
        trial.inject += [{"step": lost, "replica": shape.dp - 1, "rank": rng.randrange(shape.rpr),
                          "phase": "backward"},
                         {"step": lost - 1, "replica": 0, "rank": rng.randrange(shape.rpr),
                          "phase": "checkpoint-write"}]
    elif kind == "startup-window":
        trial.inject.append({"step": 0, "replica": rng.randrange(shape.replicas), "rank": rng.randrange(shape.rpr),
                             "phase": "startup", "at": "agreed"})


def _phase_fault(rng: random.Random, shape: Shape, step: int, replica: int, local: int) -> list[dict]:
    """A kill (or a freeze) in a named phase; with a spare or recycling also inside a state transfer (after the
    fault that starts it), with recycling as a formation begins."""
    phases = list(PHASES)
    two_broken = shape.forms and not shape.spares  # a transfer to a formed replica, not to a spare
    if shape.spares or two_broken:
        phases.append("transfer")
    if shape.forms:
        phases.append("forming")
    phase = rng.choice(phases)
    signal = rng.choice(("kill", "kill", "stop"))
    if phase == "checkpoint":
        return [{"step": CHECKPOINT_INTERVAL, "replica": replica, "rank": local, "phase": phase, "signal": signal}]
    if phase == "transfer":  # replica 1 lost in backward makes a transfer at the step's end: hit a side of it
        lost = [{"step": step, "replica": 1, "rank": local, "phase": "backward"}]
        if two_broken:  # a second broken replica: the pool holds a replica's worth of ranks, which form one
            lost.append({"step": step, "replica": 2, "rank": 1 - local, "phase": "backward"})
        receiver = shape.dp  # the spare's id (dp), or the first recycled replica's (dp + 0 spares)
        side = rng.choice((0, receiver))  # the donor (the only holder of the committed state) or the receiver
        return [*lost, {"step": step, "replica": side, "rank": rng.randrange(shape.rpr), "phase": "transfer",
                        "signal": signal}]
    if phase == "forming":  # two broken replicas, then a pool rank dies as the formation begins
        return [{"step": step, "replica": 1, "rank": 0, "phase": "backward"},
                {"step": step, "replica": 2, "rank": 1, "phase": "backward"},
                {"step": step, "replica": 1, "rank": 1, "phase": "forming"}]
    return [{"step": step, "replica": replica, "rank": local, "phase": phase, "signal": signal}]
