"""Survivors of failed replicas are recycled into a new replica (``fault_tolerance.recycle``).

Real ``nanotron-recover train`` jobs under ``mpirun --with-ft ulfm``, real SIGKILLs, a hard timeout on each run.
3 replicas x TP2 x PP2 = 12 ranks, no spares. One rank of replica 1 is killed in backward at step 5 and the
same coordinate of replica 2 in the cross-replica reduction at step 10: the 6 survivors stay in a pool, 4 of them
form a new replica after step 10 (from both broken replicas; coordinate 1 was nobody's, so one member changes
coordinate), 2 wait. Every step commits M microbatches, and the losses and final weights match the failure-free
run. A second run adds faults inside the formations: a pool rank that is not a member dies as one begins, a member
dies before its torch rendezvous, and a member of the next one in its state transfer. A third loses the donor of a
transfer and then a rank waiting in the pool.
"""

from __future__ import annotations

import pytest

from nanotron_recover.launcher.runs import final_checkpoint, max_loss_diff, max_relative_param_diff, run_training
from nanotron_recover.run.run_folder import read_metrics_jsonl

pytestmark = pytest.mark.slow

STEPS = 14
TIMEOUT_S = 420
TOL = 1e-5
M = 6  # dp 3 x accumulation 2


def recycle_config(tiny_config, inject: list[dict]) -> dict:
    return tiny_config(
        dp=3, tp=2, pp=2, accumulation=2, steps=STEPS, checkpoint_interval=STEPS,
        fault_tolerance={"enabled": True, "recycle": True, "reduce_bucket_mb": 0.01, "hang_timeout_s": 30,
                         "collective_timeout_s": 20, "local_snapshot_interval": 0, "inject": inject},
    )


def tp2_config(tiny_config, inject: list[dict], *, dp: int, steps: int, hang_timeout_s: float,
               collective_timeout_s: float, **shape: int) -> dict:
    """``dp`` replicas x TP2, no pipeline, recycling on, a checkpoint at step 10, no node-local snapshots."""
    return tiny_config(dp=dp, tp=2, pp=1, accumulation=2, steps=steps, checkpoint_interval=10, **shape,
                       fault_tolerance={"enabled": True, "recycle": True, "reduce_bucket_mb": 0.01,
                                        "hang_timeout_s": hang_timeout_s, "collective_timeout_s": collective_timeout_s,
                                        "local_snapshot_interval": 0, "inject": inject})


_REFERENCE: list = []


@pytest.fixture
def reference(tiny_config, tmp_path_factory):
    """The failure-free run (once per module)."""
    if not _REFERENCE:
        _REFERENCE.append(run_training(recycle_config(tiny_config, []), tmp_path_factory.mktemp("ref"),
                                       timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"]))
    return _REFERENCE[0]


def assert_same_trajectory(result, reference) -> tuple[float, float]:
    tail = result.output[-6000:]
    assert [s["step"] for s in result.steps] == list(range(1, STEPS + 1)), tail
    assert all(s["microbatches"] == M for s in result.steps), tail
    diff = max_loss_diff(result, reference)
    assert diff <= TOL, f"max |dloss| {diff:.2e}\n{tail}"
    rel = max_relative_param_diff(final_checkpoint(result.run_dir), final_checkpoint(reference.run_dir))
    assert rel <= TOL, f"final weights rel. diff {rel:.2e}"
    return diff, rel


@pytest.mark.timeout(2 * TIMEOUT_S + 60)
def test_survivors_of_two_broken_replicas_form_a_new_one(tiny_config, reference, tmp_path):
    inject = [{"step": 5, "replica": 1, "rank": 1, "phase": "backward"},
              {"step": 10, "replica": 2, "rank": 1, "phase": "reduce"}]
    result = run_training(recycle_config(tiny_config, inject), tmp_path / "run", timeout_s=TIMEOUT_S,
                          extra_args=["--synthetic-data"])
    tail = result.output[-6000:]
    diff, rel = assert_same_trajectory(result, reference)
    (formed,) = result.events_of("replica_formed")
    members = formed["members"]
    assert formed["step"] == 10 and formed["slot"] is not None, formed
    assert {m["old_replica"] for m in members} == {1, 2}, formed
    assert any(m["old_coordinate"] != m["coordinate"] for m in members), formed
    assert sorted(formed["pool_ranks"]) and len(formed["pool_ranks"]) == 2, formed
    new_id = formed["replica"]
    for s in result.steps:
        if s["step"] > 10:
            assert s["live_replicas"] == 2 and s["quotas"].get(str(new_id), 0) > 0, s
            assert len(s["pool_ranks"]) == 2, s
    assert result.events_of("pool_changed"), tail
    (activated,) = [e for e in result.events_of("spare_activated") if e["replicas"] == [new_id]]

    print(f"\nrecycle: replica {new_id} formed after step 10 from ranks {[m['rank'] for m in members]} "
          f"(coordinates {[(m['old_replica'], m['old_coordinate'], m['coordinate']) for m in members]}), "
          f"active {activated['formed_to_active_ms']:.0f} ms after its formation (state transfer "
          f"{activated['transfer_ms']:.0f} ms); max |dloss| {diff:.2e}; final weights rel. diff {rel:.2e}")



@pytest.mark.timeout(2 * TIMEOUT_S + 60)
def test_faults_inside_formations_keep_the_trajectory(tiny_config, reference, tmp_path):
    """As above up to step 10, where the pool (4, 6, 7, 8, 10, 11) starts forming replica 3 of ranks 4, 8, 6, 7.
    - Pool rank 10, not a member, dies as the formation begins: replica 3 is abandoned, its members go back.
    - The 5 left form replica 4 (the same members); its coordinate-2 member dies before the torch rendezvous: the
      repair breaks replica 4 and sends its survivors back.
    - The 4 left form replica 5; its coordinate-1 member dies in the state transfer: replica 5 breaks too.
    Steps 11-14 run on replica 0 alone (3 ranks wait in the pool), with M microbatches each."""
    inject = [{"step": 5, "replica": 1, "rank": 1, "phase": "backward"},
              {"step": 10, "replica": 2, "rank": 1, "phase": "reduce"},
              {"step": 10, "replica": 2, "rank": 2, "phase": "forming"},  # world rank 10, in the pool: its old name
              {"step": 10, "replica": 4, "rank": 2, "phase": "rendezvous"},
              {"step": 10, "replica": 5, "rank": 1, "phase": "transfer"}]
    result = run_training(recycle_config(tiny_config, inject), tmp_path, timeout_s=TIMEOUT_S,
                          extra_args=["--synthetic-data"])
    tail = result.output[-6000:]
    diff, rel = assert_same_trajectory(result, reference)
    formed = result.events_of("replica_formed")
    assert [(f["replica"], f["step"]) for f in formed] == [(5, 10)], formed  # 3 and 4 never completed
    repairs = [(e["phase"], e["failed_ranks"], e["failed_replicas"]) for e in result.events_of("repair")
               if e["step"] == 10]
    assert [r[0] for r in repairs] == ["in-step", "replica-formation", "replica-formation", "spare-activation"], tail
    assert repairs[1][1:] == ([10], []) and repairs[2][2] == [4] and repairs[3][2] == [5], repairs
    for s in result.steps:
        if s["step"] > 10:
            assert s["live_replicas"] == 1 and len(s["pool_ranks"]) == 3, s
    print(f"\nrecycle under faults: replica 3 abandoned (pool rank 10 died as it formed), replica 4 lost a member "
          f"before its rendezvous, replica 5 one in its state transfer; repairs at step 10: {repairs}; "
          f"max |dloss| {diff:.2e}; final weights rel. diff {rel:.2e}")


@pytest.mark.timeout(2 * TIMEOUT_S + 60)
def test_the_donor_dying_in_the_transfer_hands_it_to_another_replica(tiny_config, tmp_path):
    """4 replicas x TP2 (8 ranks): replicas 1 and 2 each lose a rank; their survivors (ranks 3 and 4) form replica 4.
    Replica 0, the donor, has a rank frozen (SIGSTOP) right before the state transfer, so coordinate 0's broadcast
    completes and coordinate 1's waits until the hang detector kills the frozen rank: the whole transfer is done
    again from replica 3 (coordinate 0's too), and replica 0's survivor waits in the pool, where it dies at step 8."""
    def config(inject):
        return tp2_config(tiny_config, inject, dp=4, steps=10, hang_timeout_s=8, collective_timeout_s=20)
    reference = run_training(config([]), tmp_path / "ref", timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"])
    inject = [{"step": 3, "replica": 1, "rank": 0, "phase": "backward"},
              {"step": 5, "replica": 2, "rank": 1, "phase": "reduce"},
              {"step": 5, "replica": 0, "rank": 1, "phase": "transfer", "signal": "stop"},
              {"step": 8, "replica": 0, "rank": 0, "phase": "optimizer"}]  # the pool rank: its old name
    result = run_training(config(inject), tmp_path / "run", timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"])
    tail = result.output[-6000:]
    assert [s["step"] for s in result.steps] == list(range(1, 11)), tail
    assert all(s["microbatches"] == 8 for s in result.steps), tail
    (formed,) = result.events_of("replica_formed")
    assert formed["step"] == 5 and [m["rank"] for m in formed["members"]] == [4, 3], formed
    repairs = [e for e in result.events_of("repair") if e["phase"] == "spare-activation"]
    assert repairs and repairs[0]["failed_replicas"] == [0], tail
    (activated,) = [e for e in result.events_of("spare_activated") if e["replicas"] == [4]]
    assert activated["donor"] == 3, activated
    died = [e for e in result.events_of("pool_changed") if e["died"]]
    assert died and died[0]["died"] == [0] and died[0]["step"] in (8, 9), result.events_of("pool_changed")
    for s in result.steps:
        if s["step"] > 5:
            assert s["live_replicas"] == 2 and s["quotas"]["4"] > 0, s
            assert s["pool_ranks"] == ([0] if s["step"] < died[0]["step"] else []), s
    diff = max_loss_diff(result, reference)
    rel = max_relative_param_diff(final_checkpoint(result.run_dir), final_checkpoint(reference.run_dir))
    assert diff <= TOL and rel <= TOL, f"max |dloss| {diff:.2e}, weights {rel:.2e}\n{tail}"
    print(f"\nrecycle, donor lost in the transfer: replica 4 got its state from replica 3 "
          f"({activated['transfer_ms']:.0f} ms); max |dloss| {diff:.2e}; final weights rel. diff {rel:.2e}")


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_two_replicas_broken_in_one_step_form_a_replica_without_a_false_hang_kill(tiny_config, tmp_path):
    """3 replicas x TP2, recycling, hang_timeout_s 15: one rank each of replicas 0 and 1 killed in the same step.
    Their survivors form a new replica at once; each new peer is judged as building its replica until first
    heard (before: by the 15-s step timeout from the moment it was watched, so a survivor not yet beating to its
    new mate was killed as "silent" at "step 0 start-up", breaking the replica just formed)."""
    config = tiny_config(dp=3, tp=2, accumulation=2, steps=8, layers=2, checkpoint_interval=8,
                         fault_tolerance={"enabled": True, "recycle": True, "hang_timeout_s": 15,
                                          "local_snapshot_interval": 0,
                                          "inject": [{"step": 4, "replica": 0, "rank": 0, "phase": "backward"},
                                                     {"step": 4, "replica": 1, "rank": 1, "phase": "backward"}]})
    result = run_training(config, tmp_path, timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"])
    assert [s["step"] for s in result.steps] == list(range(1, 9)) and all(s["microbatches"] == 6 for s in result.steps)
    assert result.steps[-1]["live_replicas"] == 2, result.steps[-1]  # replica 2 and the one formed from the pool
    assert result.events_of("hang_detected") == [], result.events_of("hang_detected")


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_mates_lost_in_the_update_form_their_replica_at_the_step_where_the_others_meet_the_loss(tiny_config,
                                                                                               tmp_path):
    """3 replicas x TP2, recycling: one rank each of replicas 1 and 2 dies as the update of step 4 begins (the step
    is committed). Their mates are pooled inside that update; replica 0 has finished its own and meets the loss in
    step 5's reduction. The new replica is formed at step 5's boundary on every rank, and training goes on with
    the failure-free losses and weights through the checkpoint of step 10 (a suite run once saw mates pooled in the
    update form their replica at step 4's boundary, which replica 0 had passed: the new replica counted steps and
    stepped its LR one behind replica 0's, and both deadlocked at the checkpoint)."""
    def config(inject: list[dict]) -> dict:
        return tp2_config(tiny_config, inject, dp=3, steps=12, hang_timeout_s=30, collective_timeout_s=60, layers=2)
    reference = run_training(config([]), tmp_path / "ref", timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"])
    inject = [{"step": 4, "replica": 1, "rank": 1, "phase": "optimizer"},
              {"step": 4, "replica": 2, "rank": 0, "phase": "optimizer"}]
    result = run_training(config(inject), tmp_path / "run", timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"])
    tail = result.output[-6000:]
    logged = [r["step"] for r in read_metrics_jsonl(result.run_dir) if "event" not in r and "step" in r]
    assert logged == list(range(1, 13)), (logged, tail)  # each step once, by one logging rank
    assert all(s["microbatches"] == 6 for s in result.steps), tail
    (formed,) = result.events_of("replica_formed")
    assert formed["step"] == 5 and sorted(m["rank"] for m in formed["members"]) == [2, 5], formed
    assert [s["live_replicas"] for s in result.steps if s["step"] in (4, 5, 6)] == [3, 1, 2], tail
    assert result.events_of("hang_detected") == [], tail
    diff = max_loss_diff(result, reference)
    rel = max_relative_param_diff(final_checkpoint(result.run_dir), final_checkpoint(reference.run_dir))
    assert diff <= TOL and rel <= TOL, f"max |dloss| {diff:.2e}, weights {rel:.2e}\n{tail}"
    print(f"\nrecycle, mates lost in the update of step 4: replica {formed['replica']} formed at step 5 of ranks "
          f"{[m['rank'] for m in formed['members']]}; max |dloss| {diff:.2e}; final weights rel. diff {rel:.2e}")


@pytest.mark.timeout(TIMEOUT_S)
def test_a_pooled_rank_removes_its_broken_replicas_snapshot_files(tiny_config, tmp_path):
    """3 replicas x TP2, node-local snapshots every step. Replica 1 loses a rank at step 3: its mate is pooled and
    removes replica 1's files on its node (its own and the dead mate's: no live replica needs them). Replica 2
    breaks at step 5 too, below ``min_replicas`` 2: the job ends with the restart outcome, its snapshots kept for
    the relaunch; replica 1's are not among them (kept, they held the node's memory for nothing, and for ever on a
    node where no rank of the run is left to remove its folder)."""
    from nanotron_recover.run.exit_codes import EXIT_RESTART

    store = tmp_path / "shm"
    inject = [{"step": 3, "replica": 1, "rank": 1, "phase": "backward"},
              {"step": 5, "replica": 2, "rank": 1, "phase": "backward"}]
    config = tiny_config(dp=3, tp=2, accumulation=2, steps=STEPS, checkpoint_interval=STEPS,
                         fault_tolerance={"enabled": True, "recycle": True, "min_replicas": 2,
                                          "local_snapshot_dir": str(store), "local_snapshot_interval": 1,
                                          "inject": inject})
    result = run_training(config, tmp_path / "run", timeout_s=TIMEOUT_S,
                          extra_args=["--synthetic-data", "--max-restarts", "0"], check=False)
    assert result.returncode == EXIT_RESTART, result.output[-4000:]
    assert [e["joined"] for e in result.events_of("pool_changed")][:1] == [[2]], result.output[-4000:]
    files = sorted(p.name for p in store.rglob("*.snap"))
    assert any(name.startswith("r0-") for name in files), files  # the relaunch's
    assert not [name for name in files if name.startswith("r1-")], files
