"""The CI slice of the randomized fault campaign (benchmarks/fault_campaign.py): a few trials drawn from a seed
that changes with every run (printed; ``NANOTRON_RECOVER_CAMPAIGN_SEED`` fixes it), so every submission meets
generated schedules, not only the scripted ones. Each trial is a real job with real signals; the campaign checks
its invariants (no stall, done or restart-then-done, M per step, the failure-free losses and weights, nothing left
running or in /dev/shm, no false hang kill) and this test asserts that none failed.
"""

from __future__ import annotations

import os
import re
import time

import pytest

from benchmarks import fault_campaign

TRIALS = 2  # each trial is a real job with relaunches: ~1 min on 2 cores; the full campaign runs outside CI
# The kinds a campaign has run clean (README, "Fault campaign"), so that a new seed tests new schedules of them
# and a red CI means a regression; a kind joins once a campaign of its own has passed. Left out: the start-up
# kinds (each costs a start-up timeout, ~110 s here; tests/ft/test_startup_faults.py scripts them).
KINDS = ",".join(("ext-kill", "ext-stop", "pair-same-replica", "pair-two-replicas", "second-in-repair", "phase",
                  "hang", "launcher-kill", "launcher-stop", "node-loss"))
pytestmark = [pytest.mark.slow, pytest.mark.timeout(TRIALS * 400 + 600)]


def test_a_seeded_slice_of_the_fault_campaign(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")  # the campaign's jobs run as a user's do (conftest.py turns it off)
    seed = int(os.environ.get("NANOTRON_RECOVER_CAMPAIGN_SEED", int(time.time()) % 1_000_000))
    recycle = "on" if seed % 2 else "shape"  # odd seeds: recycling in every shape, as the campaign ran it
    print(f"\nfault campaign slice: seed {seed} (rerun: python benchmarks/fault_campaign.py --seed {seed} "
          f"--trials {TRIALS} --kinds {KINDS} --recycle {recycle})")
    code = fault_campaign.main(["--trials", str(TRIALS), "--seed", str(seed), "--out", str(tmp_path), "--kinds", KINDS,
                                "--recycle", recycle])
    out = capsys.readouterr().out
    print(out)
    last = out.strip().splitlines()[-1]
    m = re.fullmatch(r"campaign_trials=(\d+) failures=(\d+) stalls=(\d+) false_kills=(\d+) seed=(\d+) "
                     r"in_place_relaunches=\d+ warm_relaunches=\d+", last)
    assert m and int(m[1]) == TRIALS and int(m[5]) == seed, last
    assert code == 0 and m[2] == "0" and m[3] == "0", out
