"""The multi-node tests run on isolated nodes (``nanotron_recover.testbed.isolated_nodes``): each node its own
pid, mount, UTS and network namespace, a private ``/tmp`` and ``/dev/shm``, its own hostname and address; the test's
``tmp_path`` is the shared file system (run folders, checkpoints). Needs root: skipped elsewhere, saying why."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Iterator, Sequence

import pytest

from nanotron_recover.testbed import isolated_nodes as iso

REASON = iso.unavailable_reason() if sys.platform == "linux" else "Linux only"


@pytest.fixture
def isolated_bed(tmp_path: Path) -> Iterator[Callable[[Sequence[int]], iso.Bed]]:
    """``isolated_bed([2, 2, 2])`` starts a bed of that many nodes x slots (one per test), with ``tmp_path`` as the
    folder every node shares; torn down after the test whatever happened."""
    if REASON is not None:
        pytest.skip(f"isolated nodes unavailable: {REASON}")
    folder = tmp_path / "bed"

    def start(slots: Sequence[int]) -> iso.Bed:
        return iso.up(folder, slots, shared=tmp_path)

    try:
        yield start
    finally:
        iso.down(folder)


def placement(bed: iso.Bed) -> dict[str, list[int]]:
    """The world ranks running inside each live node now."""
    return {name: iso.node_ranks(node) for name, node in bed.nodes.items() if iso.node_alive(node)}


def ranks_in_nodes(bed: iso.Bed, run_dir: Path) -> dict[int, str]:
    """``{host pid: node}`` of every live process of ``run_dir``'s ranks in the bed's nodes (the launcher's own view,
    :func:`~nanotron_recover.launcher.runs.rank_processes`, sees only its node's pid namespace)."""
    needle = str(Path(run_dir).resolve()).encode()
    found = {}
    for name, node in bed.nodes.items():
        for pid in iso.node_pids(node):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"nanotron_recover.train" in cmdline and needle in cmdline:
                found[pid] = name
    return found
