"""Node-local snapshots: the file format (no pickle), the two newest files kept, refusal of another run's files, a
private store, the agreement on one (history, step), the spread transfer plan, a full store, and a writer SIGKILLed
mid-write (a real process) leaving the previous snapshot usable."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from nanotron_recover.config import ConfigError, config_from_dict
from nanotron_recover.launcher.preflight import check_local_snapshot_budget
from nanotron_recover.run.run_folder import ensure_run_id, run_id
from nanotron_recover.snapshots.catalog import scan
from nanotron_recover.snapshots.format import WRITE_PIECE_BYTES, parse, payload_checksum, unpack_into, verify_file
from nanotron_recover.snapshots.relaunch import Loaded, choose_snapshot, resumed_line, transfer_plan
from nanotron_recover.snapshots.writer import KEEP, SnapshotWriter
from tests.conftest import make_tiny_config

RUN, CONFIG = "run-a", "cfg-a"
HISTORY = "0000000000aa0000"


def state(seed: float) -> list[torch.Tensor]:
    """Tensors like a rank's state: bf16 parameters, fp32 masters and moments, Adam's 0-d step."""
    return [
        torch.full((3, 4), seed, dtype=torch.bfloat16),
        torch.arange(12, dtype=torch.float32).reshape(3, 4) + seed,
        torch.full((7,), -seed, dtype=torch.float32),
        torch.tensor(seed, dtype=torch.float32),
    ]


def test_a_snapshot_round_trips_exactly(tmp_path):
    writer = SnapshotWriter(tmp_path, "r0-c1", run_id=RUN, config_hash=CONFIG, coord=1, history=HISTORY)
    written = state(2.5)
    extras = {"lr_scheduler": {"last_epoch": 7, "_last_lr": [1e-3 / 3]}, "param_groups": [{"betas": (0.9, 0.95)}]}
    writer.write(7, written, extras, epoch=3)
    writer.close()
    (found,) = scan(tmp_path, RUN, CONFIG)
    assert (found.step, found.coord, found.history, found.header["epoch"]) == (7, 1, HISTORY, 3)
    header, got, payload = parse(found.path.read_bytes())
    assert got == extras and isinstance(got["param_groups"][0]["betas"], tuple)  # types round-trip exactly
    target = state(0.0)
    unpack_into(target, header, payload)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(written, target))


def test_host_tensors_are_written_in_place_and_may_change_once_the_write_is_waited_for(tmp_path):
    """No host copy: the write reads the live tensors, so the step path waits for it before the next update."""
    writer = SnapshotWriter(tmp_path, "r0-c0", run_id=RUN, config_hash=CONFIG, coord=0, history=HISTORY)
    live = state(1.0)
    expected = {}
    for step in (1, 2):
        writer.write(step, live, {})
        expected[step] = [t.clone() for t in live]
        writer.wait()
        for t in live:  # the next optimizer step
            t.add_(1)
    writer.close()
    assert writer.payload_bytes == sum(t.numel() * t.element_size() for t in live)
    by_step = {found.step: found for found in scan(tmp_path, RUN, CONFIG)}
    for step in (1, 2):
        header, _, payload = parse(by_step[step].path.read_bytes())
        target = state(0.0)
        unpack_into(target, header, payload)
        assert all(torch.equal(a, b) for a, b in zip(expected[step], target)), step


def test_two_files_keep_the_newest_snapshot_and_the_one_before(tmp_path):
    writer = SnapshotWriter(tmp_path, "r0-c0", run_id=RUN, config_hash=CONFIG, coord=0)
    for step in (1, 2, 3):
        writer.write(step, state(float(step)), {})
    writer.close()
    assert sorted(s.step for s in scan(tmp_path, RUN, CONFIG)) == [2, 3]
    assert writer.bytes_written > 3 * sum(t.numel() * t.element_size() for t in state(0.0))


def test_the_file_a_write_made_surplus_is_written_over_by_the_next_and_every_file_stays_exact(tmp_path):
    """One spare per rank (never a ``.snap``): the next write reuses its pages; files of any step still hold that
    step's bytes, and there are never more than KEEP snapshots and the spare."""
    writer = SnapshotWriter(tmp_path, "r0-c0", run_id=RUN, config_hash=CONFIG, coord=0, history=HISTORY)
    big = [torch.zeros(3 * WRITE_PIECE_BYTES // 4 + 5, dtype=torch.float32)]  # several pieces, one cut short
    inodes = {}
    for step in range(1, 6):
        big[0].fill_(float(step))
        writer.write(step, big, {"step": step})
        writer.wait()
        spare = tmp_path / "r0-c0.spare"
        if step >= 3:
            assert spare.exists() and inodes[step - 2] == spare.stat().st_ino  # step - 2's file, now surplus
        if step >= 4:  # written over the spare that step - 1's write left
            assert os.stat(writer.paths()[-1]).st_ino == inodes[step - 3]
        inodes[step] = os.stat(writer.paths()[-1]).st_ino
        assert len(list(tmp_path.iterdir())) <= KEEP + 1
    writer.close()
    for found in scan(tmp_path, RUN, CONFIG):
        header, extras, payload = parse(found.path.read_bytes())
        assert payload_checksum(header).startswith("xxh3_64:")
        target = [torch.empty_like(big[0])]
        unpack_into(target, header, payload)
        assert extras["step"] == found.step and bool((target[0] == float(found.step)).all())
    assert sorted(s.step for s in scan(tmp_path, RUN, CONFIG)) == [4, 5]


def test_a_file_of_the_previous_format_whose_header_had_no_checksum_is_not_used(tmp_path):
    """``NRSNAP02`` headers carried no checksum: their extras could not be trusted, so such a file (a relaunch just
    after an upgrade) is refused with a message naming the versions; the relaunch uses the disk checkpoint."""
    writer = SnapshotWriter(tmp_path, "r0-c0", run_id=RUN, config_hash=CONFIG, coord=0, history=HISTORY)
    writer.write(3, state(3.0), {"step": 3})
    writer.close()
    (found,) = scan(tmp_path, RUN, CONFIG)
    header, _, payload = parse(found.path.read_bytes())
    head = json.dumps(header).encode()
    found.path.write_bytes(b"NRSNAP02" + struct.pack("<I", len(head)) + head + bytes(payload))  # as 02 wrote it
    said: list[str] = []
    assert scan(tmp_path, RUN, CONFIG, log=said.append) == []
    assert len(said) == 1 and "not a snapshot file of this format (NRSNAP02" in said[0], said
    assert found.path.exists()  # not damaged: another version's, left to the cleanup of its history
    with pytest.raises(ValueError, match="not a snapshot file of this format"):
        parse(found.path.read_bytes())


def test_another_runs_or_configs_snapshot_is_refused_with_a_message(tmp_path):
    for run, config, name in ((RUN, "cfg-b", "r0-c0"), ("run-b", CONFIG, "r1-c0")):
        writer = SnapshotWriter(tmp_path, name, run_id=run, config_hash=config, coord=0)
        writer.write(5, state(1.0), {})
        writer.close()
    said: list[str] = []
    assert scan(tmp_path, RUN, CONFIG, log=said.append) == []
    assert len(said) == 2 and all("belongs to another run or config" in m and "refused" in m for m in said)


def test_a_damaged_payload_is_refused(tmp_path):
    writer = SnapshotWriter(tmp_path, "r0-c0", run_id=RUN, config_hash=CONFIG, coord=0)
    writer.write(1, state(1.0), {})
    writer.close()
    (found,) = scan(tmp_path, RUN, CONFIG)
    data = bytearray(found.path.read_bytes())
    data[-1] ^= 0xFF
    with pytest.raises(ValueError, match="checksum"):
        parse(bytes(data))


def flip_a_digit(path, field: bytes, value: bytes) -> None:
    """Turn the last digit of the first ``value`` after ``field`` in the file's header into another digit (1 <-> 7):
    still valid JSON, another number; what only a checksum of the header sees."""
    data = bytearray(path.read_bytes())
    at = data.index(value, data.index(field)) + len(value) - 1
    assert chr(data[at]).isdigit()
    data[at] ^= 0x06
    path.write_bytes(bytes(data))


def test_a_flipped_byte_in_the_headers_extras_makes_the_file_damaged(tmp_path):
    """The extras (the LR schedule, the optimizer's group settings) are applied at resume as read: a flipped digit
    there would change the learning rate of the rest of the run. The header has its own checksum, checked before
    anything of the file is used; a mismatch is damage (deleted, as a payload's)."""
    writer = SnapshotWriter(tmp_path, "r0-c0", run_id=RUN, config_hash=CONFIG, coord=0, history=HISTORY)
    writer.write(4, state(4.0), {"lr_scheduler": {"_last_lr": [0.001]}, "param_groups": [{"lr": 0.001}]})
    writer.close()
    (found,) = scan(tmp_path, RUN, CONFIG)
    flip_a_digit(found.path, b'"param_groups"', b"0.001")  # lr 0.001 -> 0.007
    with pytest.raises(ValueError, match="header checksum"):
        parse(found.path.read_bytes())
    with pytest.raises(ValueError, match="header checksum"):
        verify_file(found.path)
    said: list[str] = []
    assert scan(tmp_path, RUN, CONFIG, log=said.append) == []
    assert not found.path.exists() and any("damaged" in m and "deleted" in m for m in said), said


def test_a_snapshot_of_another_layout_is_not_loaded(tmp_path):
    writer = SnapshotWriter(tmp_path, "r0-c0", run_id=RUN, config_hash=CONFIG, coord=0)
    writer.write(1, state(1.0), {})
    writer.close()
    header, _, payload = parse(scan(tmp_path, RUN, CONFIG)[0].path.read_bytes())
    with pytest.raises(ValueError, match="do not match"):
        unpack_into(state(0.0)[:3], header, payload)


# ------------------------------------------------------------------------------------------- the run's id
def test_a_run_keeps_its_id_and_a_new_run_at_the_same_path_gets_another(tmp_path):
    run_dir = tmp_path / "run"
    assert run_id(run_dir) is None
    first = ensure_run_id(run_dir)
    assert ensure_run_id(run_dir) == first == run_id(run_dir)  # a relaunch in the run dir: the same run
    shutil.rmtree(run_dir)
    assert ensure_run_id(run_dir) != first  # the dir deleted and made again: the old run's snapshots are not ours


def test_ranks_creating_the_id_at_once_all_get_the_same(tmp_path):
    """Real processes racing on one run dir (as the ranks of a first launch do)."""
    start = time.time() + 1.0
    code = (f"import time,sys; from nanotron_recover.snapshots.local_snapshot import ensure_run_id; "
            f"time.sleep(max(0, {start} - time.time())); print(ensure_run_id(sys.argv[1]))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True)
             for _ in range(8)]
    ids = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert len(ids) == 1 and ids != {""}, ids
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["run_id.txt"]  # no temporary file left


# ------------------------------------------------------------------------------------------- the agreement
A, B = "00000000000a", "00000000000b"  # two histories (launches); B is the later one


def test_the_newest_step_one_history_holds_for_every_coordinate_is_chosen():
    offers = [[(0, A, 5), (0, A, 6)], [(1, A, 5)], [(0, A, 6), (1, A, 4)]]  # coordinate 1 has no copy of step 6
    assert choose_snapshot(offers, coords=[0, 1], newer_than=None) == (A, 5)
    assert choose_snapshot(offers, coords=[0, 1], newer_than=5) is None  # the disk checkpoint is as new
    assert choose_snapshot(offers, coords=[0, 1], newer_than=3) == (A, 5)
    assert choose_snapshot([[], []], coords=[0], newer_than=None) is None


def test_coordinates_of_one_step_in_two_histories_are_not_mixed():
    """Step 6 has coordinate 0 only in history A and coordinate 1 only in B: not a snapshot (two trajectories)."""
    offers = [[(0, A, 6), (0, A, 5)], [(1, B, 6), (1, A, 5)]]
    assert choose_snapshot(offers, coords=[0, 1], newer_than=None) == (A, 5)


def test_a_step_held_whole_in_two_histories_goes_to_the_later_launch():
    offers = [[(0, A, 6), (1, A, 6)], [(0, B, 6), (1, B, 6)], [(0, B, 6)]]
    assert choose_snapshot(offers, coords=[0, 1], newer_than=None) == (B, 6)
    assert transfer_plan(offers, [0, 1, 1], (B, 6)) == {0: 1, 2: 1}  # rank 0 holds only history A's files


def test_receivers_are_spread_over_the_holders():
    offers = [[(0, A, 5)], [(1, A, 5)], [], [(0, A, 5), (1, A, 5)], [], [], []]
    coord_of = [0, 1, 0, 1, 0, 0, 0]
    plan = transfer_plan(offers, coord_of, (A, 5))
    assert plan == {2: 0, 4: 3, 5: 0, 6: 3}  # coordinate 0's holders 0 and 3 take turns


@given(st.lists(st.lists(st.tuples(st.integers(0, 3), st.sampled_from([A, B]), st.integers(1, 8)), max_size=6),
                min_size=1, max_size=8),
       st.integers(1, 4))
def test_a_chosen_snapshot_can_always_be_served_to_every_rank_from_one_history(offers, rpr):
    coord_of = [rank % rpr for rank in range(len(offers))]
    chosen = choose_snapshot(offers, coords=range(rpr), newer_than=None)
    if chosen is None:
        return
    history, step = chosen
    plan = transfer_plan(offers, coord_of, chosen)
    for rank, coord in enumerate(coord_of):
        holder = plan.get(rank, rank)
        assert (coord, history, step) in offers[holder]  # every rank loads the same (history, step)
    served = [sum(1 for src in plan.values() if src == h) for h in set(plan.values())]
    holders = {c: sum(1 for pairs in offers if (c, history, step) in pairs) for c in range(rpr)}
    wanting = {c: sum(1 for r in plan if coord_of[r] == c) for c in range(rpr)}
    assert max(served, default=0) <= max(-(-wanting[c] // holders[c]) for c in range(rpr)) * rpr
    for t, h in {(s, h) for pairs in offers for _, h, s in pairs if (s, h) > (step, history)}:
        assert not set(range(rpr)) <= {c for pairs in offers for c, hh, s in pairs if (s, hh) == (t, h)}


def test_the_launchs_one_resume_line_names_each_coordinates_checksum_and_who_received():
    """One line for all ranks (8 in the main job): a coordinate whose ranks loaded different bytes shows both, and
    a large job's receivers are counted past the first few, so the line stays short."""
    loaded = [Loaded(rank, rank % 2, None if rank < 4 else rank - 4, f"xxh3_64:{rank % 2:016x}") for rank in range(8)]
    line = resumed_line(7, A, loaded)
    assert line == (f"resumed from the local snapshot of step 7 (history {A}, 8 rank(s); payload checksum of "
                    f"coordinate 0 xxh3_64:{0:016x}, coordinate 1 xxh3_64:{1:016x}; 4 rank(s) read their node's "
                    "file, 4 received it over MPI: rank 4 received from rank 0, rank 5 received from rank 1, rank 6 "
                    "received from rank 2, rank 7 received from rank 3)")
    loaded[1] = loaded[1]._replace(checksum="xxh3_64:bad")
    assert f"coordinate 1 xxh3_64:bad/xxh3_64:{1:016x};" in resumed_line(7, A, loaded)
    many = [Loaded(rank, 0, 0 if rank else None, "xxh3_64:0") for rank in range(1000)]
    assert resumed_line(7, A, many).endswith("rank 8 received from rank 0 and 991 more)")


# ------------------------------------------------------------------------------------------- a kill mid-write
WRITER = """
import sys, torch
from nanotron_recover.snapshots.writer import SnapshotWriter
writer = SnapshotWriter(sys.argv[1], "r0-c0", run_id="run-a", config_hash="cfg-a", coord=0)
big = torch.empty(16 * 2**20 // 4, dtype=torch.float32)
step = 0
while True:
    step += 1
    writer.wait()  # the write reads the tensor in place: as the step path does before its update
    big.fill_(float(step))
    writer.write(step, [big], {"step": step})
    if step == 2:
        print("ready", flush=True)
"""


def test_a_kill_during_a_write_leaves_the_previous_snapshot_usable(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob("*.tmp")) and time.monotonic() < deadline:  # a write in flight
            time.sleep(0.001)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert list(tmp_path.glob("*.tmp")), "the kill hit a write in flight (its partial file is left)"
    found = scan(tmp_path, RUN, CONFIG)
    assert found, "a complete snapshot survives the kill"
    for snap in found:
        header, extras, payload = parse(snap.path.read_bytes())  # complete: the checksum holds
        target = [torch.empty(16 * 2**20 // 4, dtype=torch.float32)]
        unpack_into(target, header, payload)
        assert extras["step"] == snap.step and bool((target[0] == float(snap.step)).all())


# ------------------------------------------------------------------------------------------- before launch
def test_a_snapshot_budget_too_small_is_refused_before_launch(tmp_path):
    raw = make_tiny_config(dp=2, fault_tolerance={"enabled": True, "local_snapshot_dir": str(tmp_path / "shm"),
                                                  "local_snapshot_max_gb": 1e-6})
    with pytest.raises(ConfigError, match="local_snapshot_max_gb"):
        check_local_snapshot_budget(config_from_dict(raw), ranks_per_node=2, run_dir=tmp_path / "run")
    raw["fault_tolerance"]["local_snapshot_max_gb"] = 1.0
    check_local_snapshot_budget(config_from_dict(raw), ranks_per_node=2, run_dir=tmp_path / "run")
    raw["fault_tolerance"].update(local_snapshot_max_gb=1e-6, local_snapshot_interval=0)  # off: nothing to check
    check_local_snapshot_budget(config_from_dict(raw), ranks_per_node=2, run_dir=tmp_path / "run")


def test_the_snapshot_budget_never_takes_the_whole_folder(tmp_path):
    """``/dev/shm`` holds Open MPI's and NCCL's shared memory too: a budget as large as the free space is refused
    (a tenth of the file system stays free)."""
    import shutil

    from nanotron_recover.snapshots.store import reserved_bytes

    shm = tmp_path / "shm"
    shm.mkdir()
    usage = shutil.disk_usage(shm)
    assert reserved_bytes(shm) == usage.total // 10
    raw = make_tiny_config(dp=2, fault_tolerance={"enabled": True, "local_snapshot_dir": str(shm),
                                                  "local_snapshot_max_gb": usage.total / 2**30})
    config = config_from_dict(raw)
    from nanotron_recover.training.memory import snapshot_bytes_per_rank

    per_rank = snapshot_bytes_per_rank(config)
    ranks = int((usage.free - reserved_bytes(shm) // 2) // (3 * per_rank)) + 1  # fits the free space, not the rest
    if 3 * ranks * per_rank > usage.free:
        pytest.skip("the free space moved while the test ran")
    with pytest.raises(ConfigError, match="local_snapshot_max_gb"):
        check_local_snapshot_budget(config, ranks_per_node=ranks, run_dir=tmp_path / "run")


def test_a_writes_cost_is_known_once_it_was_waited_for_and_counts_its_threads_cpu_time(tmp_path):
    """The snapshot schedule's input: the write's CPU seconds on its thread plus the caller's wait."""
    writer = SnapshotWriter(tmp_path, "r0-c0", run_id=RUN, config_hash=CONFIG, coord=0, history=HISTORY)
    big = [torch.rand(4_000_000)]  # 16 MB: a measurable write
    writer.write(1, big, {})
    assert writer.last_cost_s is None  # pending: not measured yet
    started = time.perf_counter()
    writer.wait()
    waited = time.perf_counter() - started
    assert writer.last_cost_s is not None and writer.last_cost_s > 0
    assert writer.last_cost_s >= waited * 0.99  # the wait is part of it
    writer.write(2, big, {})
    time.sleep(0.3)  # the caller computes meanwhile
    started = time.perf_counter()
    writer.wait()
    waited = time.perf_counter() - started
    assert writer.last_cost_s >= writer._write_cpu_s > 0  # the thread's CPU time counts, the sleep does not
    assert writer.last_cost_s <= writer._copy_s + writer._write_cpu_s + waited + 1e-3
    writer.close()
