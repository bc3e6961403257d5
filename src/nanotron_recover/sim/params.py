"""Every number the simulator uses, named, with where it comes from.

A prediction is only as good as its inputs, so each input is a named parameter carrying its source:
``measured`` (read from one of our runs by :mod:`nanotron_recover.sim.calibrate`), ``anchor`` (a published
figure), or ``assumption`` (a guess the user should replace). Results are always printed together with this
table (:func:`describe`), never alone.

The scaling models (how a cost measured on 8 processes grows to 100k GPUs) are explicit formulas here:

* step time: ``base_s + (quota + bubble) * mb_s * share``: a replica's step runs its quota of microbatches plus
  the pipeline bubble (``pp - 1`` microbatch slots in 1F1B); the step waits for the slowest replica (largest
  quota). ``share = max(1, processes / devices)`` models processes sharing devices (our 2-core CPU runs 8
  processes: losing processes does not lose compute there); on GPUs ``devices`` is None and ``share`` is 1.
* in-place repair (ULFM revoke + shrink + agree + rebuild): ``repair_s * log2(ranks) / log2(repair_ranks)``.
* restart of a job: ``restart_fixed_s + restart_per_node_s * nodes + ckpt_load_s`` (+ ``restart_per_process_s
  * processes`` where processes share devices, as on our 2-core CPU; the same for ``exit_s``).
* checkpoint save / load: ``ckpt_fixed_s + state_gb_per_rank / storage_gb_per_s`` (ranks write in parallel).
  A ReCoVer save in the background (``ckpt_async``, the default as coded) stalls the step only for the host copy:
  ``state_gb_per_rank / host_copy_gb_per_s`` (``ckpt_stall_s``); a save before a planned stop, and stock's, are
  written in the step.
* state transfer to a spare: ``state_gb_per_rank / transfer_gb_per_s`` (ranks send in parallel).
* a recycled replica's formation (world split, torch rendezvous, model build; the job waits at the step
  boundary): ``formation_s``, then the state transfer as for a spare.
* regrow (issue #40: a planned relaunch at full width from a node-local snapshot of the last step): warm, onto a
  standby that has started its processes: ``warm_relaunch_s + warm_relaunch_per_node_s * nodes``; cold, a new
  ``mpirun``: ``cold_relaunch_s``, or where that is None the restart model above (``job_exit_s + restart_s``, ~10 min
  at 100k GPUs: the FT-HSDP anchor). Regrowing pays when the relaunch costs less than what running degraded costs
  until the next failure (``regrow_mtbf_hours``, default the job MTTF): ``relaunch < T * (1 - step_full /
  step_now)`` (:func:`nanotron_recover.sim.regrow.decide`). A lost replica's slot stays out of the relaunch until
  its hardware is replaced, ``regrow_replacement_hours`` after the loss (None: as a crash's relaunch, at once with
  ``replacement``, the scheduler's swap or a spare node in the allocation; else after ``hw_repair_hours``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

__all__ = ["Params", "describe", "MTTF_ANCHORS", "mttf_hours_at", "LLAMA3_MTBF_HOURS"]

# Job mean time to failure vs job size, arXiv 2410.21680 (Kokolis et al., "Revisiting Reliability in Large-Scale
# ML Research Clusters"): (GPUs, hours).
MTTF_ANCHORS: tuple[tuple[int, float], ...] = ((1024, 7.9), (16384, 1.8), (131072, 14.0 / 60.0))
# Llama 3 (arXiv 2407.21783): 419 unexpected interruptions in 54 days on 16,384 GPUs.
LLAMA3_MTBF_HOURS = 54 * 24 / 419


def mttf_hours_at(gpus: int, anchors: tuple[tuple[int, float], ...] = MTTF_ANCHORS) -> float:
    """Job MTTF at ``gpus``: log-log interpolation between the anchors (power law), extrapolated with the nearest
    segment's slope outside them. Why not 1/N: the anchors themselves are not 1/N (8,090 GPU-hours per failure at
    1k GPUs, 29,500 at 16k), so a single per-GPU rate would miss one end or the other."""
    pts = sorted(anchors)
    if gpus <= 0:
        raise ValueError("gpus must be positive")
    if len(pts) == 1:
        n, h = pts[0]
        return h * n / gpus
    i = 0
    while i < len(pts) - 2 and gpus > pts[i + 1][0]:
        i += 1
    (n0, h0), (n1, h1) = pts[i], pts[i + 1]
    slope = math.log(h1 / h0) / math.log(n1 / n0)
    return h0 * (gpus / n0) ** slope


@dataclass(frozen=True)
class Params:
    """Costs and failure rates of one run. Times in seconds unless the name says otherwise."""

    # -- workload
    accumulation: int = 4  # microbatches per replica per step failure-free: M = replicas x accumulation
    tokens_per_microbatch: int = 4 * 4096  # micro-batch size x sequence length
    mb_s: float = 0.5  # one microbatch's forward + backward on one replica (pipeline slot)
    base_s: float = 0.5  # per-step fixed part (gradient reduction, optimizer)
    devices: int | None = None  # devices shared by all processes (a CPU's cores); None: one device per process
    recover_step_factor: float = 1.0  # ReCoVer path step time / stock path step time, failure-free
    # -- failures
    job_mttf_hours: float | None = None  # None: from MTTF_ANCHORS at the job's GPU count
    node_fraction: float = 0.2  # share of failures that take a whole node (host, NIC, switch, maintenance)
    hang_fraction: float = 0.5  # share of GPU faults that freeze a process instead of killing it
    # -- in-place recovery (ReCoVer, shrinking batch)
    detect_s: float = 0.15  # a killed process -> repair starts (ULFM failure notice)
    hang_timeout_s: float = 30.0  # a frozen process -> killed by the hang monitor (code default max(30 s, 5 steps))
    repair_s: float = 0.03  # revoke + shrink + agree + rebuild at repair_ranks ranks
    repair_ranks: int = 8
    state_gb_per_rank: float = 10.0  # parameters + fp32 masters + Adam moments held by one rank
    transfer_gb_per_s: float = 25.0  # per-rank state transfer bandwidth (spare activation, rejoin)
    rejoin_s: float = 1800.0  # shrinking batch (torchft-style): failure -> a replacement replica rejoins
    formation_s: float = 30.0  # recycling: pooled ranks -> a built replica (the state transfer comes on top)
    # -- checkpoint-restart
    ckpt_fixed_s: float = 5.0
    storage_gb_per_s: float = 2.0  # per-rank checkpoint write / read bandwidth
    ckpt_async: bool = True  # ReCoVer's periodic saves are written in the background (checkpoints.async_save)
    host_copy_gb_per_s: float = 20.0  # per-rank copy of the state to pinned host memory (what an async save stalls)
    # the disk checkpoint's cadence with node-local snapshots on (optimal.recover_interval_s): a relaunch reads it
    # only when every copy of the committed state is lost at once
    all_snapshots_lost_hours: float = 168.0
    ckpt_max_interval_hours: float = 1.0  # at most this much training between two disk checkpoints
    ckpt_min_interval_s: float = 60.0  # at least this long between two (and never less than one save's write)
    teardown_s: float = 30.0  # failure -> the job is gone (collective timeout, scheduler notices)
    restart_fixed_s: float = 120.0  # relaunch -> training again, without the per-node part and the load
    restart_per_process_s: float = 0.0  # shared devices only (a CPU): processes' imports compete for the cores
    # anchor: FT-HSDP ~10 min stall at ~100K GPUs: (600 - 30 - 120 - 10) s / 12.5k nodes
    restart_per_node_s: float = 0.035
    startup_s: float | None = None  # the first launch (None: as a restart)
    exit_s: float = 0.0  # last step -> job gone (the allocation is held until then)
    exit_per_process_s: float = 0.0  # shared devices only
    exit_after_failure_s: float | None = None  # ReCoVer path once a failure happened: it skips MPI_Finalize
    failure_during_stall: str = "queue"  # queue: each failure costs its full stall, served one after the other
    #                                    # (a failure during a restart is found when that restart completes);
    #                                    # reset: the stall restarts from the new failure
    replacement: bool = True  # a relaunch gets a full-size allocation (the scheduler swaps failed nodes)
    hw_repair_hours: float = 8.0  # replacement off: a failed GPU / node is usable again after this long
    # -- regrow (issue #40): back to full width at a step boundary, when it pays (module docstring)
    warm_relaunch_s: float = 1.5  # warm standby: the fixed part of step boundary -> training at full width
    warm_relaunch_per_node_s: float = 0.0024  # warm standby: the part that grows with nodes (communicator set-up)
    cold_relaunch_s: float | None = None  # no standby; None: job_exit_s + restart_s (the restart model)
    regrow_mtbf_hours: float | None = None  # horizon of the decision; None: the job MTTF
    regrow_replacement_hours: float | None = None  # a lost slot is back for a regrow after; None: replacement_s()
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def with_(self, source: str | None = None, **changes: Any) -> "Params":
        """A copy with ``changes``; each changed name is recorded with ``source`` (if given)."""
        src = dict(self.sources)
        if source is not None:
            src.update({k: source for k in changes})
        return replace(self, sources=src, **changes)

    # -- scaling models (module docstring)
    def step_s(self, quota: int, processes: int, pp: int = 1, recover: bool = False) -> float:
        share = max(1.0, processes / self.devices) if self.devices else 1.0
        t = self.base_s + (quota + (pp - 1)) * self.mb_s * share
        return t * (self.recover_step_factor if recover else 1.0)

    def repair_at(self, ranks: int) -> float:
        return self.repair_s * math.log2(max(2, ranks)) / math.log2(max(2, self.repair_ranks))

    def ckpt_save_s(self) -> float:
        return self.ckpt_fixed_s + self.state_gb_per_rank / self.storage_gb_per_s

    def ckpt_stall_s(self, recover_path: bool) -> float:
        """What a periodic save costs the step: the host copy of a background save (ReCoVer with ``ckpt_async``), or
        the whole write."""
        if recover_path and self.ckpt_async:
            return self.state_gb_per_rank / self.host_copy_gb_per_s
        return self.ckpt_save_s()

    def ckpt_load_s(self) -> float:
        return self.ckpt_save_s()

    def restart_s(self, nodes: int, processes: int = 0, load: bool = True) -> float:
        """A relaunch (``load``: from a checkpoint; the first launch loads nothing)."""
        shared = self.restart_per_process_s * processes if self.devices else 0.0
        return self.restart_fixed_s + self.restart_per_node_s * nodes + shared + (self.ckpt_load_s() if load else 0.0)

    def job_exit_s(self, processes: int, recover_after_failure: bool = False) -> float:
        if recover_after_failure and self.exit_after_failure_s is not None:
            return self.exit_after_failure_s
        return self.exit_s + (self.exit_per_process_s * processes if self.devices else 0.0)

    def transfer_s(self) -> float:
        return self.state_gb_per_rank / self.transfer_gb_per_s

    def relaunch_s(self, nodes: int, processes: int, warm: bool) -> float:
        """A planned relaunch at a step boundary (regrow): onto a warm standby or cold (a new ``mpirun``)."""
        if warm:
            return self.warm_relaunch_s + self.warm_relaunch_per_node_s * nodes
        if self.cold_relaunch_s is not None:
            return self.cold_relaunch_s
        return self.job_exit_s(processes) + self.restart_s(nodes, processes)

    def regrow_horizon_s(self, gpus: int) -> float:
        return (self.regrow_mtbf_hours if self.regrow_mtbf_hours is not None else self.mttf_hours(gpus)) * 3600.0

    def replacement_s(self) -> float:
        """A lost slot's hardware -> in the allocation again, for a regrow: ``regrow_replacement_hours``; where None,
        as a crash's relaunch (``replacement``: at once, else after ``hw_repair_hours``)."""
        if self.regrow_replacement_hours is not None:
            return self.regrow_replacement_hours * 3600.0
        return 0.0 if self.replacement else self.hw_repair_hours * 3600.0

    def mttf_hours(self, gpus: int) -> float:
        return self.job_mttf_hours if self.job_mttf_hours is not None else mttf_hours_at(gpus)


_DEFAULT_SOURCES = {
    "job_mttf_hours": "anchor: arXiv 2410.21680 (7.9 h @1k, 1.8 h @16k, 14 min @131k GPUs), log-log interpolated",
    "node_fraction": "assumption: host/network/maintenance causes are a minority of Llama 3's interruptions",
    "hang_fraction": "assumption (not measured): frozen instead of killed",
    "hang_timeout_s": "code default: hang_timeout_s = max(30 s, 5 x longest step)",
    "restart_per_node_s": "anchor: FT-HSDP (arXiv 2602.00277) ~10 min stall per failure at ~100K GPUs",
    "failure_during_stall": "model choice: FT-HSDP's 44%/80% read as 1 - stall/MTBF",
    "replacement": "model choice: the scheduler hands back a full allocation on relaunch",
    "warm_relaunch_s": "assumption (target of issue #40 on the 2-core CPU; benchmarks/relaunch_bench.py will "
                       "measure it): a standby's processes have started, imported torch and joined the runtime",
    "warm_relaunch_per_node_s": "assumption: at scale the warm relaunch is the communicator set-up and the "
                                "snapshot read; MegaScale (arXiv 2402.15627) initialises >10,000 GPUs in < 30 s, "
                                "so 30 s at 12.5k nodes (100k GPUs), linear in nodes (pessimistic for a tree)",
    "cold_relaunch_s": "None: the restart model (restart_fixed_s + restart_per_node_s x nodes + load = ~10 min at "
                       "100k GPUs, FT-HSDP's anchor); measured on the 2-core CPU: launch -> first step 6.5 / 5.0 / "
                       "5.6 s (benchmarks/results/vs_torchft_clockwork.json, ReCoVer, T = 10 / 20 / 40 s)",
    "regrow_mtbf_hours": "None: the job MTTF (issue #40: the expected time to the next failure)",
    "regrow_replacement_hours": "assumption, None: as a crash's relaunch (replacement: a spare node in the "
                                "allocation or the scheduler's swap, at once; else hw_repair_hours); 8 h: regrow "
                                "only brings back what was repaired",
    "host_copy_gb_per_s": "assumption: device to pinned host memory over PCIe Gen4/5, per GPU; measured on the "
                          "2-core CPU: the stall of a background save (benchmarks/async_checkpoint.py)",
    "all_snapshots_lost_hours": "assumption: every node-local copy of the committed state lost at once (a "
                                "cluster-wide outage, the job's nodes all wiped): about once a week",
    "ckpt_min_interval_s": "model choice: a save's files and metadata on shared storage at most once a minute; "
                           "and the next save never waits for the one in flight (ckpt_save_s)",
    "ckpt_max_interval_hours": "model choice: the most training a person accepts to redo after such a loss, and "
                               "the age of the newest model on shared storage",
    "formation_s": "assumption: NCCL communicator set-up and model build of a new replica at scale; measured "
                   "0.111 s on the 2-core CPU (12 ranks, benchmarks/recycle_bench.py formed -> active, transfer "
                   "included)",
}


def describe(p: Params, gpus: int | None = None, pp: int = 1, gpus_per_node: int = 8) -> list[tuple[str, str, str]]:
    """(name, value, source) for every parameter, derived costs included: what a result was computed from."""
    rows: list[tuple[str, str, str]] = []
    for f in fields(p):
        if f.name == "sources":
            continue
        v = getattr(p, f.name)
        if f.name == "job_mttf_hours" and v is None and gpus:
            v = f"{p.mttf_hours(gpus):.3g} (at {gpus} GPUs)"
        src = p.sources.get(f.name) or _DEFAULT_SOURCES.get(f.name) or "assumption (default)"
        rows.append((f.name, f"{v:.4g}" if isinstance(v, float) else str(v), src))
    rows += [
        ("= ckpt_save_s", f"{p.ckpt_save_s():.4g}", "ckpt_fixed_s + state_gb_per_rank / storage_gb_per_s"),
        ("= ckpt_stall_s (ReCoVer)", f"{p.ckpt_stall_s(True):.4g}",
         "state_gb_per_rank / host_copy_gb_per_s (ckpt_async), else ckpt_save_s"),
        ("= transfer_s", f"{p.transfer_s():.4g}", "state_gb_per_rank / transfer_gb_per_s"),
    ]
    if gpus:
        nodes = math.ceil(gpus / gpus_per_node)
        rows.append(("= restart_s", f"{p.restart_s(nodes):.4g}",
                     f"at {nodes} nodes of {gpus_per_node}: fixed + per node + load"))
        rows.append(("= repair_s at job", f"{p.repair_at(gpus):.4g}", "repair_s x log2(ranks) / log2(repair_ranks)"))
        for mode in ("warm", "cold"):
            rows.append((f"= {mode} relaunch at job", f"{p.relaunch_s(nodes, gpus, mode == 'warm'):.4g}",
                         f"regrow's {mode} relaunch at {nodes} nodes"))
    return rows
