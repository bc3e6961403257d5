"""How collectives wait for the peers (:mod:`nanotron_recover.ft.waiting`): the choice of mode, and the poll loop.

The real waits run in every multi-process test of the fault path (``test_ft_integ.py`` runs a kill in both modes).
"""

from __future__ import annotations

import pytest

from nanotron_recover.config import ConfigError, config_from_dict
from nanotron_recover.ft.waiting import FIRST_PAUSE_S, MAX_PAUSE_S, node_oversubscribed, resolve_mpi_wait, wait_asleep
from tests.conftest import make_tiny_config


def test_a_node_is_oversubscribed_when_it_holds_more_ranks_than_cores() -> None:
    assert node_oversubscribed(local_size=8, cores=2)
    assert not node_oversubscribed(local_size=2, cores=2)
    assert not node_oversubscribed(local_size=1, cores=1)


def test_auto_polls_only_on_an_oversubscribed_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "8")
    assert resolve_mpi_wait("auto") == "poll"
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2")
    assert resolve_mpi_wait("auto") == "block"
    assert resolve_mpi_wait("poll") == "poll" and resolve_mpi_wait("block") == "block"
    with pytest.raises(ValueError, match="mpi_wait"):
        resolve_mpi_wait("spin")


class _Request:
    """Completes at its ``n``-th test."""

    def __init__(self, n: int) -> None:
        self.n, self.tests = n, 0

    def Test(self) -> bool:  # noqa: N802 - mpi4py's name
        self.tests += 1
        return self.tests >= self.n


def test_the_poll_sleeps_between_tests_doubling_up_to_the_longest_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    pauses: list[float] = []
    monkeypatch.setattr("nanotron_recover.ft.waiting.time.sleep", pauses.append)
    req = _Request(12)
    wait_asleep(req)
    assert req.tests == 12 and len(pauses) == 11  # a sleep between two tests, none after the last
    assert pauses[0] == FIRST_PAUSE_S
    assert all(b == min(2 * a, MAX_PAUSE_S) for a, b in zip(pauses, pauses[1:]))
    assert pauses[-1] == MAX_PAUSE_S
    done = _Request(1)
    wait_asleep(done)
    assert done.tests == 1


def test_the_config_names_the_key_of_an_unknown_mode() -> None:
    config = make_tiny_config(dp=2, fault_tolerance={"enabled": True, "mpi_wait": "spin"})
    with pytest.raises(ConfigError, match="fault_tolerance.mpi_wait"):
        config_from_dict(config)
