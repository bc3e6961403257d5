"""The nanotron import-cycle fix runs by itself once nanotron_recover is imported, and costs light tools nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _python(code: str) -> None:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_light_modules_import_neither_nanotron_nor_torch() -> None:
    _python("import sys, nanotron_recover.run.exit_codes, nanotron_recover.training.metrics, "
            "nanotron_recover.launcher.runs\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('nanotron', 'torch', 'wandb'))\n"
            "assert not heavy, heavy")


@pytest.mark.parametrize(
    "first",
    ["import nanotron_recover", "import nanotron, nanotron_recover"],  # the hook, or nanotron already imported
    ids=["hook", "nanotron-first"],
)
def test_any_nanotron_module_imports_after_nanotron_recover(first: str) -> None:
    _python(f"{first}\n"
            "from nanotron.parallel.pipeline_parallel.p2p import P2P\n"
            "import sys, nanotron, nanotron.config, nanotron.logging\n"
            "assert nanotron.logging.LoggingArgs is nanotron.config.LoggingArgs\n"
            "assert type(nanotron.__spec__.loader).__name__ == 'SourceFileLoader'  # the hook left no trace\n"
            "assert not any(type(f).__name__ == '_ShimAfterNanotron' for f in sys.meta_path)")
