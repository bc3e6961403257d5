"""Failure injection: schedule parsing, and a real SIGKILL of a real process at the scheduled (step, phase)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from nanotron_recover.process.inject import PHASES, FailureInjector, FailureSpec, parse_schedule

SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_parse_schedule_accepts_dicts_specs_and_json() -> None:
    entry = {"step": 3, "replica": 1, "rank": 0, "phase": "reduce"}
    assert parse_schedule([entry]) == [FailureSpec(3, 1, 0, "reduce")]
    assert parse_schedule(json.dumps([entry])) == [FailureSpec(3, 1, 0, "reduce")]
    assert parse_schedule(None) == [] and parse_schedule("") == []
    assert parse_schedule([FailureSpec(0, 0, 0, "forward")]) == [FailureSpec(0, 0, 0, "forward")]


@pytest.mark.parametrize(
    "bad",
    [
        {"step": 1, "replica": 0, "rank": 0, "phase": "lunch"},
        {"step": -1, "replica": 0, "rank": 0, "phase": "forward"},
        {"step": 1, "replica": 0, "rank": 0, "phase": "forward", "when": "now"},
    ],
)
def test_parse_schedule_rejects_bad_entries(bad: dict) -> None:
    with pytest.raises(ValueError):
        parse_schedule([bad])


def test_only_the_targeted_process_and_phase_fire() -> None:
    sched = [{"step": 2, "replica": 1, "rank": 1, "phase": "backward"}]
    me = FailureInjector(sched, my_replica=1, my_local_rank=1)
    other = FailureInjector(sched, my_replica=1, my_local_rank=0)
    assert me.will_fail(2, "backward")
    assert not me.will_fail(2, "forward") and not me.will_fail(3, "backward")
    assert not any(other.will_fail(2, p) for p in PHASES)
    for phase in PHASES:  # returns at once when not scheduled
        other.maybe_fail(2, phase)
        me.maybe_fail(1, phase)
    with pytest.raises(ValueError):
        me.maybe_fail(2, "lunch")


def test_maybe_fail_really_sigkills_after_a_flushed_log_line() -> None:
    prog = textwrap.dedent(
        """
        from nanotron_recover.process.inject import FailureInjector
        inj = FailureInjector([{"step": 1, "replica": 0, "rank": 0, "phase": "checkpoint"}], 0, 0)
        for step in range(3):
            print("step", step, flush=True)
            inj.maybe_fail(step, "checkpoint")
        print("survived", flush=True)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", prog], capture_output=True, text=True, timeout=30, env={"PYTHONPATH": SRC}
    )
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr)
    assert proc.stdout.split("\n")[:2] == ["step 0", "step 1"]
    assert "survived" not in proc.stdout
    assert "[inject] KILL replica 0 local rank 0" in proc.stderr and "step 1 phase checkpoint" in proc.stderr


def test_a_slow_entry_never_fires_a_signal_and_slows_only_its_rank_from_its_step() -> None:
    sched = [{"step": 3, "replica": 1, "rank": 0, "signal": "slow", "factor": 4},
             {"step": 5, "replica": 1, "rank": 0, "signal": "slow", "factor": 2}]
    assert parse_schedule(sched)[0] == FailureSpec(3, 1, 0, "backward", "slow", None, 4.0)
    me, other = FailureInjector(sched, 1, 0), FailureInjector(sched, 1, 1)
    assert not any(me.will_fail(s, p) for s in range(8) for p in PHASES)
    for phase in PHASES:
        me.maybe_fail(3, phase)  # returns at once: a straggler is no fault
    assert [me.slowdown.factor(s) for s in (2, 3, 4, 5, 9)] == [1.0, 4.0, 4.0, 2.0, 2.0]  # the latest entry begun
    assert other.slowdown.factor(9) == 1.0


def _timed_call(slowdown, step: int, microbatches: int, work_s: float) -> float:
    started = time.perf_counter()
    slowdown.begin()
    for _ in range(microbatches):
        slowdown.microbatch(step)
        time.sleep(work_s)
    slowdown.end(step, microbatches)
    return time.perf_counter() - started


def test_slowdown_really_takes_factor_times_as_long_per_microbatch() -> None:
    slowdown = FailureInjector([{"step": 2, "replica": 0, "signal": "slow", "factor": 3}], 0, 0).slowdown
    before = _timed_call(slowdown, 1, 4, 0.01)
    assert slowdown.per_microbatch_s == pytest.approx(0.01, rel=0.5)
    slowed = _timed_call(slowdown, 2, 4, 0.01)  # a sleep of 2 x its own time per microbatch, at each one
    assert 2.2 < slowed / before < 4.0
    fresh = FailureInjector([{"step": 1, "replica": 0, "signal": "slow", "factor": 2}], 0, 0).slowdown
    assert 1.5 < _timed_call(fresh, 1, 4, 0.01) / before < 2.8  # no time known yet: the sleep at the call's end


def test_slowdown_sleeps_after_the_fastest_call_not_a_contended_one() -> None:
    slowdown = FailureInjector([{"step": 3, "replica": 0, "signal": "slow", "factor": 3}], 0, 0).slowdown
    _timed_call(slowdown, 1, 4, 0.01)
    _timed_call(slowdown, 2, 4, 0.04)  # the host was busy: 4x slower for a call
    assert slowdown.per_microbatch_s == pytest.approx(0.01, rel=0.5)
    slowed = _timed_call(slowdown, 3, 4, 0.01)
    assert slowed < 4 * (0.01 + 2 * 0.02)  # 2 x 0.01 of sleep per microbatch, not 2 x 0.04


@pytest.mark.parametrize("bad", [
    {"step": 1, "replica": 0, "signal": "slow"},
    {"step": 1, "replica": 0, "signal": "slow", "factor": 1},
    {"step": 0, "replica": 0, "signal": "slow", "factor": 2, "phase": "startup"},
    {"step": 1, "replica": 0, "signal": "kill", "factor": 2},
])
def test_slow_entries_need_a_factor_above_1(bad: dict) -> None:
    with pytest.raises(ValueError, match="factor|phase"):
        parse_schedule([bad])


def test_a_nan_entry_poisons_one_forward_and_signals_nothing(tmp_path) -> None:
    injector = FailureInjector([{"step": 3, "replica": 0, "rank": 0, "phase": "forward", "signal": "nan"}], 0, 0,
                               run_dir=tmp_path)
    injector.maybe_fail(3, "backward")
    assert not injector.take_poison()
    injector.maybe_fail(3, "forward")  # returns: this process is not signalled
    assert injector.take_poison() and not injector.take_poison()  # one forward only
    with pytest.raises(ValueError, match="phase forward"):
        FailureSpec.from_dict({"step": 3, "replica": 0, "phase": "backward", "signal": "nan"})
