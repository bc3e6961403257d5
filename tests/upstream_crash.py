"""Open MPI's own crashes: a multi-process test that failed because Open MPI segfaulted inside its library is run
once more (see ``pytest_runtest_protocol`` in conftest.py).

Open MPI 5.0.11's ULFM has races between failure propagation, revocation and communicator creation that
segfault a process in ``ompi_comm_revoke_local``, ``ompi_errhandler_proc_failed_internal`` or
``ompi_group_decrement_proc_count`` while a repair runs (seen in the Slurm tests, and once in ~10 runs of
``tests/ft/test_hangs.py`` on a 2-core machine). Such a crash is not a verdict on our code, and a second
failure is reported as it is. The crashes are named in the run's output by Open MPI's backtrace, whose first
frame is inside an Open MPI library; nothing else is excused.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable

OPEN_MPI_CRASH = re.compile(
    r"Signal: (?:Segmentation fault|Bus error) \(\d+\)[\s\S]{0,400}?\[ ?1\] \S*/(lib(?:mpi|open-pal|pmix|prrte)\.so"
    r"[^\s(]*\((\w*))"
)
MAX_LOG_BYTES = 20 * 2**20


def open_mpi_crash(texts: Iterable[str]) -> str | None:
    """The crashing Open MPI function (``libmpi.so.40(ompi_comm_revoke_local``) in any of ``texts``, if any."""
    for text in texts:
        found = OPEN_MPI_CRASH.search(text)
        if found:
            return found.group(1)
    return None


def failure_texts(tmp_path: Path | None, reports: Iterable) -> list[str]:
    """What a failed test left to read: its failure reports and captured output, and the logs in its tmp_path."""
    texts = []
    for report in reports:
        texts.append(report.longreprtext or "")
        texts.extend(content for _, content in report.sections)
    if tmp_path is not None and Path(tmp_path).is_dir():
        for path in Path(tmp_path).rglob("*.log"):
            if path.is_file() and path.stat().st_size <= MAX_LOG_BYTES:
                texts.append(path.read_text(errors="replace"))
    return texts
