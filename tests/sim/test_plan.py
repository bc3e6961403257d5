import re

import pytest

from nanotron_recover.launcher.launch import main as launch_main
from nanotron_recover.sim.plan import main

RESULTS = __import__("pathlib").Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "headline.json"


def test_plan_prints_every_policy_and_the_recommendations(capsys):
    assert launch_main(["plan", "--gpus", "1024", "--tp", "8", "--pp", "4", "--days", "3", "--seeds", "1"]) == 0
    out = capsys.readouterr().out
    for name in ("ckpt_restart", "shrinking", "recover", "recover_spares", "recover_recycle", "recover_node_tolerant"):
        assert f"| {name} |" in out
    for key in ("spare_replicas:", "min_replicas:", "checkpoint_interval:", "Young/Daly",
                "or leave it out: auto, this rule in the run"):
        assert key in out
    assert "needs the node-tolerant runtime" in out and "NANOTRON_RECOVER_RUNTIME" in out and "recycling" in out
    assert re.search(r"fault_tolerance\.recycle: (true|false) +\(recover_recycle ETTR [0-9.]+ vs [0-9.]+ without", out)
    assert "job_mttf_hours | 7.9 (at 1024 GPUs)" in out  # the 2410.21680 anchor at 1k GPUs


def test_mttf_and_overrides_reach_the_simulation(capsys):
    main(["--gpus", "512", "--tp", "8", "--mttf-hours", "0.5", "--set", "node_fraction=0.5",
          "--days", "2", "--seeds", "1"])
    out = capsys.readouterr().out
    assert "job MTTF 0.5 h" in out
    assert "node_fraction | 0.5 | user (--set)" in out


def test_an_unknown_parameter_is_refused():
    with pytest.raises(SystemExit):
        main(["--gpus", "64", "--set", "no_such=1"])


@pytest.mark.skipif(not RESULTS.is_file(), reason="no committed benchmark JSON")
def test_calibration_from_a_benchmark(capsys):
    main(["--gpus", "256", "--tp", "8", "--calibrate", str(RESULTS), "--days", "2", "--seeds", "1"])
    out = capsys.readouterr().out
    assert "measured:" in out and "calibrated from" in out
    assert "devices | None | plan: one GPU per process" in out
