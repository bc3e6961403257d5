"""A member of a recycled replica is watched by its *new* replica-mates (real processes, a real SIGSTOP).

3 replicas x TP2 = 6 ranks, recycling on. Replica 1 loses world rank 2 at step 2, replica 2 loses rank 5 at step 3:
their survivors, ranks 4 and 3, form replica 3 (rank 4 at coordinate 0, rank 3 at 1), which takes a free slot.
At step 5 rank 3 is frozen in forward, so rank 4 waits on it inside the new replica's tensor-parallel traffic. On
the original grid the two were never peers: rank 4 must still see its frozen mate (and wait for the silence kill),
not kill itself as stuck. The frozen rank is killed, the step is recovered on replica 0, every step commits M.
"""

from __future__ import annotations

import pytest

from nanotron_recover.launcher.runs import run_training
from nanotron_recover.run.run_folder import read_exits

pytestmark = pytest.mark.slow

STEPS = 7
M = 6  # dp 3 x accumulation 2
TIMEOUT_S = 300


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_a_recycled_member_waiting_on_a_frozen_new_mate_is_not_killed_as_stuck(tiny_config, tmp_path):
    inject = [{"step": 2, "replica": 1, "rank": 0, "phase": "backward"},
              {"step": 3, "replica": 2, "rank": 1, "phase": "backward"},
              {"step": 5, "replica": 3, "rank": 1, "phase": "forward", "signal": "stop"}]
    config = tiny_config(dp=3, tp=2, pp=1, accumulation=2, steps=STEPS, layers=2, checkpoint_interval=STEPS,
                         fault_tolerance={"enabled": True, "recycle": True, "reduce_bucket_mb": 0.01,
                                          "hang_timeout_s": 8, "collective_timeout_s": 60,
                                          "local_snapshot_interval": 0, "inject": inject})
    result = run_training(config, tmp_path, timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"], check=False)
    tail = result.output[-6000:]
    assert result.returncode == 0, tail
    (formed,) = result.events_of("replica_formed")
    assert [m["rank"] for m in formed["members"]] == [4, 3], formed
    hangs = result.events_of("hang_detected")
    assert not [h for h in hangs if h["reason"] == "stuck"], f"a healthy rank killed itself: {hangs}"
    silent = [h for h in hangs if h["reason"] == "silent"]
    assert silent and {h["rank"] for h in silent} == {3}, hangs
    # rank 4 watched its new mate: it saw rank 3's silence (on the grid alone it never heard of rank 3, and its
    # own stall came within milliseconds of its self-kill: a race the silence kill only just won)
    margin = read_exits(tmp_path)[4]["hang_margin"]
    assert margin["max_silence_of"].startswith("rank 3 ") and margin["max_silence_s"] >= 4, margin
    assert [s["step"] for s in result.steps] == list(range(1, STEPS + 1)), tail
    assert all(s["microbatches"] == M for s in result.steps), tail
    assert result.steps[-1]["live_replicas"] == 1 and result.steps[-1]["pool_ranks"] == [4], result.steps[-1]
    print(f"\nfrozen member of a recycled replica: killed by rank(s) {sorted({h['by_rank'] for h in silent})} "
          f"after {silent[0]['silent_s']:.1f} s of silence; no healthy rank killed")
