"""benchmarks/overhead.py's breakdown: the interleaving of its variants and each mechanism's share of the step."""

import resource
import subprocess
import sys

import pytest

from benchmarks.overhead import PATHS, interleaved, job_usage, report_md, shares, summarise
from nanotron_recover.config import config_from_dict
from tests.conftest import make_tiny_config


def test_rounds_run_every_variant_once_in_alternating_order() -> None:
    names = ["stock", "recover", "recover-bare"]
    order = interleaved(names, 3)
    assert order == names + names[::-1] + names
    assert interleaved(["stock", "recover"], 2) == ["stock", "recover", "recover", "stock"]  # as before --breakdown


def test_shares_of_the_everything_on_step() -> None:
    med = {"stock": 1.00, "recover": 1.20, "recover-no-snapshots": 1.14, "recover-no-hang-monitor": 1.17,
           "recover-bare": 1.11}
    got = shares(med)
    assert got["node-local snapshots"] == pytest.approx(0.06 / 1.2)
    assert got["hang monitor"] == pytest.approx(0.03 / 1.2)
    assert got["both"] == pytest.approx(0.09 / 1.2)
    assert got["the data path (bare ReCoVer vs stock)"] == pytest.approx(0.11 / 1.2)
    assert shares({"stock": 1.0, "recover": 1.1}) == {}  # without --breakdown there is nothing to split


def test_every_variant_is_a_valid_config() -> None:
    for name, ft in PATHS.items():
        config = make_tiny_config(dp=2, fault_tolerance=ft)
        assert (config_from_dict(config).fault_tolerance is None) == (ft is None), name


def test_medians_means_and_each_rounds_own_ratio() -> None:
    run = lambda median_s, mean_s: {"median_step_s": median_s, "mean_step_s": mean_s}  # noqa: E731
    per_run = {"stock": [run(1.0, 1.0), run(0.5, 0.6), run(0.8, 0.8)],
               "recover": [run(1.1, 1.3), run(0.6, 0.6), run(0.8, 0.9)]}
    med, mean, rounds = summarise(per_run)
    assert med == {"stock": 0.8, "recover": 0.8} and mean == {"stock": 0.8, "recover": 0.9}
    assert rounds == pytest.approx([1.1, 1.2, 1.0])  # the drift from 1.0 to 0.5 s cancels within each round


def test_a_jobs_usage_is_what_its_waited_for_processes_added() -> None:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", "sum(range(5_000_000))"], check=True)
    usage = job_usage(before, resource.getrusage(resource.RUSAGE_CHILDREN))
    assert usage["cpu_user_s"] > 0.01 and usage["cpu_sys_s"] >= 0 and usage["involuntary_switches"] >= 0
    assert job_usage(before, before) == {"involuntary_switches": 0, "cpu_user_s": 0.0, "cpu_sys_s": 0.0}


def test_the_report_carries_each_variants_runs_ratios_and_usage() -> None:
    run = lambda t, switches: {"median_step_s": t, "mean_step_s": t, "involuntary_switches": switches,  # noqa: E731
                               "cpu_user_s": 1.0, "cpu_sys_s": 0.5}
    per_run = {"stock": [run(0.5, 30_000)], "recover": [run(0.45, 4_356_000)]}
    med, mean, rounds = summarise(per_run)
    data = {"command": "c", "machine": "m", "setup": "s", "median_step_s": med, "mean_step_s": mean,
            "ratio": 0.9, "mean_ratio": 0.9, "pairwise_ratio": 0.9, "round_ratios": rounds, "shares": shares(med)}
    md = report_md(data, per_run)
    assert "| recover | 1 | 450.00 | 450 | 0.900 | 450 | 0.900 | 4356 | 0.5 |" in md
    assert "ratio ReCoVer / stock = 0.900 (medians)" in md
