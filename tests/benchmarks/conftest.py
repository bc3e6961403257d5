"""Every benchmark run by these tests writes its record into a temporary folder, never among the measurements in
``benchmarks/results/records/`` (``benchmarks/lib/record.py``); subprocesses inherit the variable."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.lib.record import RECORDS_ENV


@pytest.fixture(autouse=True)
def records_folder(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The folder this test's benchmark records go to (empty at the start)."""
    folder = tmp_path_factory.mktemp("records")
    monkeypatch.setenv(RECORDS_ENV, str(folder))
    return folder
