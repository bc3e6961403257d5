"""The pure parts of hang detection: who watches whom, and how long is too long."""

from __future__ import annotations

import time

from hypothesis import given
from hypothesis import strategies as st

from nanotron_recover.ft.hang_policy import (
    BUSY,
    FIRST_STEP_TIMEOUT_S,
    HANG_FLOOR_S,
    HANG_STEP_FACTOR,
    OWN_PAUSE_S,
    WAITING,
    HangPolicy,
    MainThreadProgress,
    excuse_own_pause,
    kill_order_done,
    peers_of,
)
from nanotron_recover.ft.layout import ReplicaAssignment, ReplicaLayout
from nanotron_recover.run.phases import Phase


@given(st.integers(1, 6), st.integers(1, 6))
def test_peers_are_replica_mates_and_coordinate_ranks_symmetrically(replicas: int, rpr: int) -> None:
    layout = ReplicaLayout(replicas * rpr, rpr)
    for rank in range(layout.world_size):
        peers = peers_of(layout, rank)
        assert rank not in peers
        assert len(peers) == (rpr - 1) + (replicas - 1)
        for p in peers:
            assert rank in peers_of(layout, p)  # whom I tell, tells me: each silence has a witness
            same_replica = layout.replica_of(p) == layout.replica_of(rank)
            assert same_replica or layout.local_rank_of(p) == layout.local_rank_of(rank)


def test_default_timeout_follows_the_longest_step_with_a_floor() -> None:
    policy = HangPolicy()
    assert policy.timeout_s == FIRST_STEP_TIMEOUT_S  # nothing measured yet
    policy.record_step(0.2)
    assert policy.timeout_s == HANG_FLOOR_S
    policy.record_step(20.0)
    policy.record_step(1.0)
    assert policy.timeout_s == HANG_STEP_FACTOR * 20.0
    assert HangPolicy(fixed_timeout_s=7).timeout_s == 7


def test_no_mpi_is_needed_for_the_policy() -> None:
    import subprocess
    import sys

    code = "import sys, nanotron_recover.ft.hang_policy; print('mpi4py' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_checkpoint_saves_get_the_io_allowance_and_waits_a_longer_limit() -> None:
    policy = HangPolicy(fixed_timeout_s=10, io_allowance_s=300)
    assert policy.busy_limit_s("forward") == 10
    assert policy.busy_limit_s("checkpoint") == 300
    assert policy.stall_limit_s == 310


def test_a_snapshot_and_a_recycled_replica_build_get_the_io_allowance() -> None:
    """A snapshot write waits for the previous background write; a recycled replica's rendezvous and model build is
    the start-up's work: neither is held to the step timeout."""
    policy = HangPolicy(fixed_timeout_s=10, io_allowance_s=300)
    assert policy.busy_limit_s("snapshot") == 300 and policy.busy_limit_s(Phase.REPLICA_BUILD) == 300
    assert policy.busy_limit_s("replica-formation") == 10  # the formation's cheap bookkeeping is not I/O


def test_every_bound_stays_under_the_replicas_own_torch_timeout() -> None:
    """A frozen rank must be ended before its replica-mates' gloo collectives time out (they would end with an
    error, not a repair): the derived timeout, a fixed one and a silent peer's limit stay under the ceiling; only
    a peer silent inside a checkpoint save keeps the I/O allowance (serialisation may hold its interpreter)."""
    from types import SimpleNamespace

    from nanotron_recover.ft.hang_policy import CEILING_MARGIN_S

    ft = SimpleNamespace(hang_timeout_s=None, startup_timeout_s=600.0, collective_timeout_s=60.0)
    policy = HangPolicy.of(ft)
    ceiling = 60.0 - CEILING_MARGIN_S
    assert policy.ceiling_s == ceiling
    policy.record_step(20.0)  # 5 x 20 s would be 100 s
    assert policy.timeout_s == ceiling
    assert HangPolicy.of(SimpleNamespace(**{**vars(ft), "hang_timeout_s": 300.0})).timeout_s == ceiling
    for where in ("snapshot", Phase.METRICS_IO, Phase.REPLICA_BUILD, "forward"):
        assert policy.silence_limit_s(where) <= ceiling, where
    short = HangPolicy.of(SimpleNamespace(**{**vars(ft), "hang_timeout_s": 5.0}))
    for where in ("snapshot", Phase.METRICS_IO, Phase.REPLICA_BUILD, "forward"):  # silence: frozen, wherever
        assert short.silence_limit_s(where) == 5.0, where
    assert policy.busy_limit_s("snapshot") == 600.0  # busy (its heartbeats still come): the allowance stays
    assert policy.silence_limit_s("checkpoint") == 600.0


def test_members_of_a_recycled_replica_are_peers_on_the_current_assignment() -> None:
    """3 replicas x 2: replicas 1 and 2 broke; ranks 4 and 3 form replica 3. On the grid they were never peers;
    on the assignment they are mates, and each is a coordinate peer of replica 0's rank of its coordinate."""
    layout = ReplicaLayout(world_size=6, ranks_per_replica=2)
    assignment = ReplicaAssignment(layout)
    assignment.to_pool([2, 3, 4, 5])
    assignment.assign(3, [4, 3])
    assert 3 not in peers_of(layout, 4)
    assert peers_of(assignment, 4) == [0, 3] and peers_of(assignment, 3) == [1, 4]
    assert peers_of(assignment, 2) == []  # in the pool: no replica, no peers there
    for rank in (0, 1, 3, 4):  # symmetric, as on the grid
        assert all(rank in peers_of(assignment, p) for p in peers_of(assignment, rank))


def test_progress_records_busy_waiting_and_returns_to_the_busy_phase() -> None:
    progress = MainThreadProgress()
    progress.busy("backward", 4)
    t_busy = progress.since
    progress.waiting("allreduce(coord)")
    assert progress.state == WAITING and progress.where == "allreduce(coord)"
    time.sleep(0.01)
    progress.resume()
    assert progress.state == BUSY and progress.where == "backward" and progress.step == 4
    assert progress.since > t_busy


def test_slow_io_is_judged_by_the_io_allowance_and_returns_to_the_phase_it_interrupted() -> None:
    progress, policy = MainThreadProgress(), HangPolicy(fixed_timeout_s=8, io_allowance_s=600)
    progress.busy("repair", 5)
    try:
        with progress.slow_io(Phase.METRICS_IO):
            assert (progress.where, progress.step, progress.state) == (Phase.METRICS_IO, 5, BUSY)
            assert policy.busy_limit_s(progress.where) == 600
            raise OSError("wandb failed")
    except OSError:
        pass
    assert (progress.where, progress.step, progress.state) == ("repair", 5, BUSY)
    assert policy.busy_limit_s(progress.where) == 8
    assert (policy.is_slow_io("checkpoint") and policy.is_slow_io(Phase.METRICS_IO)
            and not policy.is_slow_io("optimizer"))


@given(st.lists(st.floats(0.0, 100.0), max_size=8), st.floats(OWN_PAUSE_S, 60.0))
def test_a_watchers_own_pause_never_counts_as_its_peers_silence(heard: list[float], paused: float) -> None:
    """A peer heard at t, then a pause of p of the watcher: on waking at now the peer's silence is at most
    now - (t + p), never the pause itself; a peer heard just now (its queued beats drained) stays at now."""
    now = 100.0 + paused
    excused = excuse_own_pause(heard, paused, now)
    assert len(excused) == len(heard)
    for before, after in zip(heard, excused):
        assert after <= now and now - after <= max(0.0, now - before - paused) + 1e-9
    assert excuse_own_pause([now], paused, now) == [now]


def test_a_kill_order_is_done_when_its_target_dies_or_runs_again_in_a_broken_replica() -> None:
    """The case of a CI failure: a paused node's two ranks were asked to kill each other; one killed its mate first
    and ran on. Its own kill order is done (its replica lost a rank), but never while it is silent now."""
    dead = {3}.__contains__
    ordered, now = 100.0, 105.0
    assert kill_order_done(True, (), dead, heard_at=50.0, ordered_at=ordered, now=now)  # the target died
    assert kill_order_done(False, (3,), dead, heard_at=now - 0.5, ordered_at=ordered, now=now)  # runs, mate gone
    # never heard since the order (a frozen target would hang the repair), or heard at the order's own time (both
    # moved to the same moment by the watcher's own pause)
    assert not kill_order_done(False, (3,), dead, heard_at=90.0, ordered_at=ordered, now=now)
    assert not kill_order_done(False, (3,), dead, heard_at=ordered, ordered_at=ordered, now=now)
    # heard once after the order, silent again since: frozen again, still owed
    assert not kill_order_done(False, (3,), dead, heard_at=ordered + 1.0, ordered_at=ordered, now=ordered + 10.0)
    assert not kill_order_done(False, (1,), dead, heard_at=now, ordered_at=ordered, now=now)  # replica whole: owed
    assert not kill_order_done(False, (), dead, heard_at=now, ordered_at=ordered, now=now)  # in the pool: owed
