"""Validation (a): the simulator, fed with a measured benchmark's costs and schedule, predicts its effective
throughput ratio (ReCoVer / checkpoint-restart) within 15%. Data: the committed benchmark JSON
(``benchmarks/results/headline.json``, written by ``benchmarks/headline.py``)."""

from pathlib import Path

import pytest

from nanotron_recover.sim.calibrate import from_benchmark_json
from nanotron_recover.sim.validate import predict_benchmark

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
MEASURED = [p for p in (RESULTS / "headline.json",) if p.is_file()]
# The paper-schedule runs (headline_paper*.json) are not asserted on: two runs of the same command measured 3.37
# and 4.35 (machine load), a spread wider than the tolerance; RESULTS.md lists their predictions.


@pytest.mark.skipif(not MEASURED, reason="no committed benchmark JSON")
@pytest.mark.parametrize("path", MEASURED, ids=[p.name for p in MEASURED])
def test_prediction_of_a_measured_benchmark_within_15_percent(path):
    stock, rec, sched = from_benchmark_json(path)
    pred = predict_benchmark(stock, rec, sched)
    print(f"{path.name}: predicted {pred.predicted_ratio:.3f}, measured {pred.measured_ratio:.3f} "
          f"({pred.relative_error:+.1%})")
    assert pred.recover.steps == pytest.approx(sched.steps) and pred.ckpt_restart.steps == pytest.approx(sched.steps)
    assert pred.ckpt_restart.crashes == len(sched.failures)  # every scheduled failure ended the stock job
    assert abs(pred.relative_error) <= 0.15


@pytest.mark.skipif(not MEASURED, reason="no committed benchmark JSON")
def test_the_prediction_depends_on_the_costs():
    """Not a constant: a restart 5x as expensive moves the predicted ratio up."""
    stock, rec, sched = from_benchmark_json(MEASURED[0])
    base = predict_benchmark(stock, rec, sched).predicted_ratio
    stock.values["restart_fixed_s"] *= 5
    stock.values["restart_per_process_s"] *= 5
    assert predict_benchmark(stock, rec, sched).predicted_ratio > base * 1.3

