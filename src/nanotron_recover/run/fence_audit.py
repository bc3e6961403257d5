"""An audit of a run folder for the fence (:mod:`nanotron_recover.run.fence`): what a rank wrote after its launch was
replaced. The tests and ``benchmarks/real_nodes.py`` check that it finds nothing; an operator can run it on a run
folder after a network incident."""

from __future__ import annotations

from pathlib import Path

from nanotron_recover.run.run_folder import HANGS_DIR, LAUNCHES_DIR, exit_record_path, read_launches, read_metrics_jsonl


def writes_after_replacement(run_dir: Path) -> list[str]:
    """An audit of a run folder: what a rank wrote after its launch was replaced (empty when the fence held).
    Metrics lines naming another launch than the one that owned the folder at their time; hang stacks written after
    the launch of their writer ended (a stacks file names no launch: any written after the second launch began,
    while no later hang was recorded by the launch of that time, counts); exit records of ranks a launch did not
    have."""
    run_dir = Path(run_dir)
    launches = read_launches(run_dir)

    def owner(when: float) -> str | None:
        owners = [record.get("token") for record in launches if record.get("time", 0) <= when]
        return owners[-1] if owners else None

    records = read_metrics_jsonl(run_dir)
    found = [f"a line of launch {r['launch']} at {when:.3f}, while launch {owner(when)} owned the folder: "
             f"{r.get('event', 'step ' + str(r.get('step')))}"
             for r in records if r.get("launch") and (when := r.get("time") or r.get("wall_time") or 0.0)
             and owner(when) not in (None, r["launch"])]
    hung_by = {(r.get("by_rank"), r.get("launch")) for r in records if r.get("event") == "hang_detected"}
    for stacks in sorted((run_dir / HANGS_DIR).glob("*.txt")):
        written = stacks.stat().st_mtime
        rank = int(stacks.name.split("-")[1]) if stacks.name.split("-")[1].isdigit() else None
        if owner(written) is not None and (rank, owner(written)) not in hung_by:
            found.append(f"{stacks.name}, written at {written:.3f} by no rank of launch {owner(written)}")
    for number, record in enumerate(launches, 1):
        last = number == len(launches)
        folder = exit_record_path(run_dir, 0).parent if last else run_dir / LAUNCHES_DIR / str(number) / "exits"
        for path in folder.glob("rank-*.json"):
            rank = path.stem.split("-", 1)[1]
            if rank.isdigit() and int(rank) >= int(record.get("world_size", 1 << 30)):
                found.append(f"an exit record of rank {rank} among launch {number}'s ({record.get('world_size')} "
                             "ranks)")
    return found
