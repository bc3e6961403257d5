"""The start-up clock's phases: what a relaunch's start-up is made of, as the run's ``startup`` event says it."""

from __future__ import annotations

import time

from nanotron_recover.process.startup_clock import StartupClock, process_start_time


def test_phases_are_the_gaps_between_marks_in_order_and_a_repeated_phase_is_summed():
    clock = StartupClock()
    clock.started = 100.0
    clock._marks = [("imports", 101.5), ("MPI_Init", 102.0), ("imports", 103.0), ("world", 103.25)]
    assert clock.phases_s() == {"imports": 2.5, "MPI_Init": 0.5, "world": 0.25}
    assert list(clock.phases_s()) == ["imports", "MPI_Init", "world"]


def test_marks_after_ready_are_ignored_and_ready_closes_with_the_agreement():
    clock = StartupClock()
    clock.restart()  # a released standby: the clock starts now
    clock.mark("model")
    clock.ready()
    clock.mark("a rebuild after start-up")
    phases = clock.phases_s()
    assert list(phases) == ["model", "start-up agreement"]
    assert clock.seconds is not None and abs(sum(phases.values()) - clock.seconds) < 1e-6


def test_restart_forgets_the_marks_of_the_time_before_the_release():
    clock = StartupClock()
    clock.mark("imports before the release")
    clock.restart()
    assert clock.phases_s() == {}
    assert clock.started >= time.time() - 1.0


def test_the_process_start_time_is_in_the_past_and_recent():
    started = process_start_time()
    assert time.time() - 3600 * 24 < started <= time.time()
