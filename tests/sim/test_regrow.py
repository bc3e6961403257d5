"""Regrow (issue #40) in the simulator: the cost rule and the engine's relaunch at full width."""

import math

import pytest

from nanotron_recover.sim import policies as P
from nanotron_recover.sim.cluster import Cluster
from nanotron_recover.sim.engine import ScheduledFailure, simulate
from nanotron_recover.sim.params import Params
from nanotron_recover.sim.regrow import at_first_loss, decide

# every cost but the step and the relaunch at zero: the arithmetic below is exact
GPU = Params(mb_s=1.0, base_s=0.0, accumulation=2, tokens_per_microbatch=10, startup_s=0.0, exit_s=0.0,
             hang_fraction=0.0, node_fraction=0.0, detect_s=0.0, repair_s=0.0, ckpt_fixed_s=0.0,
             state_gb_per_rank=0.0, teardown_s=0.0, restart_fixed_s=5.0, restart_per_node_s=0.0,
             warm_relaunch_s=1.0, warm_relaunch_per_node_s=0.0, job_mttf_hours=1.0)
LOSSES = [ScheduledFailure(10.5, (0,)), ScheduledFailure(20.5, (1,)), ScheduledFailure(40.5, (2,))]


def test_decide_is_the_cost_rule():
    d = decide(step_now_s=8.0, step_full_s=6.0, relaunch_s=10.0, horizon_s=100.0)
    assert d.degraded_cost_s == pytest.approx(25.0) and d.regrow
    assert not decide(8.0, 6.0, 25.0, 100.0).regrow  # a tie does not pay
    assert not decide(6.0, 6.0, 0.0, 100.0).regrow  # nothing to gain: not even a free relaunch
    assert not decide(8.0, 6.0, math.inf, math.inf).regrow
    with pytest.raises(ValueError):
        decide(0.0, 6.0, 1.0, 1.0)


def test_the_decision_at_the_first_loss_follows_the_relaunch_cost():
    c = Cluster(100_000, tp=8, pp=8)
    warm, cold = at_first_loss(c, Params(), warm=True), at_first_loss(c, Params(), warm=False)
    assert warm.step_now_s > warm.step_full_s
    assert warm.horizon_s == pytest.approx(Params().mttf_hours(c.job_gpus) * 3600)
    assert warm.relaunch_s < warm.degraded_cost_s < cold.relaunch_s  # at 100k: warm pays, cold does not
    assert warm.regrow and not cold.regrow


def test_an_infinite_relaunch_cost_is_recover_as_coded():
    c = Cluster(16384, tp=8, pp=8)
    p = Params(warm_relaunch_s=math.inf, cold_relaunch_s=math.inf)
    for seed in (0, 1):
        base = simulate(c, P.recover(60, 1), p, horizon_s=3 * 86400, seed=seed)
        for warm in (True, False):
            r = simulate(c, P.recover_regrow(60, 1, warm), p, horizon_s=3 * 86400, seed=seed)
            assert r.regrows == 0 and r.regrow_declined > 0
            assert r.tokens == pytest.approx(base.tokens, rel=1e-9) and r.failures == base.failures
            assert r.crashes == base.crashes


def test_a_free_relaunch_is_never_worse_and_comes_back_to_full_width():
    c = Cluster(32, tp=4)  # 8 replicas
    p = GPU.with_(warm_relaunch_s=0.0)
    base = simulate(c, P.recover(None), p, target_steps=60, scheduled=LOSSES, random_failures=False)
    r = simulate(c, P.recover_regrow(None, warm=True), p, target_steps=60, scheduled=LOSSES, random_failures=False,
                 log_events=True)
    assert r.regrows == 3 and r.wall_s < base.wall_s and r.tokens == base.tokens
    # each loss: the orphaned microbatches (1 s) and the rest of its step at quota 3 (0.5 x 3 s instead of 1 s);
    # every other step at full width: the relaunches cost nothing
    assert r.wall_s == pytest.approx(60 * 2.0 + 3 * (1.0 + 0.5))
    assert [e for _, e in r.events].count("regrow: relaunch at full width") == 3


def test_the_regrow_waits_for_the_step_boundary_and_pays_its_relaunch():
    c = Cluster(32, tp=4)
    r = simulate(c, P.recover_regrow(None, warm=True), GPU, target_steps=30,
                 scheduled=[ScheduledFailure(10.5, (0,))], random_failures=False)
    # 10.5 steps at 2 s, the orphans (1 s), the rest of step 11 at 7 replicas' quota ceil(16 / 7) = 3: 1.5 s, the
    # relaunch 1 s, 19 steps at 2 s
    assert r.regrows == 1 and r.wall_s == pytest.approx(10.5 * 2.0 + 1.0 + 0.5 * 3.0 + 1.0 + 19 * 2.0)


@pytest.mark.parametrize("warm", [True, False])
def test_random_failures_regrow_never_loses_when_the_relaunch_is_free(warm):
    c = Cluster(16384, tp=8, pp=8)
    p = Params(warm_relaunch_s=0.0, warm_relaunch_per_node_s=0.0, cold_relaunch_s=0.0)
    for seed in (0, 1, 2):
        base = simulate(c, P.recover(60, 1), p, horizon_s=3 * 86400, seed=seed)
        r = simulate(c, P.recover_regrow(60, 1, warm), p, horizon_s=3 * 86400, seed=seed)
        assert r.regrows > 0 and r.ettr > base.ettr


def test_lost_slots_stay_out_until_their_replacement_arrives():
    c = Cluster(32, tp=4)
    p = GPU.with_(regrow_replacement_hours=1.0 / 60)  # a replacement node 60 s after the loss
    r = simulate(c, P.recover_regrow(None, warm=True), p, target_steps=100,
                 scheduled=[ScheduledFailure(10.5, (0,))], random_failures=False, log_events=True)
    assert r.regrows == 1
    regrow_t = next(t for t, e in r.events if e.startswith("regrow: relaunch"))
    assert regrow_t >= 10.5 * 2.0 + 60.0 - 1e-6  # nothing to come back to before the replacement
    never = simulate(c, P.recover_regrow(None, warm=True), GPU.with_(regrow_replacement_hours=1e6),
                     target_steps=100, scheduled=[ScheduledFailure(10.5, (0,))], random_failures=False)
    assert never.regrows == 0 and never.regrow_declined == 0


def test_decisions_are_deterministic_for_a_seed():
    c = Cluster(16384, tp=8, pp=8)
    runs = [simulate(c, P.recover_regrow(60, 1, True), Params(), horizon_s=86400, seed=7, log_events=True)
            for _ in range(2)]
    assert runs[0].events == runs[1].events and runs[0].decisions == runs[1].decisions
    assert runs[0].decisions and all(d.regrow for d in runs[0].decisions[:1])


def test_plan_recommends_regrow_with_its_numbers(capsys):
    from nanotron_recover.sim.plan import main

    main(["--gpus", "16384", "--tp", "8", "--pp", "8", "--days", "1", "--seeds", "1"])
    out = capsys.readouterr().out
    for name in ("recover_regrow_warm", "recover_regrow_cold"):
        assert f"| {name} |" in out
    assert "fault_tolerance.regrow: auto" in out and "warm, one replica lost: regrow: step 6.5 s now" in out
    assert "warm_relaunch_s | 1.5 | assumption" in out and "= cold relaunch at job" in out
    main(["--gpus", "16384", "--tp", "8", "--pp", "8", "--days", "1", "--seeds", "1",
          "--set", "warm_relaunch_s=inf", "--set", "cold_relaunch_s=inf"])
    assert "fault_tolerance.regrow: off" in capsys.readouterr().out
