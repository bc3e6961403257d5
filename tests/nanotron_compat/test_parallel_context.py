"""ReplicaParallelContext on an existing gloo world: nanotron's group layout for dp=1 and dp>1, the configured
short timeout on its groups, and NonBlockingP2P surviving two peers sending to each other at once."""

from __future__ import annotations

import json

import pytest

from tests.models import llama_harness as H

TIMEOUT_S = 180
pytestmark = [pytest.mark.slow, pytest.mark.timeout(TIMEOUT_S + 60)]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> list:
    out = tmp_path_factory.mktemp("ctx") / "ctx.json"
    H.run_module("tests.nanotron_compat.context_worker", [str(out)], n_procs=4, timeout_s=TIMEOUT_S)
    return json.loads(out.read_text())


def test_layout_dp1(report: list) -> None:
    # nanotron's rank matrix (ep, pp, dp, tp): tp fastest, then dp, then pp
    assert [r["tp2pp2"]["tp"] for r in report] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["tp2pp2"]["pp"] for r in report] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(r["tp2pp2"]["world"] == [0, 1, 2, 3] for r in report)


def test_layout_dp2(report: list) -> None:
    assert [r["tp2dp2"]["dp"] for r in report] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["tp2dp2"]["mp"] for r in report] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["cached_tp_rank"] for r in report] == [0, 1, 0, 1]  # nanotron's lru caches were cleared


def test_group_timeout_is_short(report: list) -> None:
    waited = report[0]["timeout_s"]
    assert waited is not None and waited < 10, waited  # configured 2 s; nanotron's default would be 600 s


def test_p2p_crossing_sends(report: list) -> None:
    assert all(r["p2p_ok"] for r in report)


def test_requires_initialised_world() -> None:
    import torch.distributed as torch_dist

    from nanotron_recover.nanotron_compat.parallel_context import ReplicaParallelContext

    if torch_dist.is_initialized():
        pytest.skip("this pytest process has a torch world")
    with pytest.raises(RuntimeError, match="init_process_group"):
        ReplicaParallelContext(1, 1, 1)
