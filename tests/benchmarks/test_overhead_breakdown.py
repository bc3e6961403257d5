"""benchmarks/overhead.py's breakdown: the interleaving of its variants and each mechanism's share of the step."""

import pytest

from benchmarks.overhead import PATHS, interleaved, shares
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
