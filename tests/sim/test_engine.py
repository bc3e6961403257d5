import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanotron_recover.sim import policies as P
from nanotron_recover.sim.cluster import Cluster
from nanotron_recover.sim.engine import ScheduledFailure, simulate
from nanotron_recover.sim.params import Params

GPU = Params(mb_s=1.0, base_s=0.0, accumulation=2, tokens_per_microbatch=10, startup_s=0.0, exit_s=0.0,
             hang_fraction=0.0, node_fraction=0.0, detect_s=0.0, repair_s=0.0, ckpt_fixed_s=0.0,
             state_gb_per_rank=0.0, teardown_s=0.0, restart_fixed_s=5.0, restart_per_node_s=0.0)


def test_failure_free_run_trains_at_the_ideal_rate():
    c = Cluster(32, tp=4)
    r = simulate(c, P.recover(None), GPU, horizon_s=1000.0, random_failures=False)
    assert r.ettr == pytest.approx(1.0)
    assert r.steps == pytest.approx(1000.0 / 2.0)
    assert r.process_s == pytest.approx(32 * 1000.0)
    assert r.failures == 0 and r.tokens_lost_per_failure == 0.0


def test_process_seconds_of_a_finite_run():
    p = GPU.with_(startup_s=3.0, exit_s=1.5)
    r = simulate(Cluster(8), P.ckpt_restart(None), p, target_steps=10, random_failures=False)
    assert r.wall_s == pytest.approx(3.0 + 10 * 2.0 + 1.5)
    assert r.process_s == pytest.approx(8 * r.wall_s)
    assert r.tokens == 10 * 8 * 2 * 10


@pytest.mark.parametrize("mode", ["queue", "reset"])
def test_checkpoint_restart_matches_the_renewal_formula(mode):
    """Poisson failures at rate lam, each a rollback (half a step lost on average, a checkpoint every step) and a
    restart R: ETTR = (1 - lam R)(1 - lam L) when every failure costs its full restart (queue) and
    exp(-lam R)(1 - lam L) when a failure during a restart starts it again (reset)."""
    mttf_h, R, step = 1.0, 0.3 * 3600, 120.0
    p = GPU.with_(job_mttf_hours=mttf_h, restart_fixed_s=R, mb_s=step / 2, failure_during_stall=mode)
    lam, L = 1 / 3600, step / 2
    expect = (1 - lam * R if mode == "queue" else math.exp(-lam * R)) * (1 - lam * L)
    runs = [simulate(Cluster(8), P.ckpt_restart(1), p, horizon_s=400 * 3600.0, seed=s) for s in range(3)]
    got = sum(r.ettr for r in runs) / len(runs)
    assert got == pytest.approx(expect, abs=0.02)
    assert sum(r.crashes for r in runs) > 600


def test_recover_keeps_m_shrinking_drops_the_lost_microbatches():
    c, sched = Cluster(4), [ScheduledFailure(2.5, (3,))]
    rec = simulate(c, P.recover(None), GPU, target_steps=10, scheduled=sched, random_failures=False)
    shr = simulate(c, P.shrinking(None), GPU.with_(rejoin_s=1e9), target_steps=10, scheduled=sched,
                   random_failures=False)
    assert rec.tokens == pytest.approx(10 * 8 * 10)
    assert shr.tokens == pytest.approx((2.5 * 8 + 7.5 * 6) * 10)
    # M kept on 3 survivors: quota ceil(8 / 3) = 3 -> 3 s steps after the failure (2 s before), + orphans
    assert rec.wall_s == pytest.approx(2.5 * 2 + math.ceil(2 * 1 / 3) * 1.0 + 7.5 * 3)
    assert shr.wall_s == pytest.approx(10 * 2)


def test_a_spare_keeps_the_step_time():
    c, sched = Cluster(5), [ScheduledFailure(2.5, (0,))]
    p = GPU.with_(transfer_gb_per_s=1.0, state_gb_per_rank=2.0)
    spare = simulate(c, P.recover_spares(None, 1), p, target_steps=10, scheduled=sched, random_failures=False)
    plain = simulate(Cluster(4), P.recover(None), p, target_steps=10, scheduled=sched, random_failures=False)
    assert spare.spares_used == 1
    # the state transfer (2 GB at 1 GB/s) + the orphans of the failure step (2 over 4 replicas: 1 microbatch)
    assert spare.wall_s == pytest.approx(10 * 2 + 2.0 + 1.0)
    assert plain.wall_s > spare.wall_s


def test_below_min_replicas_the_job_requeues_at_full_size():
    c, sched = Cluster(4), [ScheduledFailure(2.5, (3,))]
    r = simulate(c, P.recover(None, min_replicas=4), GPU, target_steps=10, scheduled=sched, random_failures=False)
    assert (r.requeues, r.crashes) == (1, 0)
    # nothing lost: repair stall (0) + planned save (0) + exit (0) + restart 5 s, then 2 s steps again
    assert r.wall_s == pytest.approx(10 * 2 + 5.0)
    assert r.tokens == pytest.approx(10 * 8 * 10)


def test_a_node_loss_ends_the_job_as_coded_but_not_in_the_hypothetical_runtime():
    c = Cluster(16, gpus_per_node=4, tp=2)  # 8 slots, 2 per node
    sched = [ScheduledFailure(5.5, c.slots_of_node(1), kind="node")]
    kw = dict(target_steps=10, scheduled=sched, random_failures=False)
    coded = simulate(c, P.recover(4), GPU, **kw)
    hypo = simulate(c, P.recover_node_tolerant(4), GPU, **kw)
    no_snapshots = simulate(c, P.recover(4).with_(local_snapshots=False), GPU, **kw)
    assert coded.crashes == 1 and hypo.crashes == 0 and no_snapshots.crashes == 1
    # coded: back to the local snapshot of step 5, the half step in flight lost, restart 5 s
    assert coded.wall_s == pytest.approx(10 * 2 + 0.5 * 2 + 5.0)
    # without snapshots: back to the checkpoint at step 4, 1.5 steps lost
    assert no_snapshots.wall_s == pytest.approx(10 * 2 + 1.5 * 2 + 5.0)
    assert hypo.wall_s < coded.wall_s < no_snapshots.wall_s


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    gpus=st.integers(8, 256), rpr=st.sampled_from([1, 2, 4, 8]), mttf=st.floats(0.05, 5.0),
    node_fraction=st.floats(0.0, 1.0), spares=st.integers(0, 2), seed=st.integers(0, 10_000),
    which=st.sampled_from(["ckpt", "shrink", "recover", "spares", "recycle", "node_tolerant"]),
    mode=st.sampled_from(["queue", "reset"]),
)
def test_accounting_invariants(gpus, rpr, mttf, node_fraction, spares, seed, which, mode):
    if gpus // rpr < 4:
        return
    c = Cluster(gpus, tp=rpr)
    p = GPU.with_(job_mttf_hours=mttf, node_fraction=node_fraction, failure_during_stall=mode, hang_fraction=0.5)
    pol = {"ckpt": P.ckpt_restart(3), "shrink": P.shrinking(5), "recover": P.recover(5, 2),
           "spares": P.recover_spares(5, spares, 2), "recycle": P.recover_recycle(5, spares, 2),
           "node_tolerant": P.recover_node_tolerant(5, spares)}[which]
    r = simulate(c, pol, p, horizon_s=2 * 86400.0, seed=seed)
    assert 0.0 <= r.ettr <= 1.0 + 1e-9
    assert r.process_s <= c.gpus * r.wall_s * (1 + 1e-9)
    full_step_tokens = c.with_spares(pol.spare_replicas).replicas * p.accumulation * p.tokens_per_microbatch
    if pol.keep_m:
        assert r.tokens == pytest.approx(r.steps * full_step_tokens, rel=1e-6)
    else:
        assert r.tokens <= r.steps * full_step_tokens * (1 + 1e-9)
    assert r.crashes + r.requeues <= r.failures
    assert r.formations <= r.failures and (r.formations == 0 or pol.recycle)


def test_the_same_seed_gives_every_policy_the_same_failure_stream():
    c = Cluster(64, tp=8)
    p = GPU.with_(job_mttf_hours=0.5, node_fraction=0.0)
    a = simulate(c, P.recover_node_tolerant(None), p, horizon_s=86400.0, seed=3, log_events=True)
    b = simulate(c, P.shrinking(None), p.with_(rejoin_s=1.0), horizon_s=86400.0, seed=3, log_events=True)
    assert a.failures > 10
    assert [t for t, _ in a.events][:3] == pytest.approx([t for t, _ in b.events][:3])


def test_without_replacement_a_relaunch_regains_only_repaired_hardware():
    """replacement off (the scheduler gives back only what is healthy): a requeue below min_replicas restarts on
    the survivors, and a repaired slot comes back at the next relaunch after its repair."""
    c = Cluster(4)
    sched = [ScheduledFailure(2.5, (3,)), ScheduledFailure(4.5, (2,))]
    kw = dict(target_steps=10, scheduled=sched, random_failures=False)
    pol = P.recover(None, min_replicas=3)  # requeue on the second loss
    never = simulate(c, pol, GPU.with_(replacement=False, hw_repair_hours=1e9), **kw)
    quick = simulate(c, pol, GPU.with_(replacement=False, hw_repair_hours=1 / 3600), **kw)
    assert never.requeues == quick.requeues == 1
    # never repaired: the relaunch has 2 replicas (quota 4: 4 s steps); repaired within 1 s: 4 again (2 s steps)
    assert never.wall_s > quick.wall_s + 5 * 1.5
    assert never.tokens == quick.tokens == 10 * 8 * 10  # M kept either way


RECYCLE = GPU.with_(formation_s=3.0)  # a formation costs 3 s (no state to transfer: state_gb_per_rank 0)


def test_recycling_forms_a_replica_from_two_broken_replicas_survivors():
    """4 replicas x TP2, M = 8: slot 3 and then slot 2 lose a GPU; with recycling their two survivors form a
    replica, so 3 replicas compute after the second failure (quota 3) instead of 2 (quota 4)."""
    c, sched = Cluster(8, tp=2), [ScheduledFailure(2.5, (3,)), ScheduledFailure(4.5, (2,))]
    kw = dict(target_steps=10, scheduled=sched, random_failures=False)
    off = simulate(c, P.recover(None), RECYCLE, **kw)
    on = simulate(c, P.recover_recycle(None), RECYCLE, **kw)
    # before: 2 s steps; 3 replicas: quota 3 and 1 s of orphans; 2 replicas: 2 s of orphans (3 over 2), quota 4
    assert off.wall_s == pytest.approx(2.5 * 2 + 1 + 2 * 3 + 2 + 5.5 * 4)
    assert (off.formations, on.formations) == (0, 1)
    # recycling: the same until the second failure's orphans, then the formation (3 s) and quota 3 again
    assert on.wall_s == pytest.approx(2.5 * 2 + 1 + 2 * 3 + 2 + 3.0 + 5.5 * 3)
    assert on.tokens == off.tokens == pytest.approx(10 * 8 * 10)  # M kept either way
    # the pooled GPU holds hardware: 7 processes live between the failures (6 without recycling), then the formed
    # replica's 2 computing: 6 (4 without)
    assert off.process_s == pytest.approx(8 * 5 + 6 * (1 + 6) + 4 * (2 + 5.5 * 4))
    assert on.process_s == pytest.approx(8 * 5 + 7 * (1 + 6) + 6 * (2 + 3 + 5.5 * 3))


def test_a_pooled_gpu_that_dies_leaves_the_pool_and_a_formed_replica_that_breaks_goes_back_to_it():
    c = Cluster(8, tp=2)  # GPUs 2s, 2s+1 in slot s
    pool_death = [ScheduledFailure(2.5, (), gpus=(6,)), ScheduledFailure(3.5, (), gpus=(7,)),
                  ScheduledFailure(4.5, (), gpus=(4,))]
    r = simulate(c, P.recover_recycle(None), RECYCLE, target_steps=10, scheduled=pool_death, random_failures=False)
    assert (r.failures, r.formations) == (3, 0)  # GPU 7 died in the pool: GPU 5 waits alone
    formed_breaks = [ScheduledFailure(2.5, (), gpus=(6,)), ScheduledFailure(4.5, (), gpus=(4,)),
                     ScheduledFailure(6.5, (), gpus=(5,)), ScheduledFailure(7.5, (), gpus=(0,))]
    r = simulate(c, P.recover_recycle(None), RECYCLE, target_steps=10, scheduled=formed_breaks,
                 random_failures=False, log_events=True)
    # GPUs 5 and 7 form a replica after step 4.5; GPU 5 dies in it (7 back in the pool), slot 0 breaks: 7 and 1
    # form another
    assert (r.failures, r.formations) == (4, 2)
    assert r.tokens == pytest.approx(10 * 8 * 10)


def test_a_replica_formed_while_every_slot_is_held_waits_as_a_spare():
    """4 training replicas x TP2 + 2 spares: two failures use both spares and leave two survivors, which form a
    replica; every slot is held, so it waits as a spare and takes the third failure's slot: quota 2 throughout."""
    c = Cluster(12, tp=2)
    sched = [ScheduledFailure(2.5, (0,)), ScheduledFailure(4.5, (1,)), ScheduledFailure(6.5, (2,))]
    r = simulate(c, P.recover_recycle(None, spares=2), RECYCLE, target_steps=10, scheduled=sched,
                 random_failures=False)
    assert (r.spares_used, r.formations) == (3, 1)
    # 2 s steps throughout; each failure: 1 s of orphans (2 over 4 replicas); the formation: 3 s
    assert r.wall_s == pytest.approx(10 * 2 + 3 * 1 + 3.0)
    plain = simulate(c, P.recover_spares(None, 2), RECYCLE, target_steps=10, scheduled=sched, random_failures=False)
    assert plain.spares_used == 2 and plain.wall_s > r.wall_s  # the third failure leaves 3 replicas: quota 3
