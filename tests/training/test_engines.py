"""Engines: variable microbatch counts, loss divided by the global count M, 1F1B at PP2 with one microbatch and
its AFAB fallback at PP4, every split of M microbatches giving the same gradient (one 4-rank launch)."""

from __future__ import annotations

import json

import pytest

from tests.models import llama_harness as H

TIMEOUT_S = 240
pytestmark = [pytest.mark.slow, pytest.mark.timeout(TIMEOUT_S + 60)]

TOL = 1e-6
CHECKS = (
    "onef1b_single_mb",
    "divisor_half",
    "split_local",
    "split_dp",
    "fallback_1mb",
    "fallback_2mb",
    "native_3mb",
)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> list:
    out = tmp_path_factory.mktemp("engines") / "engines.json"
    H.run_module("tests.models.engines_worker", [str(out)], n_procs=4, timeout_s=TIMEOUT_S)
    return json.loads(out.read_text())


@pytest.mark.parametrize("check", CHECKS)
def test_engine_check(report: list, check: str) -> None:
    assert all(r["full_grad_max"] > 0 for r in report)
    assert max(r[check] for r in report) <= TOL, [r[check] for r in report]


def test_returned_losses_are_scaled_by_divisor(report: list) -> None:
    values = [r["scaled_losses"] for r in report if "scaled_losses" in r]
    assert len(values) == 2 and max(values) <= TOL  # the two output-stage ranks (one per dp replica)


def test_zero_microbatches_touch_nothing(report: list) -> None:
    assert all(r["zero_mb"] == 0 for r in report)


def test_build_engine() -> None:
    from nanotron.parallel.pipeline_parallel.engine import (
        AllForwardAllBackwardPipelineEngine,
        OneForwardOneBackwardPipelineEngine,
    )

    from nanotron_recover.training.engines import AllForwardAllBackwardEngine, OneForwardOneBackwardEngine, build_engine

    assert isinstance(build_engine("1F1B"), OneForwardOneBackwardEngine)
    assert isinstance(build_engine("afab"), AllForwardAllBackwardEngine)
    assert isinstance(build_engine(OneForwardOneBackwardPipelineEngine()), OneForwardOneBackwardEngine)
    assert isinstance(build_engine(AllForwardAllBackwardPipelineEngine), AllForwardAllBackwardEngine)
    with pytest.raises(ValueError):
        build_engine("gpipe")
