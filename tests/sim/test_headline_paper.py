"""The pieces of ``benchmarks/headline.py --schedule paper`` that need no run (the runs themselves are
measured once, see benchmarks/RESULTS.md "Scale")."""

from pathlib import Path

import pytest

from benchmarks.headline import COMMITTED, _simulated_ratio, paper_interval

pytestmark = pytest.mark.skipif(not Path(COMMITTED).is_file(), reason="no committed headline.json")


def test_young_daly_interval_grows_with_the_time_between_failures():
    k5, why = paper_interval(5)
    assert k5 >= 1 and "Young/Daly" in why
    assert paper_interval(500)[0] > 3 * k5  # sqrt(100) = 10x the interval


def test_the_headline_prints_a_prediction_from_its_own_json():
    assert _simulated_ratio(COMMITTED) > 1.0


def test_a_file_that_cannot_be_calibrated_gives_no_prediction(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text('{"runs": {}}')
    assert _simulated_ratio(bad) is None
