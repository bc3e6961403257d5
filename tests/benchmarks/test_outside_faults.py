"""The faults the side-by-side benchmarks send from outside: the seeded fault mix (the same for every system) and
the driver's SIGSTOP, continued when its time comes or when the run ends (real processes, real signals)."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

from benchmarks.fault_mix import PUBLISHED, drift_free, paced_share, published_gap_s
from benchmarks.lib.outside_faults import KILL, STOP, Fault, FaultDriver, fault_mix


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_the_fault_mix_is_seeded_random_and_shaped_as_asked() -> None:
    a = fault_mix(7, mean_gap_s=10.0, horizon_s=20000.0, stop_share=0.3, stop_s=8.0)
    assert a == fault_mix(7, mean_gap_s=10.0, horizon_s=20000.0, stop_share=0.3, stop_s=8.0)  # every system alike
    assert a != fault_mix(8, mean_gap_s=10.0, horizon_s=20000.0, stop_share=0.3, stop_s=8.0)
    times = [f.at_s for f in a]
    assert times == sorted(times) and times[-1] <= 20000.0
    gaps = [b - x for x, b in zip([0.0, *times], times)]
    assert 9.0 < statistics.mean(gaps) < 11.0 and statistics.pstdev(gaps) > 5.0  # exponential: not a clock
    stops = [f for f in a if f.kind == STOP]
    assert 0.25 < len(stops) / len(a) < 0.35 and all(f.stop_s == 8.0 for f in stops)
    assert all(f.kind == KILL and f.stop_s == 0.0 for f in a if f not in stops)
    assert all(0.0 <= f.u < 1.0 for f in a) and len({f.u for f in a}) == len(a)


def test_the_published_rate_per_group_scales_with_the_groups() -> None:
    per_group_s = PUBLISHED["minutes"] * 60 * PUBLISHED["groups"] / PUBLISHED["faults"]
    assert published_gap_s(1) == per_group_s and published_gap_s(4) == per_group_s / 4
    assert abs(published_gap_s(PUBLISHED["groups"]) - 30 * 60 / 62) < 1e-9  # the published run's own gap


def test_a_stopped_process_is_continued_after_its_stop_and_at_release() -> None:
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        faults = [Fault(at_s=0.0, replica=0, kind=STOP, stop_s=0.5), Fault(at_s=0.0, replica=1, kind=STOP,
                                                                             stop_s=600.0)]
        announced: list[tuple[int, str, str]] = []  # (n, kind, the target's state when announced: not yet stopped)
        targets = {0: procs[0].pid, 1: procs[1].pid}
        driver = FaultDriver(faults, before_signal=lambda n, f: announced.append((n, f.kind,
                                                                                 _state(targets[f.replica]))))
        driver.poll(lambda: 1, lambda: targets)
        assert [k.kind for k in driver.sent] == [STOP, STOP] and [k.pid for k in driver.sent] == list(targets.values())
        assert [(n, kind) for n, kind, _ in announced] == [(0, STOP), (1, STOP)]
        assert all(state != "T" for _, _, state in announced)  # the marker is left before the signal
        time.sleep(0.2)
        assert _state(procs[0].pid) == "T" and _state(procs[1].pid) == "T"
        deadline = time.time() + 5
        while _state(procs[0].pid) == "T" and time.time() < deadline:
            time.sleep(0.1)
            driver.poll(lambda: 1, lambda: targets)
        assert _state(procs[0].pid) != "T" and _state(procs[1].pid) == "T"  # its stop is over, the other's not
        driver.release()  # the run ended: nothing stays stopped
        time.sleep(0.2)
        assert _state(procs[1].pid) != "T"
        assert all(p.poll() is None for p in procs)  # stopped and continued, never killed
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_kill_is_sent_to_the_drawn_live_replica() -> None:
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]
    try:
        driver = FaultDriver([Fault(at_s=0.0, u=0.5)], t0=time.time())
        driver.poll(lambda: 1, lambda: {0: procs[0].pid, 2: procs[2].pid})  # replica 1 is gone: draw among 0, 2
        assert procs[2].wait(timeout=5) == -9 and procs[0].poll() is None and procs[1].poll() is None
        assert driver.sent[0].replica == 2 and driver.sent[0].kind == KILL
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _steps(n: int, pace: float, slow: dict[int, tuple[float, int, int]]) -> dict[int, dict]:
    """n steps one ``pace`` apart at full width (2 replicas, M = 4); ``slow``: step -> (extra s, participants, mbs)."""
    out, t = {}, 100.0
    for s in range(1, n + 1):
        extra, participants, microbatches = slow.get(s, (0.0, 2, 4))
        t += pace + extra
        out[s] = {"time": t, "participants": participants, "microbatches": microbatches}
    return out


def test_each_run_is_measured_against_its_own_pace() -> None:
    """A failure-free run on a slower machine (0.4 s steps) and a mix run on a faster one (0.3 s) with 6 s lost to a
    fault over 3 degraded steps: the pace of each is its own, the fault's cost is the 6 s, whatever the drift; a
    dropped share (2 of 4 microbatches in a step) counts against kept throughput."""
    n = 101
    ff = _steps(n, 0.4, {})
    mix = _steps(n, 0.3, {50: (2.0, 1, 4), 51: (2.0, 1, 4), 52: (2.0, 1, 4)})
    pace, share = paced_share(ff, n, 2, 4)
    assert abs(pace - 0.4) < 1e-9 and abs(share - 1.0) < 1e-9
    pace, share = paced_share(mix, n, 2, 4)
    assert abs(pace - 0.3) < 1e-9 and abs(share - 30.0 / 36.0) < 1e-9
    args = argparse.Namespace(steps=n, replicas=2, accumulation=2)
    d = drift_free(ff, mix, args, faults=1)
    assert abs(d["fault_cost_s"] - 6.0) < 1e-9 and abs(d["kept_throughput_drift_free"] - 30.0 / 36.0) < 1e-9
    dropped = _steps(n, 0.3, {50: (0.0, 1, 2)})
    assert abs(drift_free(ff, dropped, args, faults=1)["kept_throughput_drift_free"] - (1 - 2 / (4 * n))) < 1e-9


def test_a_process_stopped_twice_goes_on_at_its_latest_stop_s_end() -> None:
    proc = subprocess.Popen(["sleep", "60"])
    try:
        driver = FaultDriver([Fault(at_s=0.0, replica=0, kind=STOP, stop_s=0.3),
                              Fault(at_s=0.0, replica=0, kind=STOP, stop_s=600.0)], t0=time.time())
        driver.poll(lambda: 1, lambda: {0: proc.pid})
        time.sleep(0.6)
        driver.poll(lambda: 1, lambda: {0: proc.pid})  # the first stop's end has passed: the second one holds
        assert _state(proc.pid) == "T" and len(driver.stopped) == 1
        driver.release()
        time.sleep(0.2)
        assert _state(proc.pid) != "T"
    finally:
        proc.kill()
        proc.wait()
