"""Node-local snapshots of each rank's committed state: a relaunch continues from the newest committed step.

Why: on this Open MPI a node's loss ends the whole ``mpirun`` (README, "Running on many nodes"), and a relaunch
from the last disk checkpoint recomputes every step since. But replicas are identical after each commit, so the
ranks on the other nodes still hold, together, a full copy of the state of the last committed step. Each rank
writes its state (parameters, fp32 masters in bf16, Adam, LR scheduler, step) after the committed steps that
:mod:`~nanotron_recover.snapshots.schedule` picks (``fault_tolerance.local_snapshot_interval``: fixed, or
``auto`` from the measured write cost) to memory-backed storage on its node; a relaunch
agrees on the newest snapshot for which every coordinate of a replica has a copy somewhere and loads it (ranks
whose node has none receive it over MPI from one that has, chunk by chunk).

**Histories.** Every launch is a *history* (an id agreed at start-up: the launch time in hex, then random hex).
Within one history a (coordinate, step) has one content (the replicas are identical after each commit); across
histories it need not (another replica count sums in another order). So a file is named and keyed by (coordinate,
history, step), the relaunch agrees on one (history, step) for every rank, and deletes on its nodes every file
newer than it (and the other histories' files of that step). The new launch writes under its own history, so it
never overwrites the file it resumed from; it deletes a previous history's files of its coordinate only once it
holds :data:`KEEP` of its own. The agreed files are checksummed *before* any rank touches its state: a damaged
one is deleted and the agreement runs again without it (no restart loop on a bad file).

**The store is private** (per user; nothing read from it runs code): the base folder must be a real folder owned
by this user (created 0700; looser modes are tightened), files are 0600, opened without following links and
checked for owner and mode; anything else is refused with a message and snapshots go off on that rank. The file
format is a fixed binary header and JSON, never pickle::

    b"NRSNAP03" | u32 header length | u64 xxh3-64 of the header JSON | header JSON (run, config, history, step,
    coordinate, tensors, payload checksum, extras) | payload (the raw bytes of the state tensors, in ``state_tensors``
    order)

Both checksums are checked before anything of a file is used: the header's as it is read (a mismatch deletes the
file at the scan), the payload's at the agreement.

**Full storage never ends the run.** A file is written as ``<name>.tmp`` and renamed into place only when
complete; older files go only after that. If a write fails (``ENOSPC``), the partial file is removed, a message
says so at once, and this rank's snapshots turn off (its older complete ones stay usable); ``finish`` never raises.
At a relaunch every node checks its own free space for its ranks (the launcher can check only its own host).
Snapshot folders of other runs of this user untouched for three days (crashed runs; the launch may say another age)
are deleted.

**Bounded memory at a relaunch.** A rank that lacks its coordinate's snapshot receives it piece by piece
(:data:`CHUNK_BYTES`) straight into its state tensors; a sender reads each piece once for all of its receivers, and
the receivers of one coordinate are spread over its holders (``benchmarks/snapshot_resume_memory_bench.py``).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import torch

from nanotron_recover.run.launch_contract import LaunchContract
from nanotron_recover.run.run_folder import ensure_run_id
from nanotron_recover.snapshots.catalog import _FILE, SUFFIX, Key, Snapshot, by_key, scan
from nanotron_recover.snapshots.format import _raw_bytes, extras_of, payload_checksum, verify_file
from nanotron_recover.snapshots.relaunch import Loaded, _stream, choose_snapshot, resumed_line, transfer_plan
from nanotron_recover.snapshots.settings import SnapshotSettings
from nanotron_recover.snapshots.store import (
    _say,
    config_hash,
    new_history_id,
    private_tree,
    remove_folder,
    remove_stale_runs,
    reserved_bytes,
    snapshot_folder,
)
from nanotron_recover.snapshots.writer import KEEP, SnapshotWriter


def _group_settings(optimizer: Any) -> list[dict]:
    """The optimizer's per-group settings (lr, betas, ...), without the parameters."""
    from nanotron_recover.training.training_state import torch_optimizer

    return [{k: v for k, v in group.items() if k != "params"} for group in torch_optimizer(optimizer).param_groups]


class Hello(NamedTuple):
    """What each rank tells the world at a relaunch (one ``allgather_object``)."""

    proposal: str  # a history id for this launch: the lowest live rank's wins
    rank: int  # its world rank (plans index the gathered list; transfers address world ranks)
    coord: int
    node: str | None  # None: this rank's store was refused
    payload_bytes: int  # the size of this rank's snapshots
    offers: list  # (coord, history, step, header bytes, file bytes) of each snapshot file found on its node


class LocalSnapshots:
    """One rank's side of node-local snapshots: write after commits, resume at (re)launch, clean up at the end.

    ``ft`` is the rank's :class:`~nanotron_recover.ft.FTWorld` (its ``allgather_object`` and ``exchange_bytes``
    carry the agreement and the transfers; ``allgather_object`` unpickles what the peers send: acceptable, they are
    ranks of this job, unlike the files, which are never unpickled); a coordinate is the rank's index inside its
    replica (TP x PP position, or HSDP shard index), the same in every replica and in every launch of the run.
    A rank whose store is refused (another user's folder, a bad run id) still takes part in the agreement (it may
    receive its state) but writes nothing.
    """

    def __init__(self, settings: SnapshotSettings, *, config_hash: str, ranks_per_replica: int, run_dir: Path,
                 ft: Any, replica: int, coord: int, log: Callable[[str], None] = print) -> None:
        self.settings = settings  # on or off, the folder, the budget; which steps: the SnapshotSchedule
        self.config_hash = config_hash  # the run's identity in every file: another config's snapshots are refused
        self.coords = range(ranks_per_replica)
        self.ft, self.replica, self.coord, self.log = ft, replica, coord, log
        self.base = self.settings.folder
        self.history: str | None = None
        self._writer: SnapshotWriter | None = None
        self.off_reason: str | None = None
        self._store_ok = False
        self._node: str | None = None
        self.run_id: str | None = None
        self.folder: Path | None = None
        self._ranks: list[int] = []  # the world ranks in gathered order (set at resume)
        if not self.enabled:
            return
        try:
            self.run_id = ensure_run_id(run_dir)
            self.folder = snapshot_folder(settings, self.run_id)
            self._node = self.folder.name
            private_tree(self.base, self.run_id, self.folder.name)
            self._store_ok = True
        except (OSError, ValueError) as e:
            self._turn_off(f"{e}")

    @classmethod
    def for_config(cls, config: Any, run_dir: Path, ft: Any, replica: int, coord: int,
                   log: Callable[[str], None] = print, launch: LaunchContract | None = None) -> LocalSnapshots:
        """The store of a job's ``config``: what it needs of it (its settings, identity, ranks per replica), and of
        its launch (this node's name, the age of another run's folder that is removed)."""
        launch = launch if launch is not None else LaunchContract()
        settings = SnapshotSettings.of(config, node=launch.node_name, stale_after_s=launch.snapshot_stale_s)
        return cls(settings, config_hash=config_hash(config),
                   ranks_per_replica=config.ranks_per_replica, run_dir=run_dir, ft=ft, replica=replica, coord=coord,
                   log=log)

    @property
    def enabled(self) -> bool:
        return self.settings.enabled

    @property
    def writing(self) -> bool:
        return self.enabled and self.off_reason is None

    def _turn_off(self, why: str) -> None:
        if self.off_reason is None:
            self.off_reason = why
            _say(self.log, f"local snapshots turned off on this rank: {why}")

    # ----------------------------------------------------------------------------------------- writing
    def after_commit(self, step: int, state: Any, epoch: int = 0,
                     log_event: Callable[[dict], None] = lambda record: None, due: bool = True) -> None:
        """Snapshot the state of committed ``step`` if it is ``due`` (the
        :class:`~nanotron_recover.snapshots.schedule.SnapshotSchedule`'s call, the same on every rank); the
        first one is logged as a ``local_snapshot`` event (its bytes per rank). Never raises for storage trouble:
        snapshots turn off."""
        if not self.writing or not due:
            return
        from nanotron_recover.training.training_state import state_tensors

        first = self._writer is None
        if first:
            self._writer = SnapshotWriter(self.folder, f"r{self.replica}-c{self.coord}", run_id=self.run_id,
                                          config_hash=self.config_hash, coord=self.coord,
                                          # no resume (none ran): a history of this rank alone
                                          history=self.history or new_history_id(), log=self.log)
        if self._writer.failed is not None:
            self.off_reason = f"a write failed ({self._writer.failed})"  # the writer said so when it happened
            return
        extras = {"lr_scheduler": state.lr_scheduler.state_dict(), "param_groups": _group_settings(state.optimizer)}
        self._writer.write(step, list(state_tensors(state)), extras, epoch=epoch)
        if first:
            log_event({"event": "local_snapshot", "step": step, "folder": str(self.folder),
                       "bytes_per_rank": self._writer.payload_bytes})

    @property
    def cost_s(self) -> float | None:
        """What this rank's last measured write cost training (None: none measured, or not writing)."""
        return self._writer.last_cost_s if self.writing and self._writer is not None else None

    def settle(self) -> None:
        """Wait for the pending write, which reads the state tensors in place: call before changing them."""
        if self._writer is not None:
            self._writer.wait()

    def finish(self) -> None:
        """Wait for the last write (before the run's final agreement). Never raises: a failed write was said."""
        if self._writer is not None:
            self._writer.close()

    def drop_replica(self) -> None:
        """This rank leaves while the others train on (its replica broke, or was evicted): the files of its replica
        on this node go, its own and its dead mates' (no one else would delete them: a node whose ranks all left
        kept them after the run). Every live replica holds every coordinate, so no state is lost. The node folder
        stays: another replica of this node may be about to write its first file into it."""
        self.finish()
        if self.folder is None or not self._store_ok:
            return
        for path in self.folder.glob(f"r{self.replica}-c*"):
            path.unlink(missing_ok=True)

    def remove(self) -> None:
        """The run finished: delete this node's snapshots of it."""
        self.finish()
        if self.folder is not None and self._store_ok:
            remove_folder(self.folder)

    # ----------------------------------------------------------------------------------------- resuming
    def _mine(self) -> dict[Key, Snapshot]:
        if not self.writing:
            return {}
        try:
            self._clean_stale()
            return by_key(scan(self.folder, self.run_id, self.config_hash, self.log))
        except (OSError, ValueError) as e:
            self._turn_off(f"{e}")
            return {}

    def _clean_stale(self) -> None:
        remove_stale_runs(self.base, self.run_id, self.settings.stale_after_s, self.log)

    def resume(self, state: Any, newer_than: int | None, rolled_back: bool = False) -> int | None:
        """Collective over the world at start-up: agree on the newest (history, step) that every coordinate holds
        somewhere (and that is newer than the disk checkpoint's ``newer_than``), check its files, load it; None if
        there is none. A damaged file is deleted and the agreement runs again without it. ``rolled_back`` (the same
        on every rank): a person set ``latest.txt`` back to ``newer_than``: no snapshot is loaded, and this node's
        files of later steps are deleted (they hold the state the person wanted to drop)."""
        if not self.enabled:
            return None
        from nanotron_recover.training.training_state import ensure_adam_state, state_tensors

        ensure_adam_state(state.optimizer)
        tensors = list(state_tensors(state))
        proposal = new_history_id()
        size = sum(_raw_bytes(t).numel() for t in tensors)
        while True:
            mine = self._mine()
            hellos = self.ft.allgather_object(Hello(proposal, self.ft.rank, self.coord, self._node, size,
                                                    [(*k, s.header_bytes, s.size) for k, s in mine.items()]))
            self.history = self.history or hellos[0].proposal  # the lowest live rank's proposal, on every rank
            self._ranks = [hello.rank for hello in hellos]
            offers = [hello.offers for hello in hellos]
            coord_of = [hello.coord for hello in hellos]
            chosen = None if rolled_back else choose_snapshot(offers, self.coords, newer_than)
            if chosen is None:
                self._tidy(None, drop_after=newer_than or 0 if rolled_back else None)
                self._check_space(hellos)
                return None
            plan = transfer_plan(offers, coord_of, chosen)
            if self._verify_agreed(mine, chosen, plan, coord_of):
                break
        loaded = self._load(state, tensors, mine, offers, chosen, plan, coord_of)
        self._tidy(chosen)
        self._check_space(hellos)
        if self._ranks[0] == self.ft.rank:  # one line per launch, from the lowest live rank, for every rank
            _say(self.log, resumed_line(chosen[1], chosen[0], loaded))
        return chosen[1]

    def _check_space(self, hellos: Sequence[Hello]) -> None:
        """On every node (the launcher checks only its own): the ranks of this node need room for :data:`KEEP`
        complete snapshots and one being written each; this run's files already there count as room (they are
        replaced). If there is not, snapshots go off here now, with the numbers, rather than at a failed write."""
        if not self.writing:
            return
        mates = [hello for hello in hellos if hello.node == self._node]
        need = (KEEP + 1) * sum(hello.payload_bytes for hello in mates)
        free = shutil.disk_usage(self.folder).free + sum(p.stat().st_size for p in self.folder.glob(f"*{SUFFIX}"))
        free -= reserved_bytes(self.folder)  # never all of it: Open MPI and NCCL need shared memory too
        if need > free:
            self._turn_off(f"node {self._node} has {free / 2**20:.1f} MiB for snapshots in {self.folder}, its "
                           f"{len(mates)} rank(s) need {need / 2**20:.1f} MiB ({KEEP} snapshots and one being "
                           "written each); point local_snapshot_dir at a larger folder")

    def _key(self, chosen: tuple[str, int], coord: int | None = None) -> Key:
        return Key(self.coord if coord is None else coord, chosen[0], chosen[1])

    def _used_here(self, chosen: tuple[str, int], plan: dict[int, int], coord_of: Sequence[int]) -> set[Key]:
        """The chosen files this rank reads: its own coordinate's (unless it receives it), and those it sends."""
        rank = self._ranks.index(self.ft.rank)
        used = {self._key(chosen, coord_of[dest]) for dest, src in plan.items() if src == rank}
        if rank not in plan:
            used.add(self._key(chosen))
        return used

    def _verify_agreed(self, mine: dict[Key, Snapshot], chosen: tuple[str, int], plan: dict[int, int],
                       coord_of: Sequence[int]) -> bool:
        """Checksum the chosen files this rank reads; a damaged one is deleted (so no later launch picks it again)
        and said so. -> whether every rank's files are sound (the same answer everywhere)."""
        sound = True
        for key in sorted(self._used_here(chosen, plan, coord_of)):
            try:
                verify_file(mine[key].path)
            except (OSError, ValueError) as e:
                sound = False
                mine[key].path.unlink(missing_ok=True)
                _say(self.log, f"local snapshot {mine[key].path} of step {key.step} is damaged ({e}): deleted; "
                               "agreeing again without it")
        return all(self.ft.allgather_object(sound))

    def _load(self, state: Any, tensors: list[torch.Tensor], mine: dict[Key, Snapshot], offers: list,
              chosen: tuple[str, int], plan: dict[int, int], coord_of: Sequence[int]) -> list[Loaded]:
        """Stream the chosen snapshot into this rank's state (from its file, or from its sender), serving the
        receivers this rank sends to on the way. -> what every rank loaded (gathered once all have). ``plan`` and
        ``offers`` index the gathered list; the transfer addresses world ranks."""
        me, ranks = self._ranks.index(self.ft.rank), self._ranks
        outgoing: dict[Key, list[int]] = {}
        for dest, src in sorted(plan.items()):
            if src == me:
                outgoing.setdefault(self._key(chosen, coord_of[dest]), []).append(ranks[dest])
        source = plan.get(me)
        incoming = None
        if source is not None:
            incoming = next((head, size) for c, h, s, head, size in offers[source] if Key(c, h, s) == self._key(chosen))
        header = _stream(self.ft, {mine[k].path: dests for k, dests in outgoing.items()},
                         None if source is None else ranks[source], incoming, tensors,
                         None if source is not None else mine[self._key(chosen)].path)
        self._apply_extras(state, extras_of(header))
        sender = None if source is None else ranks[source]
        # every rank loaded: only now may files be deleted
        return self.ft.allgather_object(Loaded(self.ft.rank, self.coord, sender, payload_checksum(header)))

    @staticmethod
    def _apply_extras(state: Any, extras: dict) -> None:
        from nanotron_recover.training.training_state import torch_optimizer

        state.lr_scheduler.load_state_dict(extras["lr_scheduler"])
        # the scheduler sets each group's lr only when it steps: the next step must use the saved one
        for group, saved in zip(torch_optimizer(state.optimizer).param_groups, extras["param_groups"], strict=True):
            group.update(saved)

    def _tidy(self, chosen: tuple[str, int] | None, drop_after: int | None = None) -> None:
        """After the agreement (no rank writes yet: the first write follows a step that all ranks commit): this
        node's partial files of killed writes go, and so do its files newer than the chosen step (or than
        ``drop_after``, a rollback's step) and other histories' files of that step: a line the run no longer follows
        (the chosen files stay until this launch has its own)."""
        if self.folder is None or not self._store_ok:
            return
        for path in [*self.folder.glob("*.tmp"), *self.folder.glob("*.spare")]:
            path.unlink(missing_ok=True)
        if chosen is None and drop_after is None:
            return
        history, step = chosen if chosen is not None else (None, drop_after)
        for path in self.folder.glob(f"*{SUFFIX}"):
            found = _FILE.fullmatch(path.name)
            if found and (int(found.group(4)) > step or (int(found.group(4)) == step and history is not None
                                                          and found.group(3) != history)):
                path.unlink(missing_ok=True)
